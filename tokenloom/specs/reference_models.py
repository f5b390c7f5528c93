"""Shapes of the models published benchmarks run, as config.json dicts (no weights, no downloads).

`tokenloom estimate --model llama-2-70b` and the published-figure table (docs/predictions.md)
need only a model's shape: these are the fields of each release's config.json that the
arithmetic reads.  Models the engine itself can build live in `model.tools.presets`; these
are too big to make and only ever counted.
"""

from __future__ import annotations

import copy


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
           positions: int, dtype: str = "float16", **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": positions, "vocab_size": vocab,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": dtype, **extra,
    }


# From each model's config.json on the Hugging Face hub (meta-llama/*, codellama/*, mistralai/*, Qwen/*).
REFERENCE_CONFIGS: dict[str, dict] = {
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
    "codellama-34b": _llama(8192, 48, 64, 8, 22016, 32000, 16384, "bfloat16", rope_theta=1000000.0),
    "llama-3-70b": _llama(8192, 80, 64, 8, 28672, 128256, 8192, "bfloat16", rope_theta=500000.0),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, 131072, "bfloat16", rope_theta=500000.0),
    "llama-3.1-70b": _llama(8192, 80, 64, 8, 28672, 128256, 131072, "bfloat16", rope_theta=500000.0),
    "mistral-7b": {**_llama(4096, 32, 32, 8, 14336, 32000, 32768, "bfloat16", rope_theta=1000000.0),
                   "architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    # mixtures of experts (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B)
    "mixtral-8x7b": {**_llama(4096, 32, 32, 8, 14336, 32000, 32768, "bfloat16", rope_theta=1000000.0),
                     "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "sliding_window": None,
                     "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3-30b-a3b": {**_llama(2048, 48, 32, 4, 6144, 151936, 40960, "bfloat16", rope_theta=1000000.0),
                      "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
                      "rms_norm_eps": 1e-6, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None},
}


def reference_config(name: str) -> dict | None:
    """A fresh copy of a reference model's config, or None."""
    cfg = REFERENCE_CONFIGS.get(name)
    return copy.deepcopy(cfg) if cfg is not None else None
