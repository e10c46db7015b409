"""One DeepSeek-V3-shaped MoE layer through kiln's h200 executor, against its bytes limit, on one GPU.

    python benchmarks/gpu_deepseek_layer.py [--out DIR] [--batches 1,32,128] [--context 4096] [--experts 32]
    python benchmarks/gpu_deepseek_layer.py --cpu-smoke     # the same code on the cpu target, tiny shapes

The layer is DeepSeek-V3's (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128,
v 128; MoE of moe_ffn 2048 experts, top_k 8, one shared expert; sigmoid router with correction bias over
n_group groups) with the routed experts REDUCED from 256 to `--experts` (default 32) so one layer's weights
and a 128 x 4K latent cache fit next to each other comfortably; n_group stays 8 and topk_group 4, so each
group holds experts/8 experts (4 at 32) and a token still chooses among half the groups. A one-layer
`deepseek_v3` recipe (first_k_dense=0, vocab 1024) with random bf16 weights is compiled for h200 (MLA
absorption, fused expert gate_up, Triton fused-MoE and MLA-decode kernels) and the generated block method
`Model.moe(layer, h, batch, kv_caches)` is timed on its own: embedding and LM head are not part of a layer.

For each decode batch B (1, 32, 128) at `--context` tokens of latent KV per sequence:
  * time of the layer, eager and replayed from a CUDA graph (CUDA events; the graph is the serving path);
  * its bytes limit: the bytes the step must read at least once — every attention / norm / router weight,
    the shared expert, the routed experts the batch's routing actually selects (distinct experts among the
    B x top_k choices, read from the kernel's `ids` input on that very batch), and the latent KV of the
    context (B x context x (kv_lora_rank + rope) x 2 B) — at the streaming bandwidth measured in the same run
    by gpu_decode.py's GEMV-loop helper over this layer's matrices; ratio = limit / measured time.
Writes DIR/gpu_deepseek_layer.json and prints a table last. Without CUDA (and no --cpu-smoke) it says so
and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode  # noqa: E402  (executor rendering, random weights, graph capture, the GEMV-loop streaming limit)

V3 = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128, moe_ffn=2048, top_k=8, shared_experts=1, n_group=8, topk_group=4, routed_scaling=2.5,
          ffn=18432, experts_full=256)
SMOKE = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, moe_ffn=32, top_k=2, shared_experts=1, n_group=2, topk_group=1, routed_scaling=2.5,
             ffn=96, experts_full=8)
BLOCK = 16
VOCAB = 1024


@dataclass
class Setup:
    device: torch.device
    target: str
    context: int
    iters: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def recipe_text(shape: dict, experts: int, target: str, max_position: int) -> str:
    keys = ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "moe_ffn", "top_k", "shared_experts", "n_group", "topk_group", "routed_scaling", "ffn")
    args = ", ".join(f"{k}={shape[k]}" for k in keys)
    return (f"recipe deepseek_v3_layer {{\n  model = deepseek_v3(vocab={VOCAB}, layers=1, first_k_dense=0, "
            f"experts={experts}, max_position={max_position}, {args})\n"
            f"  weights = random(seed=0)\n  target = {target}\n  dtype = bf16\n"
            f"  kv_cache {{ block_size = {BLOCK} }}\n}}\n")


def layer_bytes(program) -> dict[str, int]:
    """Weight bytes of the one MoE layer by role (from each param's checkpoint sources): routed experts (total
    and per expert), shared expert, everything else (attention, norms, router)."""
    out = {"routed": 0, "shared": 0, "attention_norms_router": 0}
    experts = 0
    for spec in program.params.values():
        if spec.block is None:
            continue  # embedding, final norm, LM head: outside the layer
        nbytes = math.prod(spec.shape) * {"bf16": 2, "f16": 2, "f32": 4}[spec.dtype]
        src = spec.source[0] if spec.source else ""
        if ".mlp.experts." in src:
            out["routed"] += nbytes
            experts = spec.shape[0]
        elif ".mlp.shared_experts." in src:
            out["shared"] += nbytes
        else:
            out["attention_norms_router"] += nbytes
    out["per_expert"] = out["routed"] // experts
    return out


def layer_matrices(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every 2-D matrix the layer reads, each routed expert's matrices one by one (what a GEMV loop streams)."""
    mats = []
    for name, w in weights.items():
        if not name.startswith("moe."):
            continue
        if w.dim() == 2 and w.shape[0] > 1:
            mats.append(w)
        elif w.dim() == 3:
            mats.extend(w.unbind(0))
    return mats


def stream_bandwidth(setup: Setup, mats: list[torch.Tensor]) -> float:
    """bytes/s of gpu_decode.streaming_limit (a CUDA graph of one batch-1 GEMV per matrix) over `mats`."""
    _, bw = gpu_decode.streaming_limit(gpu_decode.Setup(device=setup.device, smoke=not setup.cuda), mats)
    return bw


def decode_batch(setup: Setup, batch: int, latent_dim: int):
    """B one-token decodes at position context-1, each over `context` tokens of latent KV in random blocks
    (block 0 unused); returns (ForwardBatch, [kv cache])."""
    from kiln.runtime.forward_batch import ForwardBatch

    per_seq = math.ceil(setup.context / BLOCK)
    num_blocks = batch * per_seq + 1
    tables = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(batch)) + 1)
    tables = tables.view(batch, per_seq).to(torch.int32)
    pos = setup.context - 1
    slots = tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
    i32 = dict(dtype=torch.int32, device=setup.device)
    fb = ForwardBatch(input_ids=torch.zeros(batch, **i32), positions=torch.full((batch,), pos, **i32),
                      query_start_loc=torch.arange(batch + 1, **i32), seq_lens=torch.full((batch,), setup.context, **i32),
                      block_tables=tables.to(setup.device), slot_mapping=slots.to(setup.device),
                      logits_indices=torch.arange(batch, **i32), num_decodes=batch)
    g = torch.Generator(device=setup.device).manual_seed(1)
    kv = torch.randn(num_blocks, BLOCK, latent_dim, generator=g, device=setup.device).to(torch.bfloat16)
    return fb, [kv]


def timed(setup: Setup, fn, iters: int) -> float:
    """Median seconds per call: CUDA events on a GPU, perf_counter on CPU."""
    fn()
    times = []
    for _ in range(iters):
        if setup.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def routed_ids(module, call) -> torch.Tensor:
    """The `ids` the layer's moe_experts kernel receives during `call()` (its K library, wrapped once)."""
    K = module.K
    seen = []
    original = K.moe_experts

    def spy(x, weights, ids, *ws):
        seen.append(ids.clone())
        return original(x, weights, ids, *ws)

    K.moe_experts = spy
    try:
        call()
    finally:
        K.moe_experts = original
    assert len(seen) == 1, f"expected one moe_experts call in the layer, saw {len(seen)}"
    return seen[0]


def graph_time(setup: Setup, call, iters: int) -> float | None:
    """Seconds per replay of a CUDA graph of `call` (None on CPU or when capture fails)."""
    if not setup.cuda:
        return None
    try:
        return timed(setup, gpu_decode.capture_graph(call).replay, iters)
    except Exception as e:  # report, keep the eager figure
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {e})")
        return None


def bench(setup: Setup, shape: dict, experts: int, batches: list[int], work: Path, deadline: float) -> dict:
    import kiln

    recipe = work / "deepseek_v3_layer.dsl"
    recipe.write_text(recipe_text(shape, experts, setup.target, max_position=max(8192, setup.context)))
    program = kiln.compile(recipe, progress=False).program
    _, model_cls = gpu_decode.render_executor(program, work, "ds_layer", max(8192, setup.context))
    module = sys.modules[model_cls.__module__]  # model.py: its kernel library is `module.K`
    weights = gpu_decode.random_weights(program, setup.device)
    wb = layer_bytes(program)
    mats = layer_matrices(weights)
    bw = stream_bandwidth(setup, mats)
    model = model_cls(weights, setup.device)
    latent = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    kernels = sorted({n.attrs.get("kernel") for g in program.graphs.values() for _, n in g.items()} - {None, "inline"})
    res = {"experts": experts, "experts_full": shape["experts_full"], "top_k": shape["top_k"],
           "n_group": shape["n_group"], "topk_group": shape["topk_group"], "context": setup.context,
           "weight_bytes": wb, "stream_bandwidth": bw, "kernels": kernels, "decode": []}
    print(f"DeepSeek-V3 layer, {experts} of {shape['experts_full']} experts: weights "
          f"{(wb['routed'] + wb['shared'] + wb['attention_norms_router']) / 1e9:.3f} GB "
          f"(routed {wb['routed'] / 1e9:.3f}, shared {wb['shared'] / 1e9:.3f}, attention+norms+router "
          f"{wb['attention_norms_router'] / 1e9:.3f}); GEMV stream {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device=setup.device).manual_seed(2)
    for bs in batches:
        if time.time() > deadline:
            print(f"  batch {bs}: skipped (time budget)")
            continue
        fb, kv = decode_batch(setup, bs, latent)
        h = torch.randn(bs, shape["hidden"], generator=g, device=setup.device).to(torch.bfloat16)

        def call(fb=fb, kv=kv, h=h):
            return model.moe(0, h, fb, kv)

        ids = routed_ids(module, call)
        distinct = int(ids.unique().numel())
        kv_bytes = bs * setup.context * latent * 2
        need = wb["attention_norms_router"] + wb["shared"] + distinct * wb["per_expert"] + kv_bytes
        limit = need / bw
        eager = timed(setup, call, setup.iters)
        graph = graph_time(setup, call, setup.iters)
        best = graph if graph is not None else eager
        row = {"batch": bs, "distinct_experts": distinct, "bytes_needed": need, "kv_bytes": kv_bytes,
               "limit_s": limit, "eager_s": eager, "graph_s": graph, "ratio": limit / best,
               "timing": "graph" if graph is not None else "eager"}
        res["decode"].append(row)
        print(f"  b={bs:4d}: {distinct:3d} experts, {need / 1e9:.3f} GB -> limit {limit * 1e6:9.1f} us; eager "
              f"{eager * 1e6:9.1f} us" + (f", graph {graph * 1e6:9.1f} us" if graph is not None else "")
              + f"; {limit / best:.0%} of the limit")
        del fb, kv, h, call
    return res


def table(result: dict) -> str:
    r = result.get("layer", {})
    if "error" in r:
        return f"\nDeepSeek-V3 layer: ERROR {r['error']}"
    lines = ["", f"DeepSeek-V3 layer ({r['experts']} of {r['experts_full']} experts, top_k {r['top_k']}, "
                 f"context {r['context']}), limit at {r['stream_bandwidth'] / 1e12:.2f} TB/s",
             f"{'batch':>5} {'experts':>7} {'GB':>7} {'limit us':>9} {'eager us':>9} {'graph us':>9} {'of limit':>8}"]
    for row in r["decode"]:
        graph = "-" if row["graph_s"] is None else f"{row['graph_s'] * 1e6:.1f}"
        lines.append(f"{row['batch']:5d} {row['distinct_experts']:7d} {row['bytes_needed'] / 1e9:7.3f} "
                     f"{row['limit_s'] * 1e6:9.1f} {row['eager_s'] * 1e6:9.1f} {graph:>9} {row['ratio']:8.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=32, help="routed experts (DeepSeek-V3 has 256)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=50.0, help="stop starting new batch sizes after this")
    ap.add_argument("--cpu-smoke", action="store_true", help="cpu target, tiny DeepSeek shapes")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.cpu_smoke:
        setup, shape, experts, batches = Setup(torch.device("cpu"), "cpu", 32, 2), SMOKE, 8, [1, 3]
    else:
        if not torch.cuda.is_available():
            print("gpu_deepseek_layer: no CUDA device (torch.cuda.is_available() is False); nothing measured")
            return 0
        setup, shape, experts = Setup(torch.device("cuda"), "h200", args.context, args.iters), V3, args.experts
    if experts % shape["n_group"]:
        raise SystemExit(f"--experts {experts} must be a multiple of n_group = {shape['n_group']}")
    deadline = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"target": setup.target, "torch": torch.__version__}
    if setup.cuda:
        result["device"] = torch.cuda.get_device_properties(0).name
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result["layer"] = bench(setup, shape, experts, batches, Path(tmp), deadline)
        except Exception as e:
            import traceback

            traceback.print_exc()
            result["layer"] = {"error": f"{type(e).__name__}: {e}"}
    result["autotune"] = gpu_decode.tuned_configs()  # the MLA-decode (and other) configs the GPU chose
    (out / "gpu_deepseek_layer.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    gpu_decode._print_tuned(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
