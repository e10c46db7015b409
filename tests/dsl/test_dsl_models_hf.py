"""The bundled models compute what Hugging Face's implementations compute, tensor names included.

Tiny random configs; the compiler's reference interpreter runs the DSL model on the HF state dict.
"""
import pytest
from kiln.dsl import load_recipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
instantiate = pytest.importorskip("kiln.compiler.instantiate")
interpret = pytest.importorskip("kiln.compiler.interpret")

SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 128}
DSL_SHAPE = "vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# case: (bundled model, HF class, HF config class, extra DSL config args, extra HF config args)
CASES = {
    "llama3-scaled-rope": ("llama", "LlamaForCausalLM", "LlamaConfig",
                           ', rope_theta=500000, rope_scaling="llama3", rope_factor=8.0, rope_original_max_position=16',
                           {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "rope_scaling": LLAMA3_ROPE}),
    "llama-biases-tied": ("llama", "LlamaForCausalLM", "LlamaConfig",
                          ", attention_bias=true, mlp_bias=true, tie_embeddings=true",
                          {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                           "rms_norm_eps": 1e-5}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "", {"rope_theta": 1e6, "rms_norm_eps": 1e-6}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", ", head_dim=16",
              {"head_dim": 16, "rope_theta": 1e6, "rms_norm_eps": 1e-6}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bundled_model_matches_hf(case, tmp_path):
    name, model_cls, config_cls, dsl_args, hf_args = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SHAPE, **hf_args)
    config._attn_implementation = "eager"
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # HF zero-inits biases; random values make every tensor name matter
    state = hf.state_dict()

    path = tmp_path / "r.dsl"
    path.write_text(f"recipe r {{ model = {name}({DSL_SHAPE}{dsl_args}) }}\n")
    loaded = load_recipe(str(path))
    program = instantiate.instantiate_model(loaded.model, dict(loaded.model_call.kwargs))
    weights = {}
    for spec in program.params.values():
        block = program.blocks[spec.block] if spec.block else None
        for i in range(block.count) if block else [None]:
            weights[spec.layer_name(i)] = state[spec.source[0].format(i=block.global_layer(i) if block else None)]

    tokens = torch.randint(0, 64, (7,))
    ours = interpret.interpret(program, weights, tokens)
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
