"""Engine knobs: `EngineArgs` (what the user sets) -> `EngineConfig` (resolved, validated).

The seed's continuous batching is bounded by two numbers: `max_num_seqs` (how many
requests may share a step) and `max_num_batched_tokens` (how many tokens one step may
feed the model).  Every CLI flag here is also an `LLM(...)` keyword of the same name
in snake case, as in vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int | float) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass
class EngineArgs:
    """User-facing engine settings (vLLM names).  `None` means 'derive a default'."""

    model: str | None = None  # HF directory or hub id; None = the bundled model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto|float32|bfloat16|float16
    device: str = "auto"  # auto|cpu|cuda[:N]
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs|priority
    compile: bool = False
    attention_backend: str = "auto"  # auto|cpu|triton|sdpa (model/attention.py)
    ops_backend: str = "auto"  # auto|torch|cpu|triton: norms, rotary, SwiGLU (model/ops.py)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    num_threads: int | None = None
    chat_template: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    # ---- CLI plumbing -------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, with_model: bool = True) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        if with_model:
            g.add_argument("--model", default=None, help="HF model directory or hub id (default: the bundled model)")
        g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"])
        g.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--num-kv-blocks", type=int, default=None)
        g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
        g.add_argument("--compile", action="store_true", help="torch.compile the model forward")
        g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "triton", "sdpa"],
                       help="how attention reads the paged KV cache: auto = triton on CUDA, our C++ kernel on CPU; "
                            "sdpa = PyTorch's SDPA over gathered blocks (the reference)")
        g.add_argument("--ops-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                       help="norms, rotary and SwiGLU: auto = follow the attention backend (triton), our C++ ops on "
                            "CPU; torch = PyTorch's ops (the reference)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly (no CUDA graphs)")
        g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        g.add_argument("--chat-template", default=None, help="Jinja chat template file or string")
        g.add_argument("--revision", default=None)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class SchedulerConfig:
    """What the (pure-Python) scheduler needs; shared by the engine and the simulator."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with --no-enable-chunked-prefill a whole prompt must fit in one step: "
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-model-len "
                f"({self.max_model_len}); raise the budget, lower --max-model-len, or enable chunked prefill"
            )


def default_max_num_batched_tokens(max_model_len: int, enable_chunked_prefill: bool) -> int:
    """vLLM-like default: a moderate token budget with chunking, else the whole context."""
    if enable_chunked_prefill:
        return 2048
    return max(max_model_len, 2048)
