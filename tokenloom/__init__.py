"""tokenloom: an LLM inference engine you can watch decode.

Prefill fills the paged KV cache, decode adds one token per request per step, and
continuous batching packs many requests into every step.  See README.md.
"""

from tokenloom.config import EngineArgs
from tokenloom.engine.events import StepEntry, StepEvent
from tokenloom.entrypoints.llm import LLM
from tokenloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "RequestMetrics",
    "Logprob", "StepEvent", "StepEntry", "__version__",
]
