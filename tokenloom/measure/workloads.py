"""Benchmark workloads: seeded, reproducible lists of requests with arrival times.

A workload is the "who asks what, and when" half of a benchmark.  Every request is a
`BenchRequest`: prompt token ids (drawn from a caller-given vocab range, so prompts can
be sent as token ids and never depend on a tokenizer's round trip), the number of
tokens it must generate (enforced with `ignore_eos` unless `--respect-eos`), an arrival
time in seconds relative to the start of the run, and an optional group tag used by
per-group breakdowns.

Workloads (`--workload`):

- ``random``:        input/output lengths uniform in ``--input-len MIN:MAX`` / ``--output-len MIN:MAX``.
- ``sharegpt-like``: log-normal (long-tailed) lengths clipped to the same ranges; see
                     `SHAREGPT_LIKE` for the parameters.
- ``mixed-long``:    mostly short prompts plus ``--long-fraction`` of ``--long-len``-token
                     prompts (groups "short" / "long"); the seed's "how long prompts wreck
                     P95" experiment.
- ``prefix``:        ``--num-prefix-groups`` groups, each sharing one ``--prefix-len``-token
                     prefix, followed by a unique suffix of ``--input-len`` tokens (groups
                     "prefix-0", "prefix-1", ...); exercises prefix caching.

Arrivals: ``--request-rate inf`` (the default) puts every request at t=0 (an offline
burst); a finite rate draws gamma-distributed gaps with shape ``--burstiness`` and mean
``1/rate`` (burstiness 1 = a Poisson process; <1 burstier, >1 more regular), as vLLM's
serving benchmark does.

Lengths/tokens and arrivals use independent random streams of the same seed, so the
same ``--seed`` gives the same prompts at any request rate.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

WORKLOADS = ("random", "sharegpt-like", "mixed-long", "prefix")

# Ids below this are commonly special (pad/bos/eos/unk/...) in small vocabularies.
MIN_TOKEN_ID = 5


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0  # seconds after the start of the run
    group: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LogNormalLengths:
    """Log-normal length model described relative to a [lo, hi] range.

    The median sits at ``lo * (hi/lo) ** median_pos`` (a position on the log scale of the
    range) and sigma is ``sigma_frac * ln(hi/lo)``; draws are rounded and clipped to
    [lo, hi].  Relative parameters keep the shape (most requests short, a long tail)
    whatever range the user picks.
    """

    median_pos: float
    sigma_frac: float

    def sample(self, rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
        if lo == hi:
            return np.full(n, lo, dtype=np.int64)
        span = math.log(hi / lo)
        mu = math.log(lo) + self.median_pos * span
        x = rng.lognormal(mean=mu, sigma=self.sigma_frac * span, size=n)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)


# ShareGPT conversations: prompts have a median well below the mean and a long tail of
# pasted documents; answers are a little less skewed.  With --input-len 16:1024 this
# gives a prompt median of ~85 tokens, a mean near 165, ~2% of prompts clipped at 1024
# and ~9% at 16.
SHAREGPT_LIKE = {
    "input": LogNormalLengths(median_pos=0.4, sigma_frac=0.3),
    "output": LogNormalLengths(median_pos=0.5, sigma_frac=0.3),
}


@dataclass
class WorkloadSpec:
    """Everything that determines a workload (recorded verbatim in benchmark JSON)."""

    name: str = "random"
    num_prompts: int = 64
    input_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (32, 128)
    seed: int = 0
    vocab_range: tuple[int, int] = (MIN_TOKEN_ID, 32000)  # [low, high) token ids
    request_rate: float = math.inf  # requests/s; inf = all at t=0
    burstiness: float = 1.0
    long_fraction: float = 0.1
    long_len: int = 1024
    num_prefix_groups: int = 4
    prefix_len: int = 256
    respect_eos: bool = False
    max_model_len: int | None = None  # if set, prompts are shortened so prompt+output fits

    def __post_init__(self) -> None:
        self.input_len = tuple(self.input_len)  # type: ignore[assignment]
        self.output_len = tuple(self.output_len)  # type: ignore[assignment]
        self.vocab_range = tuple(self.vocab_range)  # type: ignore[assignment]
        self.validate()

    @property
    def ignore_eos(self) -> bool:
        return not self.respect_eos

    def validate(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}; got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        for flag, (lo, hi) in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{flag} must be MIN:MAX with 1 <= MIN <= MAX; got {lo}:{hi}")
        lo, hi = self.vocab_range
        if not 0 <= lo < hi:
            raise ValueError(f"vocab range must be [low, high) with 0 <= low < high; got [{lo}, {hi})")
        if not (self.request_rate > 0):
            raise ValueError("--request-rate must be > 0 (or 'inf')")
        if not (self.burstiness > 0):
            raise ValueError("--burstiness must be > 0")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("--long-fraction must be in [0, 1]")
        if self.long_len < 1:
            raise ValueError("--long-len must be >= 1")
        if self.num_prefix_groups < 1:
            raise ValueError("--num-prefix-groups must be >= 1")
        if self.prefix_len < 0:
            raise ValueError("--prefix-len must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        d["ignore_eos"] = self.ignore_eos
        return d


# ---------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------


def _uniform_lengths(rng: np.random.Generator, rng_range: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = rng_range
    return rng.integers(lo, hi + 1, size=n)


def _tokens(rng: np.random.Generator, vocab_range: tuple[int, int], n: int) -> list[int]:
    lo, hi = vocab_range
    return rng.integers(lo, hi, size=int(n)).tolist()


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s) of `n` requests: all 0 for an infinite rate, else cumulative
    gamma(shape=burstiness, mean=1/rate) gaps starting at t=0."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # independent of the length/token stream
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def generate_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """Build the workload `spec` describes; same spec -> identical requests."""
    rng = np.random.default_rng([spec.seed, 0])
    n = spec.num_prompts
    out_lens = _uniform_lengths(rng, spec.output_len, n)
    groups: list[str | None] = [None] * n
    prompts: list[list[int]]

    if spec.name == "random":
        in_lens = _uniform_lengths(rng, spec.input_len, n)
        prompts = [_tokens(rng, spec.vocab_range, k) for k in in_lens]
    elif spec.name == "sharegpt-like":
        in_lens = SHAREGPT_LIKE["input"].sample(rng, *spec.input_len, n)
        out_lens = SHAREGPT_LIKE["output"].sample(rng, *spec.output_len, n)
        prompts = [_tokens(rng, spec.vocab_range, k) for k in in_lens]
    elif spec.name == "mixed-long":
        # An exact count (not a coin flip per request) so a small run still has its long ones.
        num_long = int(round(spec.long_fraction * n))
        is_long = np.zeros(n, dtype=bool)
        is_long[rng.choice(n, size=num_long, replace=False)] = True
        in_lens = np.where(is_long, spec.long_len, _uniform_lengths(rng, spec.input_len, n))
        prompts = [_tokens(rng, spec.vocab_range, k) for k in in_lens]
        groups = ["long" if x else "short" for x in is_long]
    elif spec.name == "prefix":
        prefixes = [_tokens(rng, spec.vocab_range, spec.prefix_len) for _ in range(spec.num_prefix_groups)]
        # Round-robin then shuffle: every group gets its share, in no particular order.
        group_of = rng.permutation(np.arange(n) % spec.num_prefix_groups)
        suffix_lens = _uniform_lengths(rng, spec.input_len, n)
        prompts = [prefixes[g] + _tokens(rng, spec.vocab_range, k) for g, k in zip(group_of, suffix_lens)]
        groups = [f"prefix-{g}" for g in group_of]
    else:  # pragma: no cover - validate() rejects unknown names
        raise ValueError(spec.name)

    arrivals = arrival_times(n, spec.request_rate, spec.burstiness, spec.seed)
    reqs = []
    for p, o, t, g in zip(prompts, out_lens, arrivals, groups):
        o = int(o)
        if spec.max_model_len is not None:
            o = min(o, spec.max_model_len - 1)
            # Keep the prompt's head (where a shared prefix lives) and drop its tail.
            p = p[: spec.max_model_len - o]
        reqs.append(BenchRequest(prompt_token_ids=p, output_len=o, arrival_time=float(t), group=g))
    return reqs


def workload_stats(reqs: Sequence[BenchRequest]) -> dict[str, Any]:
    """Shape of a workload, for reports: counts and length summaries."""
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    groups: dict[str, int] = {}
    for r in reqs:
        if r.group is not None:
            groups[r.group] = groups.get(r.group, 0) + 1
    return {
        "num_requests": len(reqs),
        "total_input_tokens": int(ins.sum()),
        "total_output_tokens": int(outs.sum()),
        "input_len": {"min": int(ins.min()), "mean": float(ins.mean()), "max": int(ins.max())},
        "output_len": {"min": int(outs.min()), "mean": float(outs.mean()), "max": int(outs.max())},
        "duration_of_arrivals_s": float(max(r.arrival_time for r in reqs)),
        "groups": groups,
    }


def save_jsonl(reqs: Sequence[BenchRequest], path: str | Path) -> None:
    """One request per line, so a workload can be replayed elsewhere (e.g. the simulator)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(asdict(r)) + "\n")


def load_jsonl(path: str | Path) -> list[BenchRequest]:
    with open(path, encoding="utf-8") as f:
        return [BenchRequest(**json.loads(line)) for line in f if line.strip()]


# ---------------------------------------------------------------------------
# vocab
# ---------------------------------------------------------------------------


def vocab_range_for(tokenizer: Any = None, model_vocab_size: int | None = None) -> tuple[int, int]:
    """[low, high) ids safe to use as random prompt tokens.

    `tokenizer.vocab_size` is the base vocabulary (added special tokens such as
    Qwen's <|im_start|> sit above it), and the model's embedding size bounds it too.
    """
    highs = []
    if tokenizer is not None and getattr(tokenizer, "vocab_size", None):
        highs.append(int(tokenizer.vocab_size))
    if model_vocab_size:
        highs.append(int(model_vocab_size))
    if not highs:
        raise ValueError("need a tokenizer or the model's vocab size to pick prompt token ids")
    high = min(highs)
    low = MIN_TOKEN_ID if high > MIN_TOKEN_ID + 1 else 0
    if tokenizer is not None:
        # Skip a contiguous run of special ids at the bottom of the vocab (bos/eos/pad...).
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        while low in specials and low + 1 < high:
            low += 1
    return low, high


def vocab_range_for_model(model_dir: str | Path) -> tuple[int, int]:
    """Vocab range of a local HF model directory (config.json + tokenizer if present)."""
    model_dir = Path(model_dir)
    cfg_vocab = None
    cfg = model_dir / "config.json"
    if cfg.exists():
        cfg_vocab = json.loads(cfg.read_text()).get("vocab_size")
    tok = None
    if any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception:  # a tokenizer we cannot load must not stop a benchmark using ids
            tok = None
    return vocab_range_for(tok, cfg_vocab)


# ---------------------------------------------------------------------------
# argparse
# ---------------------------------------------------------------------------


def parse_range(text: str | int) -> tuple[int, int]:
    """'32:256' -> (32, 256); '128' -> (128, 128)."""
    if isinstance(text, int):
        return text, text
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            v = int(parts[0])
            return v, v
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}")


def parse_rate(text: str) -> float:
    if str(text).lower() in ("inf", "infinity", "none"):
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests/s or 'inf', got {text!r}") from None


def add_workload_args(parser: argparse.ArgumentParser, *, num_prompts: int = 64,
                      input_len: str = "64:256", output_len: str = "32:128") -> argparse.ArgumentParser:
    """Add the workload flags.  `--seed` is added only if the parser lacks one (the
    engine flags bring their own; both then share it)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default="random", choices=WORKLOADS, help="request mix (default: random)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help=f"number of requests (default: {num_prompts})")
    g.add_argument("--input-len", type=parse_range, default=parse_range(input_len), metavar="MIN:MAX",
                   help=f"prompt length range, or the suffix length for 'prefix' (default: {input_len})")
    g.add_argument("--output-len", type=parse_range, default=parse_range(output_len), metavar="MIN:MAX",
                   help=f"generated tokens per request (default: {output_len})")
    g.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="requests/s; 'inf' sends everything at t=0 (default: inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps; 1 = Poisson (default: 1)")
    g.add_argument("--long-fraction", type=float, default=0.1, help="mixed-long: share of long prompts (default: 0.1)")
    g.add_argument("--long-len", type=int, default=1024, help="mixed-long: long prompt length (default: 1024)")
    g.add_argument("--num-prefix-groups", type=int, default=4, help="prefix: number of shared prefixes (default: 4)")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix: shared prefix length (default: 256)")
    g.add_argument("--respect-eos", action="store_true",
                   help="stop at EOS instead of forcing exactly the requested output length")
    g.add_argument("--save-workload", default=None, metavar="FILE.jsonl", help="also write the requests to FILE")
    g.add_argument("--load-workload", default=None, metavar="FILE.jsonl",
                   help="replay requests from FILE instead of generating them")
    if "--seed" not in parser._option_string_actions:
        g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    return parser


def spec_from_args(args: argparse.Namespace, vocab_range: tuple[int, int],
                   max_model_len: int | None = None) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed if getattr(args, "seed", None) is not None else 0,
        vocab_range=vocab_range,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        long_fraction=args.long_fraction,
        long_len=args.long_len,
        num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len,
        respect_eos=args.respect_eos,
        max_model_len=max_model_len,
    )


def workload_from_args(args: argparse.Namespace, vocab_range: tuple[int, int],
                       max_model_len: int | None = None) -> tuple[WorkloadSpec, list[BenchRequest]]:
    """Build (spec, requests) from parsed flags; honors --load-workload / --save-workload."""
    spec = spec_from_args(args, vocab_range, max_model_len)
    if getattr(args, "load_workload", None):
        reqs = load_jsonl(args.load_workload)
    else:
        reqs = generate_workload(spec)
    if getattr(args, "save_workload", None):
        save_jsonl(reqs, args.save_workload)
    return spec, reqs
