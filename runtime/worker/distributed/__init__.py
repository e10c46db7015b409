"""Running a parallel artifact: communicators (comm.py), the step commands rank 0 sends (commands.py), the executor
the engine drives (executor.py) and the rank workers (worker.py)."""
