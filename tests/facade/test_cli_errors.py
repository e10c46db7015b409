"""Bad input gets `file:line:col`, the line, a caret, a reason, exit status 2 — and no traceback."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.cli import main

GOOD_MODEL = "llama(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)"


def write(tmp_path: Path, body: str, name: str = "r.dsl") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body).lstrip("\n"))
    return p


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=300)


def test_malformed_recipe_exit_2_caret_no_traceback(tmp_path):
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
          target = cpu +
        }}
        """)
    res = run_cli("compile", str(p), "-o", str(tmp_path / "out"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"{p}:4:"), res.stderr
    lines = res.stderr.splitlines()
    assert lines[1].strip() == "target = cpu +"
    assert lines[2].strip().startswith("^")
    assert not (tmp_path / "out").exists()


def test_unknown_op_is_located(tmp_path, capsys):
    model = write(tmp_path, """
        model m(vocab: int, hidden: int) {
          param embed: [vocab, hidden] from "e"
          forward(tokens) {
            h = embedding(tokens, embed)
            return logits(relu_squared(h), embed)
          }
        }
        """, "m.dsl")
    p = write(tmp_path, """
        use "m.dsl"
        recipe r {
          model = m(vocab=16, hidden=8)
          weights = random(seed=0)
        }
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{model}:5:"), err
    assert "unknown op 'relu_squared'" in err
    caret_line = err.splitlines()[2]
    assert caret_line.index("^") == err.splitlines()[1].index("relu_squared")


def test_unknown_model_parameter(tmp_path, capsys):
    p = write(tmp_path, """
        recipe r {
          model = llama(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, rope_thta=1.0)
          weights = random(seed=0)
        }
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "rope_thta" in err and "rope_theta" in err


def test_shape_mismatch_is_located_in_model(tmp_path, capsys):
    write(tmp_path, """
        model m(vocab: int, hidden: int) {
          param embed: [vocab, hidden] from "e"
          param w: [hidden, hidden + 1] from "w"
          forward(tokens) {
            h = linear(embedding(tokens, embed), w)
            return logits(h, embed)
          }
        }
        """, "m.dsl")
    p = write(tmp_path, """
        use "m.dsl"
        recipe r {
          model = m(vocab=16, hidden=8)
          weights = random(seed=0)
        }
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert "m.dsl:5:" in err and "linear" in err and "9" in err


def test_missing_checkpoint_dir(tmp_path, capsys):
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = "hf:./nope"
        }}
        """)
    assert main(["compile", str(p), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{p}:3:" in err and "does not exist" in err


@pytest.fixture
def llama_ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _copy_ckpt(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_checkpoint_missing_tensor_names_it(tmp_path, llama_ckpt, capsys):
    from safetensors.torch import load_file, save_file

    ck = _copy_ckpt(llama_ckpt, tmp_path / "ck")
    tensors = load_file(ck / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ck), "-o", str(recipe)]) == 0
    assert main(["compile", str(recipe), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.1.mlp.up_proj.weight" in err
    assert "llama.dsl:" in err  # points at the param declaration in the model file
    assert not (tmp_path / "o").exists()


def test_checkpoint_wrong_shape_names_it(tmp_path, llama_ckpt, capsys):
    from safetensors.torch import load_file, save_file

    ck = _copy_ckpt(llama_ckpt, tmp_path / "ck")
    tensors = load_file(ck / "model.safetensors")
    t = tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = t[:-1].contiguous()
    save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ck), "-o", str(recipe)]) == 0
    assert main(["compile", str(recipe), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.k_proj.weight" in err
    assert str(list(t.shape)) in err or str(tuple(t.shape)) in err


def test_from_hf_unsupported_architecture(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    res = run_cli("recipe", "from-hf", str(ck))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "GPT2LMHeadModel" in res.stderr and "LlamaForCausalLM" in res.stderr


def test_truncated_checkpoint_is_exit_2_without_traceback(tmp_path, llama_ckpt, capsys):
    ck = _copy_ckpt(llama_ckpt, tmp_path / "ck")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 3])
    recipe = tmp_path / "r.dsl"
    assert main(["recipe", "from-hf", str(ck), "-o", str(recipe)]) == 0
    assert main(["compile", str(recipe), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: not a readable safetensors file" in err and not (tmp_path / "o").exists()


def test_truncated_artifact_weights_are_exit_2_without_traceback(tmp_path, capsys):
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
        }}
        """)
    assert main(["compile", str(p), "-o", str(tmp_path / "art"), "--no-progress"]) == 0
    (shard,) = (tmp_path / "art" / "weights" / "rank0").iterdir()
    shard.write_bytes(shard.read_bytes()[:1000])
    for argv in (["generate", str(tmp_path / "art"), "1 2", "--token-ids"], ["serve", str(tmp_path / "art")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is not the one compiled" in err and "recompile" in err, err


def test_non_utf8_recipe_is_located_not_a_traceback(tmp_path, capsys):
    p = tmp_path / "latin1.dsl"
    p.write_bytes(f"recipe r {{\n  model = {GOOD_MODEL}  # caf\xe9\n  weights = random(seed=0)\n}}\n".encode("latin-1"))
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    col = len(f"  model = {GOOD_MODEL}  # caf") + 1
    assert err.startswith(f"{p}:2:{col}: error: not UTF-8 text: byte 0xe9"), err


@pytest.mark.parametrize("value, message", [
    ("rope_theta=1e999999", "number 1e999999 is too large: it is not a finite float"),
    ("rope_theta=1e300 * 1e300", "'rope_theta' = inf: a model config value must be a finite number"),
    ("rope_theta=0.0", "'rope_theta' must be > 0, got 0"),
    ("norm_eps=-1", "'norm_eps' must be > 0 and < 1, got -1"),
    ("max_position=0", "'max_position' must be >= 1 and <= 16,777,216, got 0"),
    ("max_position=1000000000", "'max_position' must be >= 1 and <= 16,777,216, got 1,000,000,000"),
])
def test_config_values_out_of_range_are_located(tmp_path, capsys, value, message):
    """Values that type-check but would compile to a broken artifact (inf theta, NaN norms, a 64 GB rotary table)."""
    key = value.split("=")[0]
    model = GOOD_MODEL[:-1] + f", {value})"
    p = write(tmp_path, f"""
        recipe r {{
          model = {model}
          weights = random(seed=0)
        }}
        """)
    assert main(["compile", str(p), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    col = f"  model = {model}".index(value[len(key) + 1:]) + 1
    assert err.startswith(f"{p}:2:{col}: error: {message}"), err
    assert not (tmp_path / "o").exists()


def test_serve_max_model_len_out_of_range_is_located(tmp_path, capsys):
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
          serve {{ max_model_len = 100000000 }}
        }}
        """)
    assert main(["compile", str(p)]) == 2
    assert capsys.readouterr().err.startswith(f"{p}:4:27: error: 'serve.max_model_len' must be >= 1 and <= 16,777,216")


@pytest.mark.parametrize("text, where, message", [
    ("{,}", "1:2", "invalid JSON: Expecting property name"),
    ("[]", "1:1", "config.json must be a JSON object, got list"),
    ('{"architectures": ["LlamaForCausalLM"],\n "hidden_size": "64"}', "2:2",
     "'hidden_size' must be an integer, got str '64'"),
    ('{"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": "yes"}', "1:41", "'tie_word_embeddings' must be true or false"),
    ('{"architectures": ["LlamaForCausalLM"], "rope_scaling": "linear"}', "1:41", "'rope_scaling' must be an object"),
    ('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8}', "1:1", "config.json has no 'num_attention_heads'"),
])
def test_recipe_from_hf_bad_config_is_located(tmp_path, capsys, text, where, message):
    (tmp_path / "config.json").write_text(text)
    assert main(["recipe", "from-hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path / 'config.json'}:{where}: error: {message}"), err


@pytest.mark.parametrize("port, message", [("99999", "99999 is out of range: a port is an integer in 1..65535"),
                                           ("0", "out of range"), ("http", "'http' is not a port number")])
def test_serve_port_out_of_range_is_a_flag_error(tmp_path, capsys, port, message):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tmp_path), "--port", port])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --port" in err and message in err and "Traceback" not in err


@pytest.fixture(scope="module")
def served_recipe_artifact(tmp_path_factory):
    import kiln

    work = tmp_path_factory.mktemp("serve_defaults")
    (work / "r.dsl").write_text(f'recipe r {{\n  model = {GOOD_MODEL}\n  weights = random(seed=0)\n'
                                f'  scheduler {{ kv_reserve = all }}\n'
                                f'  serve {{ port = 8765; host = "0.0.0.0"; served_name = "tiny-r"; '
                                f'reasoning_effort = {{ low: 64, deep: 9000 }} }}\n}}\n')
    kiln.compile(work / "r.dsl", work / "art", progress=False)
    return work / "art"


@pytest.mark.parametrize("flags, host, port", [
    ([], "0.0.0.0", 8765),  # the recipe's serve section
    (["--port", "9000"], "0.0.0.0", 9000),  # a flag overrides it
    (["--host", "127.0.0.1", "--port", "9001"], "127.0.0.1", 9001),
])
def test_recipe_serve_section_is_the_default_of_kiln_serve(served_recipe_artifact, monkeypatch, flags, host, port):
    import kiln.runtime.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda artifact, **kw: seen.update(kw) or 0)  # serve returns the exit status
    assert main(["serve", str(served_recipe_artifact), *flags]) == 0
    assert (seen["host"], seen["port"]) == (host, port)
    assert seen["metrics_public"] is False and seen["served_model_name"] is None  # the server reads served_name


def test_recipe_reasoning_effort_and_kv_reserve_reach_the_server_and_engine(served_recipe_artifact, monkeypatch):
    import json

    import kiln.runtime.launch as launch
    from kiln.runtime.config import scheduler_config_from_manifest

    manifest = json.loads((served_recipe_artifact / "manifest.json").read_text())
    assert manifest["serve"]["reasoning_effort"] == {"low": 64, "deep": 9000}
    assert scheduler_config_from_manifest(manifest).kv_reserve == "all"
    seen = {}
    monkeypatch.setattr(launch, "serve", lambda artifact, **kw: seen.update(kw) or 0)
    assert main(["serve", str(served_recipe_artifact)]) == 0
    assert seen["reasoning_efforts"] == {"low": 64, "deep": 9000}
    assert main(["serve", str(served_recipe_artifact), "--reasoning-effort", "low=32, high=4096"]) == 0
    assert seen["reasoning_efforts"] == {"low": 32, "deep": 9000, "high": 4096}  # the flag over the recipe


@pytest.mark.parametrize("flag, message", [("low=x", "EFFORT=TOKENS"), ("low", "EFFORT=TOKENS"),
                                           ("Low=5", "lower-case words")])
def test_serve_bad_reasoning_effort_is_a_flag_error(tmp_path, capsys, flag, message):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tmp_path), "--reasoning-effort", flag])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --reasoning-effort" in err and message in err, err


@pytest.mark.parametrize("section, message", [
    ("serve { reasoning_effort = { low: -1 } }", "'reasoning_effort.low' must be a thinking budget in tokens"),
    ("serve { reasoning_effort = { Low: 5 } }", "reasoning effort 'Low' must be a lower-case word"),
    ("serve { reasoning_effort = 5 }", "'reasoning_effort' must be a map of reasoning efforts"),
    ("scheduler { kv_reserve = maybe }", "'kv_reserve' must be one of reasoning, all, none"),
])
def test_bad_reasoning_effort_and_kv_reserve_in_a_recipe_are_located(tmp_path, capsys, section, message):
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
          {section}
        }}
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{p}:4:") and message in err and "Traceback" not in err, err


def test_serve_defaults_without_a_serve_section(tmp_path, monkeypatch):
    import kiln.runtime.launch as launch

    import kiln

    (tmp_path / "r.dsl").write_text(f"recipe r {{\n  model = {GOOD_MODEL}\n  weights = random(seed=0)\n}}\n")
    kiln.compile(tmp_path / "r.dsl", tmp_path / "art", progress=False)
    seen = {}
    monkeypatch.setattr(launch, "serve", lambda artifact, **kw: seen.update(kw) or 0)  # serve returns the exit status
    assert main(["serve", str(tmp_path / "art"), "--metrics-public"]) == 0
    assert (seen["host"], seen["port"], seen["metrics_public"]) == ("127.0.0.1", 8000, True)
    assert seen["reasoning_efforts"] is None  # the runtime's table


def test_recipe_values_contradicting_the_checkpoint_config_warn(tmp_path, llama_ckpt, capsys):
    import json

    import kiln

    cfg = json.loads((llama_ckpt / "config.json").read_text())
    ck = _copy_ckpt(llama_ckpt, tmp_path / "ck")
    model = (f"llama(vocab={cfg['vocab_size']}, hidden={cfg['hidden_size']}, layers={cfg['num_hidden_layers']}, "
             f"heads={cfg['num_attention_heads']}, kv_heads={cfg['num_key_value_heads']}, "
             f"ffn={cfg['intermediate_size']}, norm_eps=0.001)")
    p = write(tmp_path, f"""
        recipe hand {{
          model = {model}
          weights = "hf:./ck"
        }}
        """)
    assert cfg["rms_norm_eps"] != 0.001 and cfg["max_position_embeddings"] != 4096  # llama's default max_position
    assert main(["compile", str(p)]) == 0
    err = capsys.readouterr().err
    col = f"  model = {model}".index("0.001") + 1
    assert f"{p}:2:{col}: warning: norm_eps = 0.001 (the recipe's value), but {ck / 'config.json'} implies " \
           f"norm_eps = {float(cfg['rms_norm_eps'])!r} (rms_norm_eps)" in err, err
    assert f"{p}:2:11: warning: max_position = 4096 (llama's default), but {ck / 'config.json'} implies " \
           f"max_position = {cfg['max_position_embeddings']} (max_position_embeddings)" in err, err
    with pytest.warns(kiln.driver.SourceWarning) as caught:  # the Python API warns too
        res = kiln.compile(p)
    assert sorted(str(w.message).split(" = ")[0] for w in caught) == ["max_position", "norm_eps"]
    assert {w.message.split(" = ")[0] for w in res.warnings} == {"norm_eps", "max_position"}
    recipe = tmp_path / "from_hf.dsl"
    assert main(["recipe", "from-hf", str(ck), "-o", str(recipe)]) == 0
    capsys.readouterr()
    assert main(["compile", str(recipe)]) == 0 and "warning" not in capsys.readouterr().err


def test_one_error_root_for_everything_a_user_can_get_wrong(tmp_path, capsys):
    """kiln.errors.KilnError is the base of the compile side's and the runtime's errors; the CLI catches it."""
    from kiln.codegen.errors import CheckpointError, CodegenError, TokenizerError, WeightError
    from kiln.compiler import PassError
    from kiln.dsl.errors import SourceError
    from kiln.passes.kernel_selection import KernelSelectionError
    from kiln.passes.shape_inference import ShapeInferenceError
    from kiln.runtime.errors import ArtifactError, KilnRuntimeError, RequestError

    from kiln.errors import KilnError

    for cls in (SourceError, PassError, KernelSelectionError, ShapeInferenceError, CodegenError, WeightError,
                CheckpointError, TokenizerError, KilnRuntimeError, ArtifactError, RequestError):
        assert issubclass(cls, KilnError), cls
    (tmp_path / "bad_pass_mod.py").write_text(
        "from kiln.compiler import Pass, PassError, register_pass\n\n"
        "@register_pass('refusing_pass')\nclass Refusing(Pass):\n"
        "    def run(self, program, ctx):\n        raise PassError('this pass refuses the program')\n")
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
          passes {{ after fuse_qkv: "bad_pass_mod:Refusing" }}
        }}
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this pass refuses the program") and "Traceback" not in err


def test_unknown_target_in_the_recipe_is_located_with_the_registry(tmp_path, capsys):
    """The target registry (compiler/targets.py) is the one list of targets: the DSL keeps none."""
    p = write(tmp_path, f"""
        recipe r {{
          model = {GOOD_MODEL}
          weights = random(seed=0)
          target = h20
        }}
        """)
    assert main(["compile", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{p}:4:12: error: unknown target 'h20' — did you mean 'h200'? (known: h100, h200, cpu)"), err
