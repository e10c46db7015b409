"""Running the model: the executor the engine core drives, the model runner and CUDA-graph runner, the memory
plan, LoRA slots, and for parallel artifacts the rank workers (distributed/). Rank 0 runs inside the engine-core
process; ranks >= 1 run `python -m kiln.runtime.worker.distributed.worker`."""
