"""Engine knobs: `EngineArgs` (what the user sets) -> `EngineConfig` (resolved, validated).

The seed's continuous batching is bounded by two numbers: `max_num_seqs` (how many
requests may share a step) and `max_num_batched_tokens` (how many tokens one step may
feed the model).  Every CLI flag here is also an `LLM(...)` keyword of the same name
in snake case, as in vLLM.

`EngineConfig.resolve` decides every default exactly once -- max_model_len from the
model's max_position_embeddings, the token budget, how many KV blocks -- from the
arguments, the model's shape (`ModelShape`) and the device.  The engine runs with the
result; the simulator and the benchmarks resolve the same way, so none of them keeps a
copy of a default.  Pure Python: no torch (whoever measures device memory passes it in).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

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
    linear_backend: str = "auto"  # auto|panels|onednn|torch: the matmuls (model/weights/loader.py)
    quantization: str | None = None  # None|int8|int4|int4-g128: weight-only, at load (model/weights/quantization.py)
    enforce_eager: bool = False  # no CUDA / CPU graphs for decode steps
    # schedule and launch step N+1 while step N runs on the device (engine/overlap.py)
    async_scheduling: bool = False
    # n-gram speculative decoding, vLLM's dict (or its JSON text): tokenloom/spec_decode/config.py
    speculative_config: dict | str | None = None
    tensor_parallel_size: int = 1  # ranks that each hold 1/N of every layer (model/weights/parallel.py)
    distributed_init_port: int | None = None  # the group's rendezvous port (default: a free one)
    # LoRA adapters (docs/lora.md): requests pick one (LoRARequest) and share steps with the base
    enable_lora: bool = False
    max_loras: int = 1  # adapters one step may mix (their weight slots)
    max_lora_rank: int = 16  # the largest adapter rank the slots take
    num_threads: int | None = None
    chat_template: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    # what the engine runs: generate (sample tokens) or pooling (embeddings); auto = pooling
    # for a base-model checkpoint (no LM head), else generate.  `task` is vLLM's older
    # spelling (generate | embed).  See resolve_runner and docs/embeddings.md.
    runner: str = "auto"
    task: str | None = None

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
        g.add_argument("--linear-backend", default="auto", choices=["auto", "panels", "onednn", "torch"],
                       help="the matmuls: panels = our CPU GEMM, onednn = oneDNN's packed weights, torch = "
                            "nn.Linear (cuBLAS on GPUs); auto = the fastest that runs here")
        g.add_argument("--quantization", default=None, choices=["int8", "int4", "int4-g128"],
                       help="weight-only quantization at load: int8 per output channel; int4 in groups of 32 "
                            "(int4-g128: of 128) along the input; activations stay in --dtype (docs/quantization.md)")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (docs/speculative-decoding.md)')
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split every layer over N processes (torch.distributed: gloo on CPU, NCCL on GPUs)")
        g.add_argument("--distributed-init-port", type=int, default=None,
                       help="rendezvous port of the tensor-parallel group (default: a free one)")
        g.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (peft's format) beside the base model: requests pick one by "
                            "name, and requests on different adapters share steps (docs/lora.md)")
        g.add_argument("--max-loras", type=int, default=1,
                       help="how many different adapters one step may run (each takes a weight slot)")
        g.add_argument("--max-lora-rank", type=int, default=16,
                       help="the largest adapter rank accepted; every slot is this wide")
        g.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly (no CUDA graphs on a GPU, no CPU graphs on a CPU)")
        g.add_argument("--async-scheduling", action="store_true",
                       help="overlap the host's work for the next decode step with the device's current one: "
                            "the next step is scheduled and launched before this one's tokens reach the host, "
                            "its input ids taken from the sampled tokens on the device (docs/gpu.md)")
        g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        g.add_argument("--chat-template", default=None, help="Jinja chat template file or string")
        g.add_argument("--revision", default=None)
        g.add_argument("--runner", default="auto", choices=list(RUNNERS),
                       help="generate: sample tokens; pooling: embeddings (/v1/embeddings, LLM.embed); auto: "
                            "pooling for a checkpoint without an LM head, else generate (docs/embeddings.md)")
        g.add_argument("--task", default=None, choices=list(TASKS),
                       help="vLLM's older spelling of --runner: embed = pooling")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


RUNNERS = ("auto", "generate", "pooling")
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling"}  # vLLM's --task -> --runner


def resolve_runner(runner: str, task: str | None, headless: bool) -> str:
    """"generate" or "pooling": what `--runner` / `--task` ask of a model that has an LM head
    (or not: `headless`); ValueError naming the setting that cannot hold."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
        if runner != "auto" and TASKS[task] not in ("auto", runner):
            raise ValueError(f"--task {task} contradicts --runner {runner}")
        runner = TASKS[task] if runner == "auto" else runner
    if runner == "auto":
        return "pooling" if headless else "generate"
    if runner == "generate" and headless:
        raise ValueError("--runner generate: this checkpoint is a base model without an LM head (what "
                         "sentence-transformers saves); it can only embed: use --runner pooling")
    return runner


@dataclass(frozen=True)
class SchedulerConfig:
    """What the (pure-Python) scheduler needs; shared by the engine and the simulator."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    max_loras: int = 0  # distinct LoRA adapters the running requests may use at once (0: no LoRA, no limit)
    # A request that grows past this many tokens is recomputed from scratch once, at that
    # step: the model rotates whole sequences differently beyond it (Phi-3's LongRoPE), so
    # the K/V cached before no longer hold.  None: never.
    recompute_past: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError("--max-loras must not be negative")
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


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving (`--enable-lora`): `max_loras` adapters may run in one step, each in a
    preallocated weight slot `max_lora_rank` wide (model/lora.py)."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for flag, v in (("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v!r}")

    @classmethod
    def from_args(cls, args: "EngineArgs") -> "LoRAConfig | None":
        """The LoRA settings of `args`, None without --enable-lora."""
        return cls(args.max_loras, args.max_lora_rank) if args.enable_lora else None


# ---------------------------------------------------------------- resolving the settings
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}

# Default KV cache budget.  CUDA: most of the device memory left free once the weights are
# loaded.  CPU: a quarter of the available RAM, at most 4 GiB -- enough for long contexts on
# the small models a CPU serves, while leaving room for activations and the rest of the machine.
CUDA_KV_SHARE_OF_FREE = 0.85
CPU_KV_SHARE_OF_AVAILABLE = 0.25
CPU_KV_MAX_BYTES = 4 * 2**30


@dataclass(frozen=True)
class ModelShape:
    """What sizing the engine needs of a model, from its parsed config
    (`model.hf_config.model_args_fields`)."""

    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # LongRoPE: the sequence length past which the long-context rotation applies, else None
    rope_long_from: int | None = None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "ModelShape":
        rope = fields.get("rope_scaling") or {}
        long_from = rope.get("original_max_position_embeddings") if rope.get("rope_type") == "longrope" else None
        return cls(**{f.name: int(fields[f.name]) for f in dataclasses.fields(cls) if f.name != "rope_long_from"},
                   rope_long_from=long_from)

    def kv_bytes_per_block(self, block_size: int, dtype: str) -> int:
        """K and V of `block_size` tokens, every layer."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """`--max-model-len`, defaulting to (and never above) the model's max_position_embeddings."""
    max_model_len = requested or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                         f"({max_position_embeddings}); lower it")
    if max_model_len < 1:
        raise ValueError("--max-model-len must be >= 1")
    return max_model_len


def default_kv_cache_bytes(device: str, free_bytes: int | None = None) -> int:
    """The KV cache budget when neither --num-kv-blocks nor --kv-cache-memory is given.

    `free_bytes`: on CUDA the device memory free after the weights were loaded (required);
    on CPU the available RAM (read with psutil when not given)."""
    if device.startswith("cuda"):
        if free_bytes is None:
            raise ValueError("sizing a CUDA KV cache needs the free device memory")
        return int(free_bytes * CUDA_KV_SHARE_OF_FREE)
    if free_bytes is None:
        import psutil

        free_bytes = int(psutil.virtual_memory().available)
    return min(int(free_bytes * CPU_KV_SHARE_OF_AVAILABLE), CPU_KV_MAX_BYTES)


@dataclass(frozen=True)
class BackendPlan:
    """Which code runs on this machine, decided once (`model/backends.py resolve_backends`)
    right after the settings, before anything loads; printed in the start-up summary and
    handed whole to whoever builds a model or a runner (tensor-parallel workers included),
    so nothing downstream re-decides a choice or branches on it per step.  Pure data:
    picklable, no torch."""

    device: str  # cpu | cuda (the device type; rank r of a GPU group takes cuda:r)
    dtype: str  # float32 | bfloat16 | float16
    linear: str  # panels | onednn | torch: how every matmul runs (model/weights/loader.py packs for it)
    quantization: str | None  # weight-only scheme (model/weights/quantization.py), or None
    attention: str  # cpu | triton | sdpa (model/attention.py)
    ops: str  # torch | cpu | triton: norms, rotary, SwiGLU (model/ops.py)
    fused_kv_write: bool  # rotary + KV cache write in one op (off under torch.compile)
    flat_calls: bool  # layers call their linears as plain functions, not modules (model/llama.py `bind`)
    compile: bool  # torch.compile the forward
    cuda_graphs: bool  # decode-only steps replay CUDA graphs (runner/cuda_graphs.py)
    cuda_graphs_off: str | None = None  # why not, when not
    cpu_graphs: bool = False  # decode-only steps replay recorded op lists on a CPU (runner/cpu_graphs.py)
    cpu_graphs_off: str | None = None  # why not, when not (on a CPU)
    lora: str | None = None  # cpu | torch: how LoRA adapters' deltas run (model/lora.py); None: no LoRA
    # layers whose attention the backend cannot run and the torch reference runs instead, and why
    attention_fallback: str | None = None
    # the checkpoint's own quantization (GPTQ, AWQ, compressed-tensors: model/weights/formats/), in words
    prequantized: str | None = None

    def describe(self) -> str:
        """The plan in words, for the start-up summary."""
        quant = f" ({self.quantization})" if self.quantization else ""
        if self.prequantized:
            quant = f" (pre-quantized: {self.prequantized})"
        if self.device == "cpu":
            graphs = "CPU graphs" if self.cpu_graphs else f"no CPU graphs ({self.cpu_graphs_off})"
        else:
            graphs = "CUDA graphs" if self.cuda_graphs else f"no CUDA graphs ({self.cuda_graphs_off})"
        fallback = f" ({self.attention_fallback})" if self.attention_fallback else ""
        return (f"linear backend {self.linear}{quant}, attention backend {self.attention}{fallback}, "
                f"ops backend {self.ops}"
                f"{', fused rotary + KV write' if self.fused_kv_write else ''}"
                f"{', flat calls' if self.flat_calls else ''}{', torch.compile' if self.compile else ''}, "
                f"{graphs}{f', LoRA by {self.lora} ops' if self.lora else ''}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings with every default decided and every limit checked.

    Built by `resolve` from `EngineArgs`, the model's shape and the device; read by the
    engine (scheduler, KV cache, runner), the simulator and the benchmarks."""

    model: str  # the model directory
    model_name: str  # as the user named it (hub id, directory, or the bundled model's name)
    tokenizer: str
    revision: str | None
    dtype: str  # float32 | bfloat16 | float16
    device: str  # cpu | cuda | cuda:N
    seed: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    kv_blocks_from: str  # how num_kv_blocks was chosen: --num-kv-blocks, --kv-cache-memory or default
    scheduler: SchedulerConfig
    enable_prefix_caching: bool
    attention_backend: str  # as asked ("auto" or a name), as is ops_backend; `backends`: what they resolved to
    ops_backend: str
    compile: bool
    enforce_eager: bool
    num_threads: int | None
    chat_template: str | None
    # What the backend requests resolved to on this machine (model/backends.py), set by the
    # engine; None where nothing runs a model (sim, bench).  Not compared: two configs of the
    # same settings are equal whether or not a machine resolved them.
    backends: BackendPlan | None = dataclasses.field(default=None, compare=False)
    lora: LoRAConfig | None = None  # --enable-lora: adapter slots and their width; None: no LoRA

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def resolve(cls, args: EngineArgs, shape: ModelShape, *, model: str, model_name: str, device: str,
                dtype: str, free_memory_bytes: Callable[[], int | None] = lambda: None,
                backends: BackendPlan | None = None) -> "EngineConfig":
        """Decide every default of `args` for a model of `shape` on `device` in `dtype`.

        `backends`: the plan the engine resolved for these settings (`model/backends.py`).

        `free_memory_bytes` is called only when the KV cache size is left to the default
        (see `default_kv_cache_bytes`); the engine passes the device's free memory after
        loading the weights."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        max_model_len = resolve_max_model_len(args.max_model_len, shape.max_position_embeddings)
        lora = LoRAConfig.from_args(args)
        block_size = args.block_size
        if block_size < 1:
            raise ValueError("--block-size must be >= 1")
        per_block = shape.kv_bytes_per_block(block_size, dtype)
        if args.num_kv_blocks is not None:
            num_blocks, source = args.num_kv_blocks, "--num-kv-blocks"
        elif args.kv_cache_memory is not None:
            num_blocks, source = parse_size(args.kv_cache_memory) // per_block, "--kv-cache-memory"
        else:
            # Never more than max_num_seqs full-length requests can use: small models stay small.
            useful = args.max_num_seqs * -(-max_model_len // block_size)
            budget = default_kv_cache_bytes(device, free_memory_bytes())
            num_blocks, source = min(budget // per_block, useful), "default"
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one request of "
                f"--max-model-len {max_model_len} tokens; raise --kv-cache-memory / --num-kv-blocks or lower "
                f"--max-model-len"
            )
        scheduler = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens
            or default_max_num_batched_tokens(max_model_len, args.enable_chunked_prefill),
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            max_loras=lora.max_loras if lora is not None else 0,
            # LongRoPE's second rotation only where a request can grow past its first one
            recompute_past=(shape.rope_long_from if shape.rope_long_from is not None
                            and shape.rope_long_from < max_model_len else None),
        )
        return cls(
            model=str(model), model_name=str(model_name), tokenizer=str(args.tokenizer or model),
            revision=args.revision, dtype=dtype, device=device, seed=args.seed, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=int(num_blocks), kv_bytes_per_block=per_block,
            kv_blocks_from=source, scheduler=scheduler, enable_prefix_caching=args.enable_prefix_caching,
            attention_backend=args.attention_backend, ops_backend=args.ops_backend, compile=args.compile,
            enforce_eager=args.enforce_eager, num_threads=args.num_threads, chat_template=args.chat_template,
            backends=backends, lora=lora,
        )


def spell_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, skip=()) -> list[str]:
    """The flags of `parser` whose value in `args` differs from its default, spelled back as a
    command line, so another process (a data-parallel replica, a server a benchmark launches)
    runs with what the user asked."""
    flags: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        opt = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(opt if value else "--no-" + opt[2:])
        elif action.nargs == 0:  # store_true / store_false
            flags.append(opt)
        elif isinstance(value, (list, tuple)):
            flags += [opt, *map(str, value)]
        else:
            flags += [opt, str(value)]
    return flags
