"""tokenloom: an LLM inference engine you can watch decode.

Prefill fills the paged KV cache, decode adds one token per request per step, and
continuous batching packs many requests into every step.  See README.md.

The public names are imported lazily, so torch-free tools (`tokenloom estimate`,
`tokenloom simulate`) start without paying for a torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tokenloom.version import __version__

_EXPORTS = {
    "LLM": "tokenloom.entrypoints.llm",
    "SamplingParams": "tokenloom.sampling_params",
    "BeamSearchParams": "tokenloom.sampling_params",
    "PoolingParams": "tokenloom.pooling_params",
    "EngineArgs": "tokenloom.config",
    "RequestOutput": "tokenloom.outputs",
    "CompletionOutput": "tokenloom.outputs",
    "RequestMetrics": "tokenloom.outputs",
    "Logprob": "tokenloom.outputs",
    "EmbeddingRequestOutput": "tokenloom.outputs",
    "BeamSearchOutput": "tokenloom.outputs",
    "StepEvent": "tokenloom.core.events",
    "StepEntry": "tokenloom.core.events",
    "LLMEngine": "tokenloom.engine.llm_engine",
    "LoRARequest": "tokenloom.request",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")


if TYPE_CHECKING:  # for type checkers and IDEs
    from tokenloom.config import EngineArgs
    from tokenloom.core.events import StepEntry, StepEvent
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.outputs import (BeamSearchOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                                   RequestMetrics, RequestOutput)
    from tokenloom.pooling_params import PoolingParams
    from tokenloom.request import LoRARequest
    from tokenloom.sampling_params import BeamSearchParams, SamplingParams
