"""`kiln recipe from-hf CKPT_DIR`: a complete recipe for a Hugging Face checkpoint, from its config.json."""
from __future__ import annotations

import json
import math
import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.compiler.ops import yarn_get_mscale
from kiln.compiler.targets import Target, get_target
from kiln.dsl.errors import KilnError, Loc, SourceError


class UnsupportedCheckpoint(KilnError):
    pass


# config.json keys the mappings below read, by the JSON type they must have (null is allowed: "not set")
_INT_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "head_dim", "max_position_embeddings", "original_max_position_embeddings", "sliding_window",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
    "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "num_nextn_predict_layers",
    "sliding_window_pattern"})
_FLOAT_KEYS = frozenset({"rope_theta", "rms_norm_eps", "routed_scaling_factor", "rope_local_base_freq",
                         "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                         "swiglu_alpha", "swiglu_limit"})
_BOOL_KEYS = frozenset({"tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob",
                        "rope_interleave"})


class _Config(dict):
    """A checkpoint's config.json: a missing or mistyped key is an error at its place in the file."""

    def __init__(self, data: dict[str, Any], path: Path, text: str):
        super().__init__(data)
        self.path, self.text = path, text

    def __missing__(self, key: str) -> Any:
        raise SourceError(f"config.json has no '{key}', which this architecture needs", Loc(str(self.path), 1, 1))


def _config_error(cfg: dict[str, Any], key: str, message: str) -> KilnError:
    """A SourceError at `"key":` in the config file (when `cfg` is a _Config), else a plain error."""
    if not isinstance(cfg, _Config):
        return UnsupportedCheckpoint(f"config.json '{key}' {message}")
    m = re.search(r'"' + re.escape(key) + r'"\s*:', cfg.text)
    if m is None:
        return SourceError(f"'{key}' {message}", Loc(str(cfg.path), 1, 1))
    line = cfg.text.count("\n", 0, m.start()) + 1
    col = m.start() - (cfg.text.rfind("\n", 0, m.start()) + 1) + 1
    return SourceError(f"'{key}' {message}", Loc(str(cfg.path), line, col, col + len(key) + 2))


def read_config(path: Path) -> _Config:
    """config.json parsed and type-checked: invalid JSON and values of the wrong type are located errors."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UnsupportedCheckpoint(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SourceError(f"invalid JSON: {e.msg}", Loc(str(path), e.lineno, e.colno, e.colno + 1)) from None
    if not isinstance(data, dict):
        raise SourceError(f"config.json must be a JSON object, got {type(data).__name__}", Loc(str(path), 1, 1))
    cfg = _Config(data, path, text)
    for key, value in data.items():
        if value is None:
            continue
        if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            raise _config_error(cfg, key, f"must be an integer, got {type(value).__name__} {value!r}")
        if key in _FLOAT_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _config_error(cfg, key, f"must be a number, got {type(value).__name__} {value!r}")
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise _config_error(cfg, key, f"must be true or false, got {type(value).__name__} {value!r}")
        if key in ("rope_scaling", "rope_parameters", "quantization_config") and not isinstance(value, dict):
            raise _config_error(cfg, key, f"must be an object, got {type(value).__name__}")
        if key == "architectures" and not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
            raise _config_error(cfg, key, "must be a list of class names")
    return cfg


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters as transformers ≥5 resolves them (`convert_rope_params_to_dict`): a non-empty legacy
    `rope_scaling` replaces `rope_parameters` whole, and `rope_theta` falls back to the top-level key. 4.x (and
    most checkpoints on disk) write `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`."""
    chosen = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(chosen, dict):
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        raise _config_error(cfg, key, f"must be an object, got {type(chosen).__name__}")
    out = dict(chosen)
    if "rope_theta" not in out and cfg.get("rope_theta") is not None:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def _rope_kind(rp: dict[str, Any]) -> str:
    return rp.get("rope_type", rp.get("type")) or "default"


def _yarn(cfg: dict[str, Any], rp: dict[str, Any]) -> dict[str, Any]:
    """The rope op's yarn attributes, resolved as transformers' standardize_rope_params and
    `_compute_yarn_parameters` resolve them (a missing factor is the context ratio; a top-level
    original_max_position_embeddings wins; missing betas are 32/1; mscale, mscale_all_dim, attention_factor
    stay 0 = not given)."""
    original = cfg.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if not original:
        raise UnsupportedCheckpoint("yarn rope scaling needs original_max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", original) / original
    attention_factor = rp.get("attention_factor")
    if attention_factor is not None and attention_factor <= 0:
        raise UnsupportedCheckpoint(f"yarn attention_factor must be positive, got {attention_factor}")
    out: dict[str, Any] = {"rope_scaling": "yarn", "rope_factor": float(factor),
                           "rope_original_max_position": int(original),
                           "rope_beta_fast": float(rp.get("beta_fast") or 32),
                           "rope_beta_slow": float(rp.get("beta_slow") or 1)}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rp.get(key):
            out[f"rope_{key}"] = float(rp[key])
    if not rp.get("truncate", True):
        out["rope_truncate"] = False
    return out


_DYNAMIC_NTK = ("'dynamic' (NTK) rope scaling is not supported: transformers recomputes its frequencies from the "
                "running sequence length, so no fixed cos/sin table matches it past max_position_embeddings (below "
                "it, it is unscaled rope: drop rope_scaling from config.json if you serve no longer contexts)")


def _rope(cfg: dict[str, Any], default_theta: float) -> dict[str, Any]:
    rp = _rope_parameters(cfg)
    theta = rp.get("rope_theta", default_theta)
    out: dict[str, Any] = {"rope_theta": float(theta)}
    kind = _rope_kind(rp)
    if kind in ("llama3",):
        out.update(rope_scaling="llama3", rope_factor=float(rp["factor"]),
                   rope_low_freq_factor=float(rp["low_freq_factor"]),
                   rope_high_freq_factor=float(rp["high_freq_factor"]),
                   rope_original_max_position=int(rp["original_max_position_embeddings"]))
    elif kind == "linear":
        out.update(rope_scaling="linear", rope_factor=float(rp["factor"]))
    elif kind == "yarn":
        out.update(_yarn(cfg, rp))
    elif kind == "dynamic":
        raise UnsupportedCheckpoint(_DYNAMIC_NTK)
    elif kind != "default":
        raise UnsupportedCheckpoint(f"rope scaling type {kind!r} is not supported yet "
                                    "(supported: llama3, linear, yarn; longrope for Phi-3 checkpoints)")
    return out


def _common(cfg: dict[str, Any], default_theta: float,
            rope: Callable[[dict[str, Any], float], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The args every dense family shares; `default_theta` is the transformers config class's `default_theta`
    (used when config.json gives no rope_theta); `rope` maps the rope settings (default: `_rope`)."""
    heads = cfg["num_attention_heads"]
    args: dict[str, Any] = {
        "vocab": cfg["vocab_size"], "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
        "heads": heads, "kv_heads": cfg.get("num_key_value_heads") or heads,
        "ffn": cfg["intermediate_size"],
    }
    if cfg.get("head_dim") and cfg["head_dim"] != cfg["hidden_size"] // heads:
        args["head_dim"] = cfg["head_dim"]
    args.update((rope or _rope)(cfg, default_theta))
    args["norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    args["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    args["max_position"] = int(cfg.get("max_position_embeddings", 4096))
    return args


def _llama(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = _common(cfg, 10000.0)
    if cfg.get("sliding_window"):
        args["sliding_window"] = int(cfg["sliding_window"])
    if cfg.get("attention_bias"):
        args["attention_bias"] = True
    if cfg.get("mlp_bias"):
        args["mlp_bias"] = True
    return "llama", args


def _granite(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """IBM Granite 3.x (models/granite.dsl): Llama's tensors and four scalars (the embedding, residual and attention
    multipliers, the logits' divisor), each as its config gives it."""
    args = _common(cfg, 10000.0)
    args["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", True))  # GraniteConfig's default
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            args[key] = True
    for key, default in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                         ("attention_multiplier", 1.0), ("logits_scaling", 1.0)):
        value = cfg.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or \
                (key == "logits_scaling" and value == 0):
            raise _config_error(cfg, key, f"must be a finite number{' other than 0' if key == 'logits_scaling' else ''}")
        args[key] = float(value)
    return "granite", args


def _phi3_rope(cfg: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """Phi-3's rope as transformers resolves it (Phi3Config.convert_rope_params_to_dict, standardize_rope_params,
    `_compute_longrope_parameters`): `su` and `yarn` are old names of longrope; the top-level
    original_max_position_embeddings (Phi3Config's default 4096) wins over one inside the rope settings; a missing
    factor is max_position_embeddings / original_max_position_embeddings (it sets the attention factor);
    partial_rotary_factor rotates the first int(head_dim * factor) dims of each head."""
    rp = _rope_parameters(cfg)
    out: dict[str, Any] = {"rope_theta": float(rp.get("rope_theta", default_theta))}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary = 1.0 if rotary is None else rotary
    key = "partial_rotary_factor"
    if isinstance(rotary, bool) or not isinstance(rotary, int | float) or not 0 < rotary <= 1:
        raise _config_error(cfg, key, f"must be a number in (0, 1], got {rotary!r}")
    rotary_dim = int(head_dim * rotary)
    if rotary_dim % 2 or rotary_dim == 0:
        raise _config_error(cfg, key, f"= {rotary} rotates {rotary_dim} of the {head_dim} dims of a head; kiln's "
                                      "rope rotates an even, non-zero number of dims (pairs)")
    if rotary_dim != head_dim:
        out["rope_rotary_dim"] = rotary_dim
    kind = _rope_kind(rp)
    if kind == "default":
        return out
    if kind not in ("longrope", "su", "yarn"):
        raise UnsupportedCheckpoint(f"Phi-3 rope scaling {kind!r} is not supported: transformers' Phi-3 knows only "
                                    "longrope (also spelled su or yarn)")
    original = cfg.get("original_max_position_embeddings") or 4096
    factor = rp.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", original) / original
    out.update(rope_scaling="longrope", rope_factor=float(factor), rope_original_max_position=int(original))
    attention_factor = rp.get("attention_factor")
    if attention_factor is not None:
        if isinstance(attention_factor, bool) or not isinstance(attention_factor, int | float) \
                or not 0 < attention_factor < math.inf:
            raise _config_error(cfg, "attention_factor", f"must be a positive number, got {attention_factor!r}")
        out["rope_attention_factor"] = float(attention_factor)
    for name in ("short_factor", "long_factor"):
        factors = rp.get(name)
        if not (isinstance(factors, list) and len(factors) == rotary_dim // 2 and all(
                isinstance(f, int | float) and not isinstance(f, bool) and 0 < f < math.inf for f in factors)):
            got = f"{len(factors)} entries" if isinstance(factors, list) else repr(factors)
            raise _config_error(cfg, name, f"must list one positive factor per rotated dim pair "
                                           f"({rotary_dim // 2}), got {got}")
        out[f"rope_{name}"] = tuple(float(f) for f in factors)  # a DSL list evaluates to a tuple
    return out


def _phi3(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Phi-3 / Phi-3.5 / Phi-4-mini (models/phi3.dsl): fused qkv_proj and gate_up_proj tensors, plain or LongRoPE
    rope, full or partial rotary."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"Phi-3 with hidden_act = {cfg['hidden_act']!r} (kiln's is silu)")
    args = _common(cfg, 10000.0, rope=_phi3_rope)
    if cfg.get("sliding_window"):
        args["sliding_window"] = int(cfg["sliding_window"])
    return "phi3", args


def _refuse_sliding_window(cfg: dict[str, Any], family: str) -> None:
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        # Qwen applies the window only to layers >= max_window_layers; kiln has one window per model.
        raise UnsupportedCheckpoint(f"{family} with use_sliding_window=true is not supported yet")


def _qwen3_attention(cfg: dict[str, Any], args: dict[str, Any], family: str) -> None:
    """Qwen3 / Qwen3-MoE attention args: head_dim always given, no sliding window, optional attention bias."""
    args["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    _refuse_sliding_window(cfg, family)
    if cfg.get("attention_bias"):
        args["attention_bias"] = True


def _qwen2(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = _common(cfg, 10000.0)
    _refuse_sliding_window(cfg, "Qwen2")
    return "qwen2", args


def _qwen3(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = _common(cfg, 10000.0)
    _qwen3_attention(cfg, args, "Qwen3")
    return "qwen3", args


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k:
        raise UnsupportedCheckpoint("a mixture-of-experts config needs num_local_experts (or num_experts) and "
                                    "num_experts_per_tok")
    return {"experts": int(experts), "top_k": int(top_k)}


def _mixtral(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = _common(cfg, 1000000.0)
    args.update(_experts(cfg))
    if cfg.get("sliding_window"):
        args["sliding_window"] = int(cfg["sliding_window"])
    return "mixtral", args


def _qwen3_moe(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    args = _common(cfg, 10000.0)
    del args["ffn"]  # dense-MLP width; every layer of a supported config is sparse
    moe = _experts(cfg)
    step, mlp_only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(cfg["num_hidden_layers"]) if i in mlp_only or (i + 1) % step != 0]
    if dense:
        raise UnsupportedCheckpoint(
            f"Qwen3-MoE with dense MLP layers {dense} (decoder_sparse_step={step}, mlp_only_layers="
            f"{sorted(mlp_only)}) is not supported yet: kiln's qwen3_moe model makes every layer sparse")
    args.update(moe, moe_ffn=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    _qwen3_attention(cfg, args, "Qwen3-MoE")
    return "qwen3_moe", args


def _deepseek(cfg: dict[str, Any], *, v2: bool) -> tuple[str, dict[str, Any]]:
    """DeepSeek-V3 / V2: multi-head latent attention, first_k_dense_replace dense layers, then mixture-of-experts
    layers with shared experts (models/deepseek_v3.dsl), routed as transformers' DeepseekV3/V2TopkRouter."""
    rp = _rope_parameters(cfg)
    kind = _rope_kind(rp)
    if kind == "dynamic":
        raise UnsupportedCheckpoint(_DYNAMIC_NTK)
    if kind not in ("default", "yarn"):
        raise UnsupportedCheckpoint(f"DeepSeek rope scaling {kind!r} is not supported yet (supported: yarn)")
    layers = cfg["num_hidden_layers"]
    first_dense = min(int(cfg.get("first_k_dense_replace") or 0), layers)
    args: dict[str, Any] = {
        "vocab": cfg["vocab_size"], "hidden": cfg["hidden_size"], "layers": layers,
        "heads": cfg["num_attention_heads"], "ffn": cfg["intermediate_size"],
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0), "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]), "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
        "rope_theta": float(rp.get("rope_theta") or 10000.0),
        # V2 rotates interleaved pairs (complex multiply); V3 does so unless rope_interleave is false
        "rope_interleave": True if v2 else bool(cfg.get("rope_interleave", True)),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_position": int(cfg.get("max_position_embeddings", 4096)),
        "first_k_dense": first_dense,
    }
    if kind == "yarn":
        yarn = _yarn(cfg, rp)
        args.update(yarn)
        if rp.get("mscale_all_dim"):  # HF DeepseekV3Attention's yarn_apply_mscale: softmax scale × mscale²
            args["mscale"] = yarn_get_mscale(yarn["rope_factor"], float(rp["mscale_all_dim"]))
    if cfg.get("attention_bias"):
        args["attention_bias"] = True
    if first_dense < layers:
        args.update(_deepseek_moe(cfg, v2=v2))
        # V3's multi-token-prediction module (checkpoint layer `layers`, a MoE layer): a draft head for
        # speculative decoding. kiln loads the first module; `from-hf --no-mtp` leaves it out.
        if int(cfg.get("num_nextn_predict_layers") or 0) > 0:
            args["nextn"] = int(cfg["num_nextn_predict_layers"])
    return "deepseek_v3", args


def _deepseek_moe(cfg: dict[str, Any], *, v2: bool) -> dict[str, Any]:
    """The router and experts of DeepSeek's MoE layers (V3: sigmoid scores + e_score_correction_bias, groups
    scored by their top-2 sum; V2: softmax scores, greedy or group_limited_greedy with max group scores)."""
    experts, top_k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    if not experts or not top_k or not cfg.get("moe_intermediate_size"):
        raise UnsupportedCheckpoint("a DeepSeek config with MoE layers needs n_routed_experts, num_experts_per_tok "
                                    "and moe_intermediate_size")
    moe: dict[str, Any] = {
        "experts": int(experts), "top_k": int(top_k), "moe_ffn": int(cfg["moe_intermediate_size"]),
        "shared_experts": int(cfg.get("n_shared_experts") or 0),
        "routed_scaling": float(cfg.get("routed_scaling_factor") or 1.0),
    }
    if not v2:
        moe.update(n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        return moe
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedCheckpoint(f"DeepSeek-V2 topk_method {method!r} is not supported "
                                    "(supported: greedy, group_limited_greedy)")
    if cfg.get("norm_topk_prob"):
        # transformers' DeepseekV2 ignores it while DeepSeek's own code renormalises: refuse rather than guess
        raise UnsupportedCheckpoint("DeepSeek-V2 with norm_topk_prob=true is not supported: transformers' "
                                    "DeepseekV2 does not renormalise the top-k weights, DeepSeek's reference does")
    moe.update(scoring="softmax", correction_bias=False, norm_topk_prob=False)
    if method == "group_limited_greedy":
        moe.update(n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                   group_score="max")
    return moe


# transformers' Gemma3TextConfig / Gemma2Config defaults: Google's configs (a Gemma3ForConditionalGeneration's
# text_config above all) leave out the keys whose value is the default
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
               "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 2, "rope_theta": 10000.0, "tie_word_embeddings": True,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_common(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The args Gemma 2 and 3 share (models/gemma2.dsl, gemma3.dsl): sizes, norms, the query scale, which layers
    slide (`layer_types`, else every `sliding_window_pattern`-th layer is global) and the window."""
    d = _GEMMA_DEFAULTS[family]
    get = lambda key: cfg[key] if cfg.get(key) is not None else d[key]  # noqa: E731
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedCheckpoint(f"{family} with hidden_activation = {act!r} is not supported (kiln's Gemma MLP "
                                    "is gelu_pytorch_tanh)")
    if cfg.get("attention_bias"):
        raise UnsupportedCheckpoint(f"{family} with attention_bias = true is not supported (Google's have none)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedCheckpoint(f"{family} with use_bidirectional_attention = true (an encoder, e.g. "
                                    "EmbeddingGemma) is not supported: kiln serves causal decoders")
    layers = get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        pattern = get("sliding_window_pattern")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise _config_error(cfg, "layer_types", f"must list {layers} entries of {' or '.join(_LAYER_TYPES)}")
    heads = get("num_attention_heads")
    args: dict[str, Any] = {
        "vocab": get("vocab_size"), "hidden": get("hidden_size"), "layers": layers, "heads": heads,
        "kv_heads": get("num_key_value_heads"), "head_dim": get("head_dim"), "ffn": get("intermediate_size"),
        "norm_eps": float(get("rms_norm_eps")), "tie_embeddings": bool(get("tie_word_embeddings")),
        "max_position": int(get("max_position_embeddings")),
        "sliding_window": int(get("sliding_window")),
        "sliding_layers": tuple(t == "sliding_attention" for t in types),  # a DSL list evaluates to a tuple
        "query_pre_attn_scalar": float(get("query_pre_attn_scalar")),
    }
    final = cfg.get("final_logit_softcapping", d.get("final_logit_softcapping"))  # null: none
    if final:
        args["final_softcap"] = float(final)
    return args


def _gemma3_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's two ropes, resolved as Gemma3TextConfig.convert_rope_params_to_dict: `rope_parameters` keyed by
    layer type (transformers 5), or the legacy keys (rope_theta + rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones)."""
    rp = cfg.get("rope_parameters") or {}
    if rp and not set(rp) & set(_LAYER_TYPES):  # a flat dict: the global layers' (as a legacy rope_scaling)
        rp = {"full_attention": rp}
    full = dict(rp.get("full_attention") or {})
    full.update(cfg.get("rope_scaling") or {})
    local = dict(rp.get("sliding_attention") or {})
    d = _GEMMA_DEFAULTS["gemma3"]
    args: dict[str, Any] = {
        "rope_theta": float(full.get("rope_theta") or cfg.get("rope_theta") or d["rope_theta"]),
        "rope_local_theta": float(local.get("rope_theta") or cfg.get("rope_local_base_freq")
                                  or d["rope_local_base_freq"]),
    }
    if _rope_kind(local) != "default":
        raise UnsupportedCheckpoint(f"Gemma 3 sliding-layer rope scaling {_rope_kind(local)!r} is not supported "
                                    "(Google's sliding layers use plain rope)")
    kind = _rope_kind(full)
    if kind == "linear":
        args.update(rope_scaling="linear", rope_factor=float(full["factor"]))
    elif kind != "default":
        raise UnsupportedCheckpoint(f"Gemma 3 global-layer rope scaling {kind!r} is not supported yet "
                                    "(supported: linear, as the 4B-27B checkpoints)")
    return args


def _gemma3(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Gemma 3 text (models/gemma3.dsl). HF's Gemma3Attention never applies attn_logit_softcapping, so neither
    does kiln."""
    args = _gemma_common(cfg, "gemma3")
    args.update(_gemma3_rope(cfg))
    return "gemma3", args


def _gemma2(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Gemma 2 (models/gemma2.dsl): one rope, attention scores and final logits soft-capped."""
    args = _gemma_common(cfg, "gemma2")
    rope = _rope(cfg, _GEMMA_DEFAULTS["gemma2"]["rope_theta"])
    if set(rope) != {"rope_theta"}:
        raise UnsupportedCheckpoint(f"Gemma 2 with rope scaling {rope.get('rope_scaling')!r} is not supported "
                                    "(Google's Gemma 2 checkpoints use plain rope)")
    args.update(rope)
    cap = cfg.get("attn_logit_softcapping", _GEMMA_DEFAULTS["gemma2"]["attn_logit_softcapping"])
    if cap:
        args["attn_softcap"] = float(cap)
    return "gemma2", args


# transformers' GptOssConfig defaults (OpenAI's configs give most keys; these fill the ones left out)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def _gpt_oss(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """gpt-oss (models/gpt_oss.dsl): attention sinks, sliding (`layer_types`, else every other layer from the
    first) and full layers, YaRN rope, biased router and experts with the clamped SwiGLU. MXFP4 experts
    (`quantization_config.quant_method = mxfp4`) are dequantized at conversion (codegen/weights.py)."""
    if not cfg.get("attention_bias", True):
        raise UnsupportedCheckpoint("gpt-oss with attention_bias = false is not supported (OpenAI's have biases)")
    rp = _rope_parameters(cfg) or dict(_GPT_OSS_ROPE)
    args = _common({**cfg, "rope_parameters": rp, "rope_scaling": None}, 150000.0)
    args["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    args["norm_eps"] = float(cfg.get("rms_norm_eps") or 1e-5)
    args["max_position"] = int(cfg.get("max_position_embeddings") or 131072)
    args.update(_experts(cfg))
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise _config_error(cfg, "layer_types", f"must list {layers} entries of {' or '.join(_LAYER_TYPES)}")
    window = cfg.get("sliding_window", 128)
    if "sliding_attention" in types and not window:
        raise _config_error(cfg, "sliding_window", "must be a positive window for the sliding_attention layers")
    args["sliding_window"] = int(window or 0)
    args["sliding_layers"] = tuple(t == "sliding_attention" for t in types)  # a DSL list evaluates to a tuple
    for key in ("swiglu_alpha", "swiglu_limit"):
        if cfg.get(key) is not None:
            args[key] = float(cfg[key])
    return "gpt_oss", args


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "DeepseekV3ForCausalLM": lambda cfg: _deepseek(cfg, v2=False),
    "DeepseekV2ForCausalLM": lambda cfg: _deepseek(cfg, v2=True),
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Phi3ForCausalLM": _phi3,
    "GraniteForCausalLM": _granite,
    "Gemma3ForCausalLM": _gemma3,
    "Gemma3ForConditionalGeneration": _gemma3,  # its text_config and language-model tensors (_map_checkpoint)
    "Gemma2ForCausalLM": _gemma2,
    "GptOssForCausalLM": _gpt_oss,
}


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        r = repr(v)
        return r if any(c in r for c in ".e") else r + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return str(v)


def _tensor_names(ckpt: Path) -> set[str]:
    """The tensor names of a safetensors checkpoint (from its index, else from the file headers)."""
    from kiln.codegen.weights import Checkpoint

    return set(Checkpoint(ckpt).file_of)


def _weight_quantization(cfg: dict[str, Any]) -> str | None:
    """The recipe's `quantize.weights` for a quantized checkpoint (from its `quantization_config`), None for an
    unquantized one:

    * compressed-tensors FP8 (llm-compressor): weights `strategy` tensor / channel / block (with
      `block_structure`); activations none, `dynamic: true` (per token) or `dynamic: false` (static: the
      checkpoint's per-tensor `input_scale`s are read); its other formats are refused;
    * `fp8` (transformers' FineGrainedFP8: DeepSeek-V3/R1, Qwen3-*-FP8): 128x128 (`weight_block_size`) e4m3
      blocks with `weight_scale_inv`, activations quantized per token and block (`activation_scheme` dynamic);
    * `awq` (AutoAWQ GEMM layout, 4 bits, zero points) and `gptq` (AutoGPTQ / GPTQModel, 4 bits,
      `checkpoint_format` gptq = v1 or gptq_v2), with their `group_size`.
    Any other `quant_method` (bitsandbytes, exl2, marlin, ...) is refused, naming it: a recipe without the
    quantize line would read packed tensors as float weights."""
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None or method == "mxfp4":  # gpt-oss's MXFP4 experts: dequantized at conversion, served float
        return None
    if method in _QUANT_METHODS:
        return _QUANT_METHODS[method](qc)
    if method != "compressed-tensors":
        raise UnsupportedCheckpoint(f"quantization_config.quant_method = {method!r}: kiln reads compressed-tensors "
                                    "FP8, fp8 (128x128 blocks), awq (GEMM) and gptq (4-bit) checkpoints")
    schemes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, act = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnsupportedCheckpoint(f"compressed-tensors config group '{name}' has {w.get('num_bits')}-bit "
                                        f"{w.get('type')} weights; kiln reads its FP8 (8-bit float) checkpoints")
        opts = []
        if w.get("strategy") == "channel":
            opts.append("per_channel=true")
        elif w.get("strategy") == "block":
            bs = w.get("block_structure") or [128, 128]
            if len(bs) != 2 or bs[0] != bs[1]:
                raise UnsupportedCheckpoint(f"compressed-tensors block_structure {bs}: kiln's fp8 blocks are square")
            opts.append(f"block={int(bs[0])}")
        elif w.get("strategy") != "tensor":
            raise UnsupportedCheckpoint(f"compressed-tensors fp8 weight strategy {w.get('strategy')!r} "
                                        "(kiln reads tensor, channel and block)")
        if act:
            if act.get("type") != "float" or act.get("num_bits") != 8:
                raise UnsupportedCheckpoint(f"compressed-tensors config group '{name}' quantizes activations to "
                                            f"{act.get('num_bits')}-bit {act.get('type')}; kiln's are fp8")
            if act.get("dynamic"):
                opts.append("act=dynamic")
            elif act.get("strategy", "tensor") == "tensor":
                opts.append("act=static")
            else:
                raise UnsupportedCheckpoint(f"compressed-tensors static {act.get('strategy')} activation scales "
                                            "(kiln reads static per-tensor input_scale, or dynamic activations)")
        schemes.add("fp8" + (f"({', '.join(opts)})" if opts else ""))
    if len(schemes) > 1:
        raise UnsupportedCheckpoint(f"compressed-tensors config groups quantize differently ({', '.join(sorted(schemes))}); "
                                    "kiln applies one fp8 scheme to every linear")
    return schemes.pop() if schemes else None


def _fine_grained_fp8(qc: dict[str, Any]) -> str:
    block = qc.get("weight_block_size") or [128, 128]
    if len(block) != 2 or block[0] != block[1]:
        raise UnsupportedCheckpoint(f"fp8 weight_block_size {block}: kiln's fp8 blocks are square")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise UnsupportedCheckpoint(f"fp8 activation_scheme {act!r} with block scales: kiln quantizes the "
                                    "activations of block-fp8 weights dynamically (per token and block)")
    return f"fp8(block={int(block[0])}, act=dynamic)"


def _int4_group(qc: dict[str, Any], method: str) -> int:
    if qc.get("bits", 4) != 4:
        raise UnsupportedCheckpoint(f"{method} with bits = {qc.get('bits')}: kiln reads 4-bit {method} checkpoints")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or group <= 0:
        raise UnsupportedCheckpoint(f"{method} group_size = {group!r}: kiln reads grouped scales (a positive "
                                    "group size; -1, one scale per output channel, is not supported)")
    return group


def _awq(qc: dict[str, Any]) -> str:
    group = _int4_group(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedCheckpoint(f"awq version {qc.get('version')!r}: kiln reads AutoAWQ's GEMM layout")
    if qc.get("zero_point", True) is not True:
        raise UnsupportedCheckpoint("awq with zero_point = false: kiln reads AutoAWQ GEMM checkpoints with zeros")
    return f"awq(group={group})"


def _gptq(qc: dict[str, Any]) -> str:
    group = _int4_group(qc, "gptq")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedCheckpoint(f"gptq checkpoint_format {fmt!r}: kiln reads gptq (v1) and gptq_v2")
    sym = qc.get("sym", True)
    return f"gptq(group={group}, sym={'true' if sym else 'false'}" + (", format=v2)" if fmt == "gptq_v2" else ")")


_QUANT_METHODS = {"fp8": _fine_grained_fp8, "awq": _awq, "gptq": _gptq}


def checkpoint_model_args(ckpt_dir: str | Path, *, mtp: bool = True) -> tuple[str, dict[str, Any]]:
    """(bundled model name, its config arguments) for a checkpoint directory, from its config.json."""
    return _map_checkpoint(Path(ckpt_dir), mtp)[2:]


def _map_checkpoint(ckpt: Path, mtp: bool) -> tuple[_Config, str, str, dict[str, Any]]:
    """(config.json, architecture, bundled model name, its config arguments)."""
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedCheckpoint(f"{ckpt} has no config.json (is it a Hugging Face checkpoint directory?)")
    cfg = read_config(cfg_path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedCheckpoint(f"unsupported architecture {', '.join(archs) or '(none given)'} in {cfg_path}; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    if arch == "Gemma3ForConditionalGeneration":
        cfg = _gemma3_text_config(cfg, ckpt)
    try:
        model, args = ARCHITECTURES[arch](cfg)
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a nested value (rope_scaling, ...) of a wrong type
        raise UnsupportedCheckpoint(f"{cfg_path}: a value the {arch} mapping reads has the wrong type or form "
                                    f"({type(e).__name__}: {e})") from None
    if arch == "Gemma3ForConditionalGeneration":
        args["prefix"] = _gemma3_text_prefix(ckpt)
    # many converted checkpoints keep num_nextn_predict_layers but drop the MTP layer's weights
    if "nextn" in args and not (mtp and f"model.layers.{args['layers']}.eh_proj.weight" in _tensor_names(ckpt)):
        del args["nextn"]
    return cfg, arch, model, args


def _gemma3_text_config(cfg: _Config, ckpt: Path) -> _Config:
    """The language model's config of a Gemma3ForConditionalGeneration (its `text_config`): kiln serves the text
    tower; the vision tower and image tokens are not read."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise _config_error(cfg, "text_config", "must be an object (the language model's config)")
    for key in ("tie_word_embeddings",):  # set at the top level by some conversions
        if key in cfg and key not in text:
            text = {**text, key: cfg[key]}
    return _Config(text, cfg.path, cfg.text)


def _gemma3_text_prefix(ckpt: Path) -> str:
    """Where a Gemma3ForConditionalGeneration checkpoint keeps its language model's tensors: transformers < 4.52
    wrote `language_model.model.*`, later versions `model.language_model.*`."""
    names = _tensor_names(ckpt)
    for prefix in ("model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise UnsupportedCheckpoint(f"{ckpt}: a Gemma3ForConditionalGeneration checkpoint without its language model's "
                                "embeddings (model.language_model.embed_tokens.weight or "
                                "language_model.model.embed_tokens.weight)")


def default_dtype(cfg: dict[str, Any], target: str) -> str:
    """The recipe's dtype when `--dtype` is not given: bf16 on GPU targets; on cpu the checkpoint's own when it is
    bf16 (`dtype`, or `torch_dtype` before transformers 5), as vLLM's and transformers' `auto` serve it, else fp32
    (fp32 checkpoints exact; fp16 ones exact in fp32, where a CPU has no fast fp16 arithmetic). bf16 on the cpu
    target halves the bytes each decode step streams; with avx512_bf16 its GEMMs run oneDNN's native bf16 matmul
    (docs/performance.md, "bf16 GEMMs on a CPU with avx512_bf16": 1.1x fp32's output tokens/s at batch 1,
    1.4-1.5x at 16, 1.8x+ at 64 on a 108 M Llama)."""
    if target != "cpu":
        return "bf16"
    stored = cfg.get("dtype", cfg.get("torch_dtype"))
    return "bf16" if stored == "bfloat16" else "fp32"


def recipe_from_hf(ckpt_dir: str | Path, *, target: str = "cpu", out_file: str | Path | None = None,
                   dtype: str | None = None, name: str | None = None, mtp: bool = True) -> str:
    """The recipe of a Hugging Face checkpoint. `mtp=False` leaves out a DeepSeek-V3 multi-token-prediction
    head (its weights are then neither converted nor given KV cache)."""
    tgt = get_target(target)
    ckpt = Path(ckpt_dir)
    cfg, arch, model, args = _map_checkpoint(ckpt, mtp)
    if dtype is None:
        dtype = default_dtype(cfg, target)
    if out_file is not None:
        base = Path(out_file).resolve().parent
        weights = os.path.relpath(ckpt.resolve(), base)
    else:
        weights = str(ckpt.resolve())
    rname = name or re.sub(r"\W+", "_", ckpt.resolve().name).strip("_").lower() or "model"
    if rname[0].isdigit():
        rname = "m_" + rname
    served = ckpt.resolve().name
    scheme = _weight_quantization(cfg)
    quantize = f"  quantize  {{ weights = {scheme} }}\n" if scheme else ""
    arg_text = ",\n      ".join(f"{k}={_literal(v)}" for k, v in args.items())
    note = _longrope_note(args)
    return (
        f"# Generated by `kiln recipe from-hf` from config.json ({arch}).\n"
        f"recipe {rname} {{\n"
        f"  model   = {model}(\n      {arg_text})\n"
        f"  weights = \"hf:{weights}\"\n"
        f"  target  = {target}\n"
        f"  dtype   = {dtype}\n"
        f"{_task_lines(ckpt)}"
        f"{quantize}"
        f"  kv_cache  {{ block_size = 16; memory_fraction = 0.9 }}\n"
        f"{_scheduler_line(tgt)}"
        f"{note}"
        f"  serve     {{ port = 8000; served_name = {json.dumps(served)} }}\n"
        f"}}\n"
    )


def _task_lines(ckpt: Path) -> str:
    """`task = embed` (with a comment saying why) for a sentence-transformers checkpoint: its `modules.json` lists
    a Pooling module (codegen/pooling.py reads the pooling from it); nothing for a generation checkpoint."""
    try:
        modules = json.loads((ckpt / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(modules, list) or not any(
            isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling") for m in modules):
        return ""
    return ("  # task = embed: modules.json lists a sentence-transformers Pooling module (docs/embeddings.md);\n"
            "  # the artifact serves /v1/embeddings and LLM.embed, not text generation\n"
            "  task    = embed\n")


def _scheduler_line(tgt: Target) -> str:
    """The recipe's scheduler section. The step budget (max_batched_tokens) is left to the target, so that a
    recipe compiled for another target (`target = ...`, `kiln compile --target`) gets that target's; a comment
    says what the target gives, and why where the registry gives a reason (compiler/targets.py)."""
    why = f" ({tgt.step_budget_reason})" if tgt.step_budget_reason else ""
    note = textwrap.wrap(f"max_batched_tokens: the target's step budget, {tgt.max_batched_tokens} tokens on "
                         f"{tgt.name}{why}", width=112)
    return ("".join(f"  # {line}\n" for line in note)
            + "  scheduler { max_seqs = 256; chunked_prefill = 512; policy = fcfs; prefix_cache = radix }\n")


def _longrope_note(args: dict[str, Any]) -> str:
    """A recipe comment saying which LongRoPE factors the artifact will use (docs/rope.md), or nothing."""
    if args.get("rope_scaling") != "longrope":
        return ""
    orig, served = args["rope_original_max_position"], args["max_position"]
    if served <= orig:
        return f"  # LongRoPE: {served} positions <= original {orig}: the short factors, as transformers\n"
    return (f"  # LongRoPE: {served} positions > original {orig}: the long factors for every request (as transformers\n"
            f"  # computes a sequence longer than {orig}); serve {{ max_model_len = {orig} }} takes the short ones\n")
