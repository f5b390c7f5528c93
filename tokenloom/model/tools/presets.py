"""Model presets for `tokenloom make-model`, `estimate` and `simulate`.

Each preset is a Hugging Face `config.json` dictionary.  The tiny ones exercise every
supported architecture's features (GQA, qkv bias, q/k norm, tied/untied embeddings,
llama3 rope scaling) in a few MB; the real shapes copy the published configs of
Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B (and bigger ones used only by the estimator),
so benchmarks and estimates run on the same shapes users deploy.
"""

from __future__ import annotations

import copy

_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    torch_dtype="float32",
    vocab_size=1024,
    bos_token_id=1,
    eos_token_id=2,
)

PRESETS: dict[str, dict] = {
    "tiny-llama": {
        **_TINY_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "tiny-mistral": {
        **_TINY_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "head_dim": 16,
    },
    "tiny-qwen2": {
        **_TINY_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    "tiny-qwen3": {
        **_TINY_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "head_dim": 32,  # Qwen3 decouples head_dim from hidden/heads
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    # ---- real shapes (random weights when made here) ----
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 24,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # ---- shapes for the estimator / simulator only (too big to make here usefully) ----
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": 152064,
        "torch_dtype": "bfloat16",
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
}

# Presets small enough that `make-model` is quick and tests can use them.
TINY_PRESETS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3")


def get_preset(name: str) -> dict:
    """A fresh copy of a preset's config dict; KeyError lists the known names."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
