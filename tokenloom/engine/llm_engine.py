"""LLMEngine: add requests, step, get outputs — the seed's decode loop, for many requests.

One call to `step()` is one iteration of continuous batching:

    schedule (who runs, how many tokens each)  ->  one forward pass + sampling
    ->  append tokens, detokenize, stop checks  ->  StepEvent to observers

Requests join (`add_request`) and leave (finish, `abort_request`) between steps.
The engine knows nothing about HTTP; the async server wraps it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from tokenloom.config import EngineArgs, SchedulerConfig, default_max_num_batched_tokens, parse_size
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.events import StepEvent
from tokenloom.model.loader import (load_config, load_eos_token_ids, load_model, resolve_device,
                                    resolve_model_path)
from tokenloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.runner.model_runner import ModelRunner, kv_bytes_per_block
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger("tokenloom")

PromptType = str | list[int] | dict


class PromptTooLongError(ValueError):
    """The prompt (plus requested output) does not fit in max_model_len."""

    param = "prompt"


@dataclass
class _Sample:
    """One of the n samples of a request: a scheduler Request plus its text state."""

    req: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass
class _Group:
    """A user request: n samples sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    pending: list[Request]  # samples 1..n-1 held back until sample 0 has filled the prefix cache
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    import psutil

    # A quarter of what is free, at most 4 GiB: enough for long contexts on the small
    # models a CPU serves, while leaving room for activations and the rest of the machine.
    return min(int(psutil.virtual_memory().available * 0.25), 4 * 2**30)


class LLMEngine:
    def __init__(self, args: EngineArgs, observers: Iterable[Callable[[StepEvent], None]] = ()):
        self.args = args
        if args.model is None:
            from tokenloom.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_NAME

            path = BUNDLED_MODEL_DIR
            self.model_name = BUNDLED_MODEL_NAME
        else:
            path = resolve_model_path(args.model, args.revision)
            self.model_name = args.model
        self.model_path = path
        self.device = resolve_device(args.device)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)

        cfg = load_config(path)
        self.hf_config = cfg
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        max_model_len = args.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({max_pos}); lower it"
            )
        self.max_model_len = max_model_len

        self.loaded = load_model(path, args.dtype, self.device, max_positions=max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or path), revision=args.revision)
        if args.chat_template:
            tpl = args.chat_template
            if os.path.exists(tpl):
                with open(tpl) as f:
                    tpl = f.read()
            self.tokenizer.chat_template = tpl
        self.eos_token_ids = load_eos_token_ids(path, cfg, self.tokenizer)
        self.vocab_size = self.loaded.args.vocab_size

        block_size = args.block_size
        if block_size < 1:
            raise ValueError("--block-size must be >= 1")
        per_block = kv_bytes_per_block(self.loaded, block_size)
        if args.num_kv_blocks is not None:
            num_blocks = args.num_kv_blocks
        else:
            if args.kv_cache_memory is not None:
                num_blocks = parse_size(args.kv_cache_memory) // per_block
            else:
                # Never more than max_num_seqs full-length requests can use: small models stay small.
                useful = args.max_num_seqs * -(-max_model_len // block_size)
                num_blocks = min(_default_kv_bytes(self.device) // per_block, useful)
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one request of "
                f"--max-model-len {max_model_len} tokens; raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len"
            )
        mnbt = args.max_num_batched_tokens or default_max_num_batched_tokens(max_model_len, args.enable_chunked_prefill)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=mnbt,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
        )
        self.kv = KVCacheManager(num_blocks, block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = ModelRunner(self.loaded, num_blocks, block_size, compile=args.compile)
        self.groups: dict[str, _Group] = {}
        self._children: dict[str, tuple[_Group, _Sample]] = {}
        self.observers: list[Callable[[StepEvent], None]] = list(observers)
        self.step_count = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, observers: Iterable[Callable[[StepEvent], None]] = ()) -> "LLMEngine":
        return cls(args, observers)

    # ---- observers ----------------------------------------------------
    def add_observer(self, fn: Callable[[StepEvent], None]) -> None:
        self.observers.append(fn)

    def remove_observer(self, fn: Callable[[StepEvent], None]) -> None:
        self.observers.remove(fn)

    # ---- requests -----------------------------------------------------
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Turn a prompt (text, token ids, or {"prompt"|"prompt_token_ids": ...}) into ids; validate."""
        text: str | None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is out of range for a vocabulary of {self.vocab_size}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but this model's max_model_len is {self.max_model_len} "
                f"(the prompt must be shorter, leaving room for at least one generated token)"
            )
        return text, ids

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        """max_tokens made concrete; raises PromptTooLongError if prompt + max_tokens > max_model_len."""
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise PromptTooLongError(
                f"this model's max_model_len is {self.max_model_len} tokens, but {prompt_len + params.max_tokens} "
                f"were requested ({prompt_len} in the prompt, {params.max_tokens} in max_tokens); "
                f"lower max_tokens or shorten the prompt"
            )
        return params.max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.groups or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt)
        params.check_vocab(self.vocab_size)
        max_tokens = self.resolve_max_tokens(params, len(ids))
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        samples: list[_Sample] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            if params.n > 1 and rid in self._children:
                raise ValueError(f"request id {request_id!r} collides with the samples of another request")
            req = Request(
                request_id=rid,
                prompt_token_ids=ids,
                sampling_params=child_params,
                arrival_time=arrival,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                priority=priority,
                cache_salt=cache_salt,
            )
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            samples.append(_Sample(req, detok, [] if params.logprobs is not None else None))
        group = _Group(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params, samples=samples,
            pending=[], metrics=RequestMetrics(arrival_time=arrival),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        # With prefix caching, samples 1..n-1 wait until sample 0 has computed the prompt,
        # then reuse its full KV blocks instead of recomputing them.
        first, rest = samples[:1], samples[1:]
        if self.kv.enable_prefix_caching:
            group.pending = [s.req for s in rest]
        else:
            first = samples
        self.groups[request_id] = group
        for s in samples:
            self._children[s.req.request_id] = (group, s)
        for s in first:
            self.scheduler.add_request(s.req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            g = self.groups.pop(rid, None)
            if g is None:
                continue
            for s in g.samples:
                self.scheduler.finish_request(s.req.request_id, RequestStatus.FINISHED_ABORTED)
                s.req.status = RequestStatus.FINISHED_ABORTED
                self.runner.remove_request(s.req.request_id)
                self._children.pop(s.req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + sum(len(g.pending) for g in self.groups.values())

    def kv_cache_usage(self) -> float:
        return self.kv.usage()

    # ---- the step -----------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine iteration.  Returns cumulative outputs of the requests that progressed
        (only the finished ones with finished_only=True: offline callers skip building
        per-step snapshots nobody reads)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        res = self.runner.execute(out)
        now = time.perf_counter()
        self.scheduler.update_from_output(out, res.sampled, now)
        touched: dict[str, _Group] = {}
        for s in out.scheduled:
            found = self._children.get(s.request_id)
            if found is None:
                continue
            g, sample = found
            touched[g.request_id] = g
            if g.metrics.first_scheduled_time is None:
                g.metrics.first_scheduled_time = start
            if s.request_id in res.prompt_logprobs and g.prompt_logprobs is not None and s.request is g.samples[0].req:
                for pos, lp, rank, top in res.prompt_logprobs[s.request_id]:
                    if pos != len(g.prompt_logprobs):  # already have it (recompute after preemption)
                        continue
                    g.prompt_logprobs.append(self._logprob_dict(g.prompt_token_ids[len(g.prompt_logprobs)], lp, rank, top))
            if s.request_id not in res.sampled:
                continue
            tok = res.sampled[s.request_id]
            if g.metrics.first_token_time is None:
                g.metrics.first_token_time = now
            g.metrics.last_token_time = now
            if sample.logprobs is not None and s.request_id in res.logprobs:
                lp, rank, top = res.logprobs[s.request_id]
                sample.logprobs.append(self._logprob_dict(tok, lp, rank, top))
                sample.cumulative_logprob += lp
            stop_str = sample.detok.add(tok) if g.params.detokenize else None
            req = s.request
            if stop_str is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_str)
                req.finished_time = now
            if req.is_finished:
                sample.detok.flush()
                self.runner.remove_request(req.request_id)
            if g.pending and s.request is g.samples[0].req:
                for p in g.pending:  # the prompt's blocks are cached now: let the siblings in
                    self.scheduler.add_request(p)
                g.pending = []
        outputs = []
        for g in touched.values():
            g.finished = all(x.req.is_finished for x in g.samples)
            if g.finished:
                g.metrics.finished_time = now
                g.metrics.num_preemptions = sum(x.req.num_preemptions for x in g.samples)
                self.groups.pop(g.request_id, None)
                for x in g.samples:
                    self._children.pop(x.req.request_id, None)
            if g.finished or not finished_only:
                outputs.append(self._make_output(g))
        self.step_count += 1
        if self.observers:
            event = self.scheduler.make_event(out, res.sampled, start, time.perf_counter(), res.model_time)
            for fn in self.observers:
                fn(event)
        return outputs

    def _logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        d = {t: Logprob(v, i + 1, self.tokenizer.decode([t])) for i, (t, v) in enumerate(top)}
        if tok not in d:
            d = {tok: Logprob(lp, rank, self.tokenizer.decode([tok])), **d}
        return d

    def _make_output(self, g: _Group) -> RequestOutput:
        comps = []
        for i, s in enumerate(g.samples):
            r = s.req
            comps.append(CompletionOutput(
                index=i,
                text=s.detok.visible_text(r.is_finished),
                token_ids=list(r.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=r.status.value if r.is_finished else None,
                stop_reason=r.stop_reason,
            ))
        return RequestOutput(
            request_id=g.request_id,
            prompt=g.prompt,
            prompt_token_ids=g.prompt_token_ids,
            prompt_logprobs=list(g.prompt_logprobs) if g.prompt_logprobs is not None else None,
            outputs=comps,
            finished=g.finished,
            metrics=copy.copy(g.metrics),
            num_cached_tokens=max(g.samples[0].req.num_cached_tokens, 0),
        )
