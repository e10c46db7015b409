"""Codegen test helpers: Llama-like programs as IR text, matching safetensors checkpoints, artifact loading."""
from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import torch
from kiln.codegen.render import template_env
from kiln.compiler import Program, parse_program
from kiln.compiler.ops import OPS
from kiln.runtime.forward_batch import ForwardBatch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 48, 96
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def _block_params(block: str, prefix: str) -> list[str]:
    p = f"{prefix}.{{i}}"
    return [
        f'param {block}.attn_norm: DT[{HIDDEN}] from ["{p}.input_layernorm.weight"] {{block="{block}"}}',
        (f'param {block}.wqkv: DT[{Q + 2 * KV}, {HIDDEN}] from ["{p}.self_attn.q_proj.weight", '
         f'"{p}.self_attn.k_proj.weight", "{p}.self_attn.v_proj.weight"] {{block="{block}"}}'),
        (f'param {block}.bqkv: DT[{Q + 2 * KV}] from ["{p}.self_attn.q_proj.bias", '
         f'"{p}.self_attn.k_proj.bias", "{p}.self_attn.v_proj.bias"] {{block="{block}"}}'),
        f'param {block}.wo: DT[{HIDDEN}, {Q}] from ["{p}.self_attn.o_proj.weight"] {{block="{block}"}}',
        f'param {block}.mlp_norm: DT[{HIDDEN}] from ["{p}.post_attention_layernorm.weight"] {{block="{block}"}}',
        (f'param {block}.w_gate_up: DT[{2 * FFN}, {HIDDEN}] from ["{p}.mlp.gate_proj.weight", '
         f'"{p}.mlp.up_proj.weight"] {{block="{block}"}}'),
        f'param {block}.w_down: DT[{HIDDEN}, {FFN}] from ["{p}.mlp.down_proj.weight"] {{block="{block}"}}',
    ]


def _block_graph(block: str, attentions: int) -> str:
    """A pre-norm Llama layer: fused qkv + bias, slices, rope, GQA attention (x `attentions`), fused add+norm,
    fused gate/up + silu_mul. With 2 attentions the second one uses a sliding window of 3 and an explicit scale."""
    attn = ['    %a = attention(%q_rot, %k_rot, %v) {kernel="cpu.paged_attention"}']
    if attentions == 2:
        attn = ['    %a0 = attention(%q_rot, %k_rot, %v) {kernel="cpu.paged_attention"}',
                '    %a1 = attention(%q_rot, %k_rot, %v) {kernel="cpu.paged_attention", scale=0.25, sliding_window=3}',
                '    %a = add(%a0, %a1) {kernel="cpu.add"}']
    return "\n".join([
        f"  graph {block} {{",
        f'    %h = input "h" : DT[T, {HIDDEN}]',
        f'    %attn_norm = param "{block}.attn_norm" : DT[{HIDDEN}]',
        '    %x = rms_norm(%h, %attn_norm) {eps=1e-05, kernel="cpu.rms_norm"}',
        f'    %wqkv = param "{block}.wqkv" : DT[{Q + 2 * KV}, {HIDDEN}]',
        f'    %bqkv = param "{block}.bqkv" : DT[{Q + 2 * KV}]',
        '    %qkv = linear(%x, %wqkv, %bqkv) {kernel="cpu.linear"}',
        f'    %q_flat = slice(%qkv) {{kernel="inline", start=0, stop={Q}}}',
        f'    %k_flat = slice(%qkv) {{kernel="inline", start={Q}, stop={Q + KV}}}',
        f'    %v_flat = slice(%qkv) {{kernel="inline", start={Q + KV}, stop={Q + 2 * KV}}}',
        f'    %q = view(%q_flat) {{kernel="inline", shape=[{HEADS}, {HEAD_DIM}]}}',
        f'    %k = view(%k_flat) {{kernel="inline", shape=[{KV_HEADS}, {HEAD_DIM}]}}',
        f'    %v = view(%v_flat) {{kernel="inline", shape=[{KV_HEADS}, {HEAD_DIM}]}}',
        '    %q_rot = rope(%q) {kernel="cpu.rope", theta=10000.0}',
        '    %k_rot = rope(%k) {kernel="cpu.rope", theta=10000.0}',
        *attn,
        f'    %wo = param "{block}.wo" : DT[{HIDDEN}, {Q}]',
        '    %o = linear(%a, %wo) {kernel="cpu.linear"}',
        f'    %mlp_norm = param "{block}.mlp_norm" : DT[{HIDDEN}]',
        '    %normed = add_rms_norm(%o, %h, %mlp_norm) {eps=1e-05, kernel="cpu.add_rms_norm"}',
        '    %x2 = getitem(%normed) {index=0, kernel="inline"}',
        '    %h2 = getitem(%normed) {index=1, kernel="inline"}',
        f'    %w_gate_up = param "{block}.w_gate_up" : DT[{2 * FFN}, {HIDDEN}]',
        '    %gate_up = linear(%x2, %w_gate_up) {kernel="cpu.linear"}',
        '    %act = silu_mul(%gate_up) {kernel="cpu.silu_mul"}',
        f'    %w_down = param "{block}.w_down" : DT[{HIDDEN}, {FFN}]',
        '    %down = linear(%act, %w_down) {kernel="cpu.linear"}',
        '    %out = add(%down, %h2) {kernel="cpu.add"}',
        "    return %out",
        "  }",
    ])


def program_text(layers: int = 2, dtype: str = "f32", tail_layers: int = 0) -> str:
    """`decoder` x layers (one attention each), then optionally `tail` x tail_layers (two attentions each); the
    tail's layers are model.layers.{layers}... of the checkpoint (`{i}` is the global layer index)."""
    blocks = [("decoder", layers, "model.layers", 1)] + ([("tail", tail_layers, "model.layers", 2)] if tail_layers else [])
    entry = [
        "  graph entry {",
        '    %tokens = input "tokens" : i32[T]',
        f'    %embed = param "embed" : DT[{VOCAB}, {HIDDEN}]',
        '    %x = embedding(%tokens, %embed) {kernel="cpu.embedding"}',
    ]
    h = "x"
    for name, _, _, _ in blocks:
        entry.append(f'    %{name}_out = block(%{h}) {{block="{name}", kernel="inline"}}')
        h = f"{name}_out"
    entry += [
        f'    %norm = param "norm" : DT[{HIDDEN}]',
        f'    %y = rms_norm(%{h}, %norm) {{eps=1e-05, kernel="cpu.rms_norm"}}',
        f'    %lm_head = param "lm_head" : DT[{VOCAB}, {HIDDEN}]',
        '    %logits = logits(%y, %lm_head) {kernel="cpu.logits"}',
        "    return %logits",
        "  }",
    ]
    config = {"vocab": VOCAB, "hidden": HIDDEN, "layers": layers, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "ffn": FFN, "max_position": 64}
    lines = [f"program tiny_llama dtype={dtype} {{", f"  config {json.dumps(config)}",
             f'  param embed: DT[{VOCAB}, {HIDDEN}] from ["model.embed_tokens.weight"]']
    for name, _, prefix, _ in blocks:
        lines += ["  " + p for p in _block_params(name, prefix)]
    lines += [f'  param norm: DT[{HIDDEN}] from ["model.norm.weight"]',
              f'  param lm_head: DT[{VOCAB}, {HIDDEN}] from ["lm_head.weight"]']
    lines += [f"  block decoder = decoder x {layers}"]
    lines += [f"  block tail = tail x {tail_layers} {{first_layer={layers}}}"] if tail_layers else []
    lines += entry
    lines += [_block_graph(name, attn) for name, _, _, attn in blocks]
    lines.append("}")
    return "\n".join(lines).replace("DT[", f"{dtype}[") + "\n"


def typed(program: Program) -> Program:
    """Shape inference (as the shape_inference pass does), so tests do not depend on passes/."""
    graphs = {}
    for name, graph in program.graphs.items():
        g = graph.copy()
        for vid in g.order():
            node = g.node(vid)
            g.replace(vid, node.with_(out=OPS[node.op].infer([g.node(i).out for i in node.inputs], node.attrs)))
        graphs[name] = g
    return program.with_graphs(graphs)


def make_program(**kw) -> Program:
    return typed(parse_program(program_text(**kw)))


def checkpoint_tensors(layers: int = 2, tail_layers: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors for `program_text(layers, tail_layers=...)`; norms and biases non-trivial."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.2, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    t = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN, std=1.0), "model.norm.weight": rnd(HIDDEN, mean=1.0),
         "lm_head.weight": rnd(VOCAB, HIDDEN)}
    for i in range(layers + tail_layers):
        p = f"model.layers.{i}"
        t |= {f"{p}.input_layernorm.weight": rnd(HIDDEN, mean=1.0),
              f"{p}.post_attention_layernorm.weight": rnd(HIDDEN, mean=1.0),
              f"{p}.self_attn.q_proj.weight": rnd(Q, HIDDEN), f"{p}.self_attn.q_proj.bias": rnd(Q),
              f"{p}.self_attn.k_proj.weight": rnd(KV, HIDDEN), f"{p}.self_attn.k_proj.bias": rnd(KV),
              f"{p}.self_attn.v_proj.weight": rnd(KV, HIDDEN), f"{p}.self_attn.v_proj.bias": rnd(KV),
              f"{p}.self_attn.o_proj.weight": rnd(HIDDEN, Q), f"{p}.mlp.gate_proj.weight": rnd(FFN, HIDDEN),
              f"{p}.mlp.up_proj.weight": rnd(FFN, HIDDEN), f"{p}.mlp.down_proj.weight": rnd(HIDDEN, FFN)}
    return t


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1, index: bool = True,
                     config: dict | None = None) -> Path:
    """A HF-style checkpoint: model.safetensors, or `shards` files (+ model.safetensors.index.json)."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(out / file))
            weight_map |= {n: file for n in part}
        if index:
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return out


_package_ids = itertools.count()


def import_artifact(art: Path):
    """Imports ART as a package (so model.py's relative kernel import works) and returns its model module."""
    package = f"_kiln_codegen_test_artifact_{next(_package_ids)}"
    spec = importlib.util.spec_from_file_location(package, art / "__init__.py", submodule_search_locations=[str(art)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[package] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{package}.model")


def forward_batch(tokens: torch.Tensor, start: int, block_table: list[int], block_size: int) -> ForwardBatch:
    """One sequence whose first `start` tokens are already cached; `tokens` are this step's new tokens."""
    n = tokens.shape[0]
    positions = torch.arange(start, start + n)
    slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in positions.tolist()])
    return ForwardBatch(
        input_ids=tokens.to(torch.int32), positions=positions.to(torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([start + n], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32), slot_mapping=slots.to(torch.int64),
        logits_indices=torch.arange(n, dtype=torch.int32), num_decodes=1 if (n == 1 and start > 0) else 0)


_kernel_package_ids = itertools.count()


def render_kernels(root: Path, *, head_dim=16, num_heads=8, num_kv_heads=2, dtype="float32", block_size=4,
                   lora=False):
    """Renders cpu + triton kernel modules into a fresh package under `root` (with the LoRA kernels if `lora`);
    returns the triton module (its CPU fallback library is `._ref`). A new package name per call, so
    monkeypatching one never leaks into another."""
    pkg = root / f"kpkg{next(_kernel_package_ids)}"
    pkg.mkdir()
    env = template_env()
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu.py").write_text(env.get_template("cpu/kernels.py.j2").render(kiln_version="test", lora=lora))
    (pkg / "triton.py").write_text(env.get_template("triton/kernels.py.j2").render(
        kiln_version="test", head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype,
        block_size=block_size, lora=lora))
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"{pkg.name}.triton")
    finally:
        sys.path.remove(str(root))


def mla_inputs(T: int, heads: int, lora: int, rope_dim: int, dn: int, dv: int, dtype: torch.dtype,
               g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q_nope, q_pe, c_kv, k_pe, w_kv_b for `mla_attention` over T tokens, drawn from `g` in that order."""
    q_nope = torch.randn(T, heads, dn, generator=g).to(dtype)
    q_pe = torch.randn(T, heads, rope_dim, generator=g).to(dtype)
    c_kv = torch.randn(T, lora, generator=g).to(dtype)
    k_pe = torch.randn(T, 1, rope_dim, generator=g).to(dtype)
    w_kv_b = (torch.randn(heads * (dn + dv), lora, generator=g) * lora ** -0.5).to(dtype)
    return q_nope, q_pe, c_kv, k_pe, w_kv_b
