"""Which Hugging Face `architectures` tokenloom runs with its own model code."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",  # mixture of experts (model/moe.py)
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)


def resolve_architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise ValueError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
        f"tokenloom supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
