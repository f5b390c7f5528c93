"""The runner's side of LoRA: each step's rows grouped by adapter, once per step.

The runner puts a step's decodes, then its prefill chunks, in adapter order (base model
first), so every adapter's rows are one or two contiguous runs; `LoRAStep.prepare` finds
each adapter a weight slot (model/lora.py `LoRASlots`) and hands the wrapped linears the
runs as (start, end, slot) segments.  Every layer reads the same segments: nothing is
sorted or gathered per layer.  The scheduler has already kept the adapters of the running
requests within --max-loras, so the step's adapters always fit the slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.core.scheduler import ScheduledRequest
from tokenloom.model.lora import LoRARows, LoRASlots


def by_adapter(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """`scheduled` in adapter order, base-model requests first, otherwise as they were."""
    return sorted(scheduled, key=lambda s: s.request.lora_int_id)


class LoRAStep:
    """The slots and the rows every wrapped linear reads (`model.lora.attach` wired them)."""

    def __init__(self, slots: LoRASlots, rows: LoRARows):
        self.slots, self.rows = slots, rows

    def prepare(self, order: Sequence[ScheduledRequest], offsets: Sequence[int]) -> None:
        """Segments for a step whose request `order[i]` has its rows from `offsets[i]` on
        (`num_new_tokens` of them)."""
        adapters = {s.request.lora_int_id: s.request.lora_adapter for s in order if s.request.lora_int_id}
        if not adapters:
            self.rows.set([])
            return
        slot_of = self.slots.assign(adapters)
        segments: list[tuple[int, int, int]] = []
        for s, start in zip(order, offsets):
            lid = s.request.lora_int_id
            if not lid:
                continue
            slot, end = slot_of[lid], start + s.num_new_tokens
            if segments and segments[-1][2] == slot and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], end, slot)
            else:
                segments.append((start, end, slot))
        self.rows.set(segments)

    def clear(self) -> None:
        self.rows.set([])
