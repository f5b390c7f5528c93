"""Tiny sentence-transformers models for the embedding tests: a random-weight decoder wrapped
by sentence-transformers itself (Transformer + Pooling + Normalize) and saved by it, so the
directory the engine reads is exactly what sentence-transformers (through transformers'
`save_pretrained`) writes: a base model without its LM head, modules.json, 1_Pooling/."""

from __future__ import annotations

import json
from pathlib import Path

from server_fixtures import copy_without_chat_template


def make_st_model(base: Path, out: Path, pooling_mode: str, *, normalize: bool = True,
                  config_extra: dict | None = None) -> Path:
    """`base` (a tokenloom make-model directory) as a SentenceTransformer pooling with
    `pooling_mode` ("lasttoken" | "mean" | "cls"), saved to `out`.  The chat template is
    dropped first: sentence-transformers renders plain texts through a tokenizer's chat
    template when it has one, while OpenAI's and vLLM's `input` strings are encoded as they
    are.  `config_extra`: keys added to the saved config.json (matryoshka_dimensions)."""
    from sentence_transformers import SentenceTransformer, models

    plain = copy_without_chat_template(base, out.parent / f"{out.name}-decoder")
    body = models.Transformer(str(plain))
    size = getattr(body, "get_embedding_dimension", None) or body.get_word_embedding_dimension  # 6.x renamed it
    modules = [body, models.Pooling(size(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    if config_extra:
        cfg_path = out / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config_extra}))
    return out
