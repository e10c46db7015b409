"""The pass API: ordering by `requires`, editing the pipeline, the log, IR dumps, and custom passes."""
import sys
import textwrap

import pytest
from kiln.compiler import Pass, PassContext, PassError, PassManager, Program, parse_program, print_program
from kiln.compiler.pass_manager import load_pass
from kiln.passes.dead_code_elimination import DeadCodeElimination

TEXT = """
program p dtype=f32 {
  config {}
  param w: f32[8, 8] from ["w"]
  graph entry {
    %x = input "x" : f32[T, 8]
    %w = param "w" : f32[8, 8]
    %y = linear(%x, %w)
    %dead = silu(%x)
    return %y
  }
}
"""


class Noop(Pass):
    name = "noop"

    def run(self, program, ctx):
        ctx.stats["looked"] = True
        return program


class NeedsNoop(Pass):
    name = "needs_noop"
    requires = ("noop",)

    def run(self, program, ctx):
        return program


class BreaksIR(Pass):
    name = "breaks_ir"

    def run(self, program, ctx):
        g = program.entry.copy()
        g.replace("y", g.node("y").with_(op="no_such_op"))
        return program.with_graphs({"entry": g})


def test_requires_must_run_earlier():
    with pytest.raises(PassError, match=r"'needs_noop' requires 'noop' to run before it, but 'noop' comes after it"):
        PassManager([NeedsNoop(), Noop()])  # refused when the pipeline is built, before anything runs
    with pytest.raises(PassError, match=r"'needs_noop' requires 'noop', which is not in the pipeline"):
        PassManager([NeedsNoop()])
    PassManager([Noop(), NeedsNoop()]).run(parse_program(TEXT))


def test_insert_after_insert_before_remove():
    pm = PassManager.for_target("cpu")
    pm.insert_after("fuse_qkv", Noop())
    assert pm.names[pm.names.index("fuse_qkv") + 1] == "noop"
    with pytest.raises(PassError, match="'needs_noop' requires 'noop' to run before it"):
        pm.insert_before("shape_inference", NeedsNoop())
    pm.insert_after("noop", NeedsNoop())
    assert pm.names[pm.names.index("noop") + 1] == "needs_noop"
    with pytest.raises(PassError, match="cannot disable 'noop': 'needs_noop' requires it"):
        pm.remove("noop")
    pm.remove("needs_noop")
    pm.remove("noop")
    assert pm.names == PassManager.for_target("cpu").names
    with pytest.raises(PassError, match="no pass named 'fuse_qvk'"):
        pm.insert_after("fuse_qvk", Noop())


def test_log_records_and_unchanged_pass():
    ctx = PassContext()
    program = parse_program(TEXT)
    out = PassManager([Noop(), DeadCodeElimination()]).run(program, ctx)
    noop, dce = ctx.log
    assert (noop.name, noop.changed, noop.stats) == ("noop", False, {"looked": True})
    assert noop.nodes_before == noop.nodes_after == 4
    assert (dce.name, dce.changed, dce.nodes_before, dce.nodes_after) == ("dead_code_elimination", True, 4, 3)
    assert dce.to_json()["stats"] == {"nodes_removed": 1, "params_removed": 0}
    assert "dead" not in out.entry and "dead" in program.entry  # the input was not mutated


def test_invalid_ir_after_a_pass_names_the_pass():
    with pytest.raises(PassError, match="IR is invalid after pass 'breaks_ir'"):
        PassManager([BreaksIR()]).run(parse_program(TEXT))


def test_dump_dir_has_the_ir_after_every_pass(tmp_path):
    pm = PassManager.for_target("cpu")
    out = pm.run(parse_program(TEXT), PassContext(dump_dir=tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_input.ir"] + [f"{k:02d}_{n}.ir" for k, n in enumerate(pm.names, start=1)]
    assert (tmp_path / files[-1]).read_text() == print_program(out)
    assert isinstance(parse_program((tmp_path / files[-1]).read_text()), Program)


def test_custom_pass_from_a_module_spec(tmp_path, monkeypatch):
    (tmp_path / "my_kiln_passes.py").write_text(textwrap.dedent('''
        from kiln.compiler import Pass, register_pass

        @register_pass("count_linears", requires=("shape_inference",))
        class CountLinears(Pass):
            """Requires: typed IR. Guarantees: nothing changes; ctx.stats["linears"] counts linears."""
            def run(self, program, ctx):
                ctx.stats["linears"] = sum(g.count("linear") for g in program.graphs.values())
                return program

        class NotAPass:
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_kiln_passes", raising=False)
    pm = PassManager.for_target("cpu")
    pm.insert_after("fuse_qkv", load_pass("my_kiln_passes:CountLinears"))
    ctx = PassContext()
    pm.run(parse_program(TEXT), ctx)
    (record,) = [r for r in ctx.log if r.name == "count_linears"]
    assert record.stats == {"linears": 1} and not record.changed

    with pytest.raises(PassError, match="must read 'package.module:ClassName'"):
        load_pass("my_kiln_passes.CountLinears")
    with pytest.raises(PassError, match="module 'my_kiln_passes' .* has no 'Missing'"):
        load_pass("my_kiln_passes:Missing")
    with pytest.raises(PassError, match="not a kiln Pass subclass"):
        load_pass("my_kiln_passes:NotAPass")
