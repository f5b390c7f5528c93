"""How rank 0 hands each step to the other ranks of a tensor-parallel group.

Rank 0 schedules and samples; every rank must run the same forward pass (the all-reduces
inside it pair up across ranks) and the same logits computations (the LM head's
all-gather).  So before its forward, rank 0 broadcasts the step: input ids, positions,
the attention metadata (lengths, block tables, slots: the same on every rank, each
rank's cache holding its own heads), the hidden-state rows it will take logits of, and
the KV blocks to copy first (beam search's copy-on-write: every rank copies its heads).
`None` ends the workers' loop.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tokenloom.model.attention import AttentionMetadata


def _meta_fields(meta: AttentionMetadata) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "backend"}


def send_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              logit_rows: list[torch.Tensor], kv_copies: list[tuple[int, int]] = ()) -> None:
    dist.broadcast_object_list([(input_ids, positions, _meta_fields(meta), logit_rows, list(kv_copies))], src=0)


def send_stop() -> None:
    dist.broadcast_object_list([None], src=0)


def recv_step():
    """(input_ids, positions, metadata fields, logit rows, KV block copies), or None at the end."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
