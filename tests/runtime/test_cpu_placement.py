"""Where kiln's processes compute (runtime/threads.py): every thread of a pinned process inside its mask (TVM's
pool included), `--core-cpus` refused for CPUs it cannot use, and the CPU-list helpers. `kiln serve --core-cpus`
placing the core and the API server apart: tests/server/test_server_cli.py; replicas on disjoint CPUs:
tests/disagg/test_router_serve.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kiln.runtime import threads

import kiln

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import free_port  # noqa: E402

MODEL = "llama(vocab=96, hidden=64, layers=2, heads=2, kv_heads=1, ffn=128, max_position=256)"
CPUS = threads.allowed_cpus()
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="placement needs at least 2 CPUs to place anything apart")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """A cpu artifact with TVM kernels (the recipe of tests/codegen/test_artifact_runtime_only.py: its build is
    cached)."""
    work = tmp_path_factory.mktemp("placement")
    recipe = work / "r.dsl"
    recipe.write_text(f"recipe r {{\n  model   = {MODEL}\n  weights = random(seed=0)\n  target  = cpu\n}}\n")
    kiln.compile(recipe, work / "art", progress=False)
    return work / "art"


@pytest.mark.parametrize("text, cpus", [("0", [0]), ("0-3,8", [0, 1, 2, 3, 8]), ("5,1-2,2", [1, 2, 5]),
                                        (" 1 - 2 ", [1, 2])])
def test_cpu_lists_parse(text, cpus):
    assert threads.parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "1,,2", "0x1"])
def test_bad_cpu_lists_say_why(text):
    with pytest.raises(ValueError, match="CPU list|low to high"):
        threads.parse_cpu_list(text)


def test_cpu_lists_format_as_ranges():
    assert threads.format_cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert threads.parse_cpu_list(threads.format_cpu_list([0, 2, 3, 4, 9])) == [0, 2, 3, 4, 9]


def test_split_cpus_into_disjoint_contiguous_slices():
    assert threads.split_cpus(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert threads.split_cpus([0, 1, 2, 3, 4], 3) == [[0, 1], [2, 3], [4]]
    assert threads.split_cpus([4, 6], 2) == [[4], [6]]
    assert threads.split_cpus([0, 1], 3) is None  # fewer CPUs than cores: they share


def test_check_cpus_names_the_cpu_outside_the_mask():
    threads.check_cpus(CPUS)
    with pytest.raises(ValueError, match=r"CPU 4096 is not one this process may run on \(allowed: "):
        threads.check_cpus([CPUS[0], 4096])


@needs_two
def test_pin_moves_threads_started_before_it():
    code = textwrap.dedent(f"""\
        import os, threading
        from kiln.runtime import threads
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        threads.pin([{CPUS[-1]}])
        late = threading.Thread(target=stop.wait); late.start()
        masks = {{t: os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}}
        stop.set()
        assert len(masks) >= 3 and all(m == {{{CPUS[-1]}}} for m in masks.values()), masks
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@needs_two
def test_tvm_pool_stays_inside_a_confined_process(artifact):
    """TVM binds its workers to the machine's CPUs 1..n-1 and widens the calling thread to every CPU unless told
    not to: a process confined to one CPU with two threads kept a thread on every CPU (before threads.py's fix)."""
    code = textwrap.dedent(f"""\
        import os
        os.sched_setaffinity(0, {{{CPUS[-1]}}})
        import kiln, torch
        torch.set_num_threads(2)
        llm = kiln.LLM({str(artifact)!r})
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, kiln.SamplingParams(max_tokens=8, ignore_eos=True))
        print({{t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}})
        """)
    env = {k: v for k, v in os.environ.items() if k != "TVM_BIND_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    assert "using torch kernels" not in r.stderr, r.stderr  # the TVM pool ran
    per_thread = eval(r.stdout.strip().splitlines()[-1])
    assert per_thread and all(m == [CPUS[-1]] for m in per_thread.values()), per_thread


@pytest.mark.parametrize("flag, message", [
    ("4096", "--core-cpus 4096: CPU 4096 is not one this process may run on"),
    ("2-1", "argument --core-cpus: '2-1' in '2-1': a range runs from low to high"),
])
def test_serve_refuses_cpus_it_cannot_use(artifact, flag, message, capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit) as exit_:  # argparse's exit, or the CLI's status for a user's error
        raise SystemExit(main(["serve", str(artifact), "--port", str(free_port()), "--core-cpus", flag]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


def test_tvm_pool_size_kiln_chose_for_a_parent_is_chosen_afresh(monkeypatch):
    """TVM_NUM_THREADS reaches child processes: one kiln set for another process's torch pool (marked) follows this
    process's torch threads; one the user set is kept."""
    import torch
    from kiln.runtime import tvm_kernels

    mine = str(torch.get_num_threads())
    monkeypatch.setenv("TVM_NUM_THREADS", "7")
    monkeypatch.setenv(tvm_kernels.TVM_THREADS_SET_BY_KILN, "7")  # a parent's choice, inherited
    tvm_kernels.configure_threads()
    assert os.environ["TVM_NUM_THREADS"] == mine == os.environ[tvm_kernels.TVM_THREADS_SET_BY_KILN]
    monkeypatch.setenv("TVM_NUM_THREADS", "5")  # the user's
    tvm_kernels.configure_threads()
    assert os.environ["TVM_NUM_THREADS"] == "5"
