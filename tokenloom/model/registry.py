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
    "MixtralForCausalLM",  # mixture of experts (model/moe.py)
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)


def headless_of(arch: str) -> str | None:
    """The causal-LM architecture whose base model `arch` is (`LlamaModel` -> `LlamaForCausalLM`):
    what sentence-transformers saves of a decoder, the network without its LM head."""
    if arch.endswith("Model"):
        full = arch[: -len("Model")] + "ForCausalLM"
        if full in SUPPORTED_ARCHITECTURES:
            return full
    return None


def is_headless(cfg: dict) -> bool:
    """Whether the checkpoint holds a base model only (no LM head: it can embed, not generate)."""
    archs = cfg.get("architectures") or []
    return not any(a in SUPPORTED_ARCHITECTURES for a in archs) and any(headless_of(a) for a in archs)


def resolve_architecture(cfg: dict) -> str:
    """The model code to run: a supported architecture, or the causal LM a base model is the
    body of (`is_headless`)."""
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    for a in archs:
        if headless_of(a):
            return headless_of(a)
    raise ValueError(
        f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
        f"tokenloom supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
