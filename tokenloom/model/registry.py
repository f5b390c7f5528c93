"""Which Hugging Face `architectures` tokenloom runs with its own model code."""

from __future__ import annotations

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",  # text-only (model_type gemma3_text); not the multimodal Gemma3ForConditionalGeneration
    "Phi3ForCausalLM",
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
