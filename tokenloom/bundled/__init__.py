"""The model tokenloom ships, so `tokenloom serve` / `generate` / `LLM()` work offline.

`py-tiny` is a few-million-parameter Llama-architecture causal LM trained from scratch on the
running interpreter's standard library (see `scripts/train_bundled_model.py` and
`docs/bundled-model.md`).  It is a real Hugging Face directory (config.json, model.safetensors,
tokenizer.json, ...), so transformers loads it too and serves as the engine's parity reference.

`bits_per_byte` is the held-out metric the training script reports and the tests recompute;
keeping one implementation means the published figure and the checked figure cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BUNDLED_MODEL_DIR: Path = Path(__file__).resolve().parent / "py-tiny"
BUNDLED_MODEL_NAME = "tokenloom/py-tiny"

__all__ = ["BUNDLED_MODEL_DIR", "BUNDLED_MODEL_NAME", "bits_per_byte"]


def bits_per_byte(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    context: int,
    eos_token_id: int = 2,
    batch_size: int = 8,
) -> float:
    """Held-out bits per UTF-8 byte of `texts` under a causal LM.

    Each text is scored as a document that follows `<|endoftext|>` (as in training), cut into
    non-overlapping windows of `context` tokens; every token of the text is predicted exactly
    once, so bpb = sum(token NLL in nats) / ln 2 / total UTF-8 bytes.  Non-overlapping windows
    give a slightly pessimistic (upper-bound) figure, which is the safe side for a published bound.

    `tokenizer` is a `tokenizers.Tokenizer` or a transformers tokenizer; `model` is any module
    returning `.logits` (a transformers causal LM).
    """
    import torch  # lazy: importing the package must not pull in torch

    windows: list[list[int]] = []
    total_bytes = 0
    for text in texts:
        enc = tokenizer.encode(text)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
        stream = [eos_token_id, *ids]
        total_bytes += len(text.encode("utf-8"))
        for start in range(0, len(ids), context):
            windows.append(stream[start : start + context + 1])
    if total_bytes == 0:
        raise ValueError("no text to evaluate")

    was_training = model.training
    model.eval()
    nll = 0.0
    with torch.no_grad():
        # Sort by length so batches need little padding; the sum does not depend on order.
        windows.sort(key=len)
        for b in range(0, len(windows), batch_size):
            chunk = windows[b : b + batch_size]
            width = max(len(w) for w in chunk) - 1
            inp = torch.zeros(len(chunk), width, dtype=torch.long)
            tgt = torch.full((len(chunk), width), -100, dtype=torch.long)
            for i, w in enumerate(chunk):
                inp[i, : len(w) - 1] = torch.tensor(w[:-1])
                tgt[i, : len(w) - 1] = torch.tensor(w[1:])
            # Right padding + causal attention: real positions never attend to the padding.
            logits = model(input_ids=inp).logits.float()
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="sum"
            ).item()
    if was_training:
        model.train()
    return nll / math.log(2) / total_bytes
