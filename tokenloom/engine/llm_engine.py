"""LLMEngine: add requests, step, get outputs — the seed's decode loop, for many requests.

One call to `step()` is one iteration of continuous batching:

    schedule (who runs, how many tokens each)  ->  one forward pass + sampling
    ->  append tokens (Scheduler)  ->  detokenize, stop strings: decisions (OutputProcessor)
    ->  the engine applies them (Scheduler, runner)  ->  outputs (OutputProcessor)
    ->  StepEvent to observers

Output processing never calls the scheduler: it returns `Decisions` (which samples end and
why, trailing tokens to drop, siblings to admit, runner state to release) and `_apply`
carries them out, so state flows one way: scheduler -> processor -> engine -> scheduler.

With async scheduling (`--async-scheduling`) the next step is scheduled and launched from
this step's tokens on the device before the host reads them (core/lookahead.py); each call
still completes one step, and a token computed for a request that ended meanwhile is dropped.

Requests join (`add_request`) and leave (finish, `abort_request`) between steps.  Besides
sampling (`SamplingParams`), a request may embed its prompt (`PoolingParams`, an engine
run with `--runner pooling`: prefill only, the runner pools the hidden states) or search
beams (`BeamSearchParams`: engine/beam_search.py over beams that share KV blocks).
The engine knows nothing about HTTP; the async server wraps it.

Failures are contained (docs/reliability.md lists the guarantees):
  - a failure in one request's output processing fails that request alone;
  - a failure the runner attributes to one request (an exception with a `request_id`
    attribute naming it, e.g. from its sampling parameters) fails that request alone, and
    the step is dropped for the others: they are scheduled again from the same
    num_computed_tokens and recompute the same tokens (their KV slots are rewritten with the
    same values; only a seeded sampler whose generator had already advanced would differ);
  - any other failure of the forward pass fails the requests of that step only -- their KV
    blocks are freed, waiting requests are untouched -- and counts towards
    `consecutive_failed_steps`; the device is probed, and `device_error` says if it is broken;
  - an observer that raises is logged and detached; it never fails a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import weakref
from typing import Callable, Iterable

import torch

from tokenloom.config import (EngineArgs, EngineConfig, LoRAConfig, ModelShape, resolve_max_model_len,
                              resolve_runner)
from tokenloom.core.events import StepEvent
from tokenloom.core.kv_cache import KVCacheManager
from tokenloom.core.lookahead import schedule_ahead
from tokenloom.core.scheduler import Scheduler, SchedulerOutput
from tokenloom.engine.beam_search import Fork
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.faults import FaultInjector
from tokenloom.engine.output_processor import Decisions, Group, OutputProcessor, Sample, failure_message
from tokenloom.engine.request_kinds import beam_search_group, check_beam_search, embedding_group
from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.backends import plan_for_args
from tokenloom.model.weights.formats import describe_prequantized
from tokenloom.model.weights.loader import (load_config, load_eos_token_ids, load_model, load_tokenizer,
                                            resolve_device, resolve_dtype, resolve_model_path)
from tokenloom.model.lora import LoRAAdapter, LoRASlots
from tokenloom.model.pooling_config import PoolingConfig, read_pooling_config
from tokenloom.model.registry import is_headless, resolve_architecture
from tokenloom.model.weights.peft_lora import load_peft_adapter
from tokenloom.outputs import EmbeddingRequestOutput, RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import LoRARequest, Request, RequestStatus
from tokenloom.runner.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from tokenloom.runner.tp_worker import TPLauncher, launched_by_torchrun, run_worker, worker_spec
from tokenloom.model.weights.parallel import check_split
from tokenloom.sampling_params import BeamSearchParams, SamplingParamError, SamplingParams
from tokenloom.spec_decode.config import SpeculativeConfig
from tokenloom.spec_decode.proposer import SpecProposer
from tokenloom.structured import GrammarCompiler, gate_grammar

logger = logging.getLogger("tokenloom")

PromptType = str | list[int] | dict


class PromptTooLongError(ValueError):
    """The prompt (plus requested output) does not fit in max_model_len.  The numbers travel
    with the message, so a server can word it as its clients expect (OpenAI's phrasing)."""

    param = "prompt"

    def __init__(self, message: str, *, prompt_tokens: int, max_model_len: int, max_tokens: int | None = None):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens  # None: the prompt alone does not fit


class LLMEngine:
    def __init__(self, args: EngineArgs, observers: Iterable[Callable[[StepEvent], None]] = ()):
        self.args = args
        # checked before anything loads: a bad speculative_config is a quick, clear error
        self.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        self.lora_config = LoRAConfig.from_args(args)  # --enable-lora: adapter slots (same: checked first)
        # loaded adapters by id: what requests run with (`add_lora`, or loaded on first use)
        self.loras: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}
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
        # what this engine runs: "generate" (sampled tokens) or "pooling" (embeddings)
        self.runner_type = resolve_runner(args.runner, args.task, is_headless(cfg))
        shape = ModelShape.from_fields(model_args_fields(cfg, resolve_architecture(cfg)))
        max_positions = resolve_max_model_len(args.max_model_len, shape.max_position_embeddings)
        # which code runs here, decided once before anything loads (model/backends.py)
        self.backends = plan_for_args(args, self.device, resolve_dtype(args.dtype, cfg, self.device),
                                      model_args_fields(cfg, resolve_architecture(cfg)),
                                      prequantized=describe_prequantized(cfg))
        self.tp_launcher = None
        if args.tensor_parallel_size > 1:  # ranks 1..N-1 load their shards meanwhile (runner/tp_worker.py)
            f = model_args_fields(cfg, resolve_architecture(cfg))
            check_split(f["num_heads"], f["num_kv_heads"], f["intermediate_size"], args.tensor_parallel_size,
                        f["moe_intermediate_size"], f["shared_expert_intermediate_size"])
            if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
                # Under torchrun every rank runs the same command; all but rank 0 become workers
                # here and leave when rank 0 shuts the group down.
                run_worker(int(os.environ["RANK"]), args.tensor_parallel_size, "env://",
                           worker_spec(args, path, self.device, max_positions, self.backends))
                raise SystemExit(0)
            self.tp_launcher = TPLauncher(args.tensor_parallel_size,
                                          worker_spec(args, path, self.device, max_positions, self.backends),
                                          args.distributed_init_port)
            weakref.finalize(self, self.tp_launcher.shutdown)
        tp = self.tp_launcher.group if self.tp_launcher else None
        try:
            self._build(args, path, cfg, shape, max_positions, tp, observers)
        except BaseException:
            if self.tp_launcher:
                self.tp_launcher.abort()
            raise

    def _build(self, args: EngineArgs, path, cfg: dict, shape: ModelShape, max_positions: int, tp,
               observers) -> None:
        """Everything after the tensor-parallel group exists: the model, the config, the runner."""
        self.loaded = load_model(path, args.dtype, self.device, max_positions=max_positions, tp=tp, plan=self.backends)
        device = self.device
        lora_slots = None
        if self.lora_config is not None:  # allocated before the KV cache is sized from what memory is left
            lc = self.lora_config
            lora_slots = LoRASlots(self.loaded.args, lc.max_loras, lc.max_lora_rank, self.loaded.dtype, device)
        # Every default decided once (config.py); on CUDA the KV cache takes what the weights left free.
        self.config = EngineConfig.resolve(
            args, shape, model=str(path), model_name=str(self.model_name), device=str(device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            free_memory_bytes=lambda: torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None,
            backends=self.backends)
        c = self.config
        self.max_model_len = c.max_model_len
        self.scheduler_config = c.scheduler

        self.tokenizer = load_tokenizer(c.tokenizer, revision=c.revision)  # a GGUF file's from its metadata
        if c.chat_template:
            tpl = c.chat_template
            if os.path.exists(tpl):
                with open(tpl) as f:
                    tpl = f.read()
            self.tokenizer.chat_template = tpl
        self.eos_token_ids = load_eos_token_ids(path, cfg, self.tokenizer)
        self.vocab_size = self.loaded.args.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)  # structured output

        self.kv = KVCacheManager(c.num_kv_blocks, c.block_size, c.enable_prefix_caching,
                                 regime_split=c.scheduler.recompute_past)
        self.scheduler = Scheduler(c.scheduler, self.kv)
        # how embedding requests pool (the model's sentence-transformers files): rank 0 pools alone
        self.pooling_config: PoolingConfig | None = None
        if self.runner_type == "pooling":
            self.pooling_config = read_pooling_config(path, cfg, self.loaded.args.hidden_size)
        runner_kwargs = dict(plan=self.backends, max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len)
        if self.speculative_config:  # decodes with drafts are 1 + k rows each while speculation is on
            sc = self.speculative_config
            runner_kwargs["draft_rows"] = min(c.max_num_seqs, sc.disable_by_batch_size) * sc.num_speculative_tokens
        if self.tp_launcher:
            self.tp_launcher.send_runner_spec(c.num_kv_blocks, c.block_size, **runner_kwargs)
        self.runner = ModelRunner(self.loaded, c.num_kv_blocks, c.block_size, tp=tp, pooling=self.pooling_config,
                                  lora_slots=lora_slots,
                                  **runner_kwargs)
        self.processor = OutputProcessor(self.tokenizer)
        self.paused_requests: set[str] = set()  # ids of requests out of the schedule (pause_request)
        # n-gram drafts set on running requests before each schedule() (spec_decode/proposer.py)
        self.proposer = SpecProposer(self.speculative_config) if self.speculative_config else None
        self.observers: list[Callable[[StepEvent], None]] = list(observers)
        self.step_count = 0
        logger.info("%s", self.summary())
        self.consecutive_failed_steps = 0  # forward passes that failed in a row (reset by a good one)
        self.num_failed_steps = 0
        self.device_error: str | None = None  # set when the device probe fails after a failed step
        self.faults = FaultInjector.from_env()
        # async scheduling: the step launched ahead, whose results the next step() collects
        self.async_scheduling = bool(args.async_scheduling)
        self._ahead: tuple[LaunchedStep, float] | None = None
        self.num_steps_ahead = 0  # steps launched before the previous one's tokens reached the host
        if self.async_scheduling:
            self.runner.sync_model_time = False

    def shutdown(self) -> None:
        """Release what outlives a step: the tensor-parallel workers (idempotent)."""
        if self.tp_launcher is not None:
            self.tp_launcher.shutdown()

    @property
    def faults(self) -> FaultInjector | None:
        """The test-only fault injector (engine/faults.py); None in normal use."""
        return self._faults

    @faults.setter
    def faults(self, injector: FaultInjector | None) -> None:
        self._faults = injector
        self.processor.faults = injector

    @property
    def groups(self) -> dict[str, Group]:
        """Unfinished requests by id."""
        return self.processor.groups

    def summary(self) -> str:
        """What is being served, in one line (printed at start-up)."""
        a, kv = self.loaded, self.kv
        dtype = str(a.dtype).removeprefix("torch.")
        gib = self.runner.kv_cache_bytes / 2**30
        task = f"embeddings by {self.pooling_config.describe()}" if self.pooling_config else "generation"
        return (f"serving {a.path} ({a.args.architecture}, {a.args.num_layers} layers) for {task} in {dtype} on "
                f"{self.device}; "
                f"KV cache {kv.num_blocks} blocks x {self.runner.block_size} tokens ({gib:.2f} GiB), "
                f"max_model_len {self.max_model_len}, max_num_seqs {self.scheduler_config.max_num_seqs}, "
                f"max_num_batched_tokens {self.scheduler_config.max_num_batched_tokens}; {self.runner.describe()}")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, observers: Iterable[Callable[[StepEvent], None]] = ()) -> "LLMEngine":
        return cls(args, observers)

    # ---- observers ----------------------------------------------------
    def add_observer(self, fn: Callable[[StepEvent], None]) -> None:
        self.observers.append(fn)

    def remove_observer(self, fn: Callable[[StepEvent], None]) -> None:
        self.observers.remove(fn)

    # ---- LoRA adapters ------------------------------------------------
    def load_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter `lora_request` names, for this model (touches no engine
        state: a server runs it off the engine thread).  FileNotFoundError: no adapter at its
        path; ValueError: one this engine cannot run (the message names the setting)."""
        if self.lora_config is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        return load_peft_adapter(lora_request.lora_path, self.loaded.args, self.lora_config.max_lora_rank,
                                 self.loaded.dtype, name=lora_request.lora_name)

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Make an adapter available to requests (`adapter`: already read by `load_lora`).
        False if its id is loaded already; ValueError if that id is another adapter's."""
        held = self.loras.get(lora_request.lora_int_id)
        if held is not None:
            self._check_same(held[0], lora_request)
            return False
        if adapter is None:
            adapter = self.load_lora(lora_request)
        self.loras[lora_request.lora_int_id] = (lora_request, adapter)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: new requests cannot use it; running ones finish with it (they
        hold its weights).  False if it was not loaded."""
        return self.loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)

    @staticmethod
    def _check_same(held: LoRARequest, asked: LoRARequest) -> None:
        if held.lora_path != asked.lora_path:
            raise ValueError(f"lora_int_id {asked.lora_int_id} is already adapter {held.lora_name!r} from "
                             f"{held.lora_path!r}; one id must always name one adapter (give {asked.lora_path!r} "
                             f"another id)")

    def _adapter_for(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The weights a request on `lora_request` runs with, read now if not loaded yet;
        ValueError without --enable-lora."""
        if lora_request is None:
            return None
        if self.lora_config is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True (--enable-lora)")
        held = self.loras.get(lora_request.lora_int_id)
        if held is None:
            self.add_lora(lora_request)
            held = self.loras[lora_request.lora_int_id]
        self._check_same(held[0], lora_request)
        return held[1]

    # ---- requests -----------------------------------------------------
    def process_prompt(self, prompt: PromptType, room: int = 1) -> tuple[str | None, list[int]]:
        """Turn a prompt (text, token ids, or {"prompt"|"prompt_token_ids": ...}) into ids; validate.
        `room`: tokens that must fit after it (0 for an embedding, which generates none)."""
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
        if len(ids) + room > self.max_model_len:
            why = " (the prompt must be shorter, leaving room for at least one generated token)" if room else ""
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but this model's max_model_len is {self.max_model_len}{why}",
                prompt_tokens=len(ids), max_model_len=self.max_model_len)
        return text, ids

    def validate(self, prompt: PromptType,
                 params: SamplingParams | BeamSearchParams | PoolingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt with its parameters as `add_request` will, changing no
        state: ValueError (PromptTooLongError, SamplingParamError naming the field) if refused."""
        if isinstance(params, PoolingParams):
            self._check_runner("pooling")
            if self.pooling_config is not None:
                try:
                    self.pooling_config.check_dimensions(params.dimensions)
                except ValueError as e:
                    raise SamplingParamError("dimensions", str(e).removeprefix("dimensions: ")) from None
            return self.process_prompt(prompt, room=0)
        self._check_runner("generate")
        text, ids = self.process_prompt(prompt)
        if isinstance(params, BeamSearchParams):
            self._check_beams(params, len(ids))
        else:
            params.check_vocab(self.vocab_size)
            self.resolve_max_tokens(params, len(ids))
        return text, ids

    def _check_runner(self, wanted: str) -> None:
        if self.runner_type != wanted:
            what = "embed (PoolingParams)" if wanted == "pooling" else "generate"
            raise ValueError(f"this engine runs --runner {self.runner_type}: it cannot {what}; start it with "
                             f"--runner {wanted}")

    def _check_beams(self, params: BeamSearchParams, prompt_len: int) -> int:
        """Whether a beam search fits this engine; its max_tokens made concrete."""
        max_tokens = self.resolve_max_tokens(SamplingParams(max_tokens=params.max_tokens), prompt_len)
        check_beam_search(params, prompt_len, max_tokens, eos_token_ids=self.eos_token_ids,
                          vocab_size=self.vocab_size, num_seats=self.scheduler.num_seats,
                          num_blocks=self.kv.num_blocks, block_size=self.kv.block_size)
        return max_tokens

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        """max_tokens made concrete; raises PromptTooLongError if prompt + max_tokens > max_model_len."""
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise PromptTooLongError(
                f"this model's max_model_len is {self.max_model_len} tokens, but {prompt_len + params.max_tokens} "
                f"were requested ({prompt_len} in the prompt, {params.max_tokens} in max_tokens); "
                f"lower max_tokens or shorten the prompt",
                prompt_tokens=prompt_len, max_model_len=self.max_model_len, max_tokens=params.max_tokens)
        return params.max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        lora_adapter: LoRAAdapter | None = None,
    ) -> None:
        """Queue a request; with `lora_request` it runs with that adapter: `lora_adapter`, its
        weights as the caller holds them (a server takes them when it admits the request, so an
        unload meanwhile does not fail it), else the loaded ones (read now if not loaded yet)."""
        params = params or SamplingParams()
        if self.processor.owns(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.validate(prompt, params)
        adapter = self._adapter_for(lora_request) if lora_adapter is None else lora_adapter
        lora = dict(lora_request=lora_request, lora_adapter=adapter) if lora_request is not None else {}
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams):
            return self._add_embedding(request_id, text, ids, params, arrival, priority, cache_salt, lora)
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(request_id, text, ids, params, arrival, priority, cache_salt, lora)
        max_tokens = self.resolve_max_tokens(params, len(ids))
        samples: list[Sample] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            if params.n > 1 and self.processor.owns(rid):
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
                # with reasoning tags, the grammar holds only the answer after the thinking
                grammar=gate_grammar(self.grammars.new_state(params.structured_outputs), params.reasoning_tags, ids)
                if params.structured_outputs else None,
                **lora,
            )
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            samples.append(Sample(req, detok, [] if params.logprobs is not None else None))
        group = Group(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params, samples=samples,
            pending=[], arrival_time=arrival,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        # With prefix caching, samples 1..n-1 wait until sample 0 has computed the prompt,
        # then reuse its full KV blocks instead of recomputing them.
        first, rest = samples[:1], samples[1:]
        if self.kv.enable_prefix_caching:
            group.pending = [s.req for s in rest]
        else:
            first = samples
        self.processor.add(group)
        for s in first:
            self.scheduler.add_request(s.req)

    def _add_embedding(self, request_id: str, text: str | None, ids: list[int], params: PoolingParams,
                       arrival: float, priority: int, cache_salt: str | None, lora: dict) -> None:
        """An embedding request: its prompt is computed (chunked like any prefill) and pooled
        (`lora`: its LoRA adapter's Request fields, if any)."""
        group = embedding_group(request_id, text, ids, params, arrival, priority, cache_salt, **lora)
        self.processor.add(group)
        self.scheduler.add_request(group.samples[0].req)

    def _add_beam_search(self, request_id: str, text: str | None, ids: list[int], params: BeamSearchParams,
                         arrival: float, priority: int, cache_salt: str | None, lora: dict) -> None:
        """A beam search: one beam computes the prompt, then forks into `beam_width` beams."""
        max_tokens = self._check_beams(params, len(ids))
        for i in range(params.beam_width):
            if self.processor.owns(f"{request_id}-beam{i}"):
                raise ValueError(f"request id {request_id!r} collides with the beams of another request")
        group = beam_search_group(request_id, text, ids, params, max_tokens, self.eos_token_ids, arrival, priority,
                                  cache_salt, **lora)
        self.processor.add(group)
        self.scheduler.add_request(group.samples[0].req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End requests now (no output); their KV blocks go back to the pool."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            decisions = self.processor.abort(rid)
            if decisions is not None:
                self._apply(decisions, None)

    def pause_request(self, request_id: str) -> bool:
        """Stop computing a request without ending it -- its client is not reading what it
        produces.  Its sequences leave the batch (their seats go to others), keep their KV
        blocks unless memory runs short (then they recompute when resumed) and produce
        nothing until `resume_request`.  False if the request is unknown or finished."""
        g = self.groups.get(request_id)
        if g is None:
            return False
        for s in g.samples:
            self.scheduler.pause_request(s.req.request_id)
        # Samples still held back for the prefix cache (`g.pending`) enter the scheduler only
        # after sample 0 computed the prompt, which a paused sample 0 does not do.
        self.paused_requests.add(request_id)
        return True

    def resume_request(self, request_id: str) -> bool:
        """Put a paused request back in the schedule; False if it was not paused."""
        if request_id not in self.paused_requests:
            return False
        self.paused_requests.discard(request_id)
        g = self.groups.get(request_id)
        if g is None:
            return False
        for s in g.samples:
            self.scheduler.resume_request(s.req.request_id)
        return True

    @property
    def num_paused(self) -> int:
        """Sequences paused (out of the batch, KV kept unless memory ran short)."""
        return self.scheduler.num_paused

    def has_schedulable_requests(self) -> bool:
        """Whether a step can do anything: unfinished requests that are not all paused.
        (A server with only paused requests waits for a command instead of stepping.)"""
        if not self.groups:
            return False
        self.paused_requests &= self.groups.keys()  # ended while paused (aborted, failed)
        return not self.paused_requests or self.scheduler.has_schedulable()

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
    def step(self, finished_only: bool = False) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine iteration.  Returns cumulative outputs of the requests that progressed
        (only the finished ones with finished_only=True: offline callers skip building
        per-step snapshots nobody reads).  A request that failed in this step comes back
        finished, with `error` set and finish_reason "error".

        With async scheduling each call still completes one step, but first launches the
        next one (core/lookahead.py) so the device has it queued while the host processes
        this one; the next call collects it."""
        if self.async_scheduling:
            return self._step_overlapped(finished_only)
        start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        out = self.scheduler.schedule(now=start)
        if out.is_empty:
            return []
        try:
            res = self._execute(out)
        except Exception as e:
            return self._failed_step(out, e)
        return self._complete(out, res, start, finished_only)

    def _complete(self, out: SchedulerOutput, res: RunnerOutput, start: float,
                  finished_only: bool) -> list[RequestOutput]:
        """A step's results in: tokens appended, outputs processed, decisions applied."""
        self.consecutive_failed_steps = 0
        now = time.perf_counter()
        self.scheduler.update_from_output(out, res.sampled, now, res.accepted)
        processed = self.processor.process(out, res, now)
        self._apply(processed.decisions, now)
        outputs, late = self.processor.outputs(processed, now, finished_only)
        self._apply(late, now)
        self.step_count += 1
        if self.observers:
            self._notify(out, res, start)
        return outputs

    def _step_overlapped(self, finished_only: bool) -> list[RequestOutput]:
        """`step` with async scheduling: collect the step launched ahead (or schedule and
        launch one now), launch the one after it from its tokens on the device, then
        process it.  The host waits for the device only in `collect`."""
        current, self._ahead = self._ahead, None
        if current is not None and all(s.request.is_finished for s in current[0].out.scheduled):
            current = None  # every request in it ended meanwhile: nothing of it is kept
        if current is None:
            start = time.perf_counter()
            if self.proposer is not None:  # a step scheduled now drafts as without async scheduling
                self.proposer.propose(self.scheduler.running)
            out = self.scheduler.schedule(now=start)
            if out.is_empty:
                return []
            try:
                current = (self._launch(out, None), start)
            except Exception as e:
                return self._failed_step(out, e)
        launched, start = current
        out = launched.out
        # No step ahead where the next step would draft: its drafts need this step's tokens, and a
        # step launched without them would give up the speculation (same tokens, fewer per step).
        # The next step's batch: the running requests this step's token does not end by length.
        drafts_next = self.proposer is not None and self.proposer.active(
            sum(r.num_output_tokens + 1 < r.max_tokens for r in self.scheduler.running))
        ahead = schedule_ahead(self.scheduler, out) if self._faults is None and not drafts_next else None
        if ahead is not None:
            t = time.perf_counter()
            try:
                self._ahead = (self._launch(ahead, launched), t)
                self.num_steps_ahead += 1
            except Exception:  # scheduled again normally after this step, where failures are contained
                logger.debug("launching step %d ahead failed; it runs after step %d instead", ahead.step, out.step,
                             exc_info=True)
        try:
            res = self.runner.collect(launched)
        except Exception as e:
            self._ahead = None  # it read this step's tokens
            return self._failed_step(out, e)
        self._drop_ended(out, res)
        return self._complete(out, res, start, finished_only)

    def _launch(self, out: SchedulerOutput, feed: LaunchedStep | None) -> LaunchedStep:
        if self._faults is not None:
            self._check_faults(out)
        return self.runner.launch(out, feed)

    @staticmethod
    def _drop_ended(out: SchedulerOutput, res: RunnerOutput) -> None:
        """Async scheduling: a request that ended after this step was launched (its previous
        token was EOS or completed a stop string, or it was aborted) loses what the step
        computed for it -- that token is never appended, never seen."""
        if all(not s.request.is_finished for s in out.scheduled):
            return
        keep = []
        for s in out.scheduled:
            if s.request.is_finished:
                res.sampled.pop(s.request_id, None)
                res.logprobs.pop(s.request_id, None)
            else:
                keep.append(s)
        out.scheduled = keep

    def _apply(self, d: Decisions, now: float | None) -> None:
        """Carry out what output processing decided (the only place its decisions reach the
        scheduler and the runner): siblings enter, ended samples leave (blocks freed; a
        sibling never handed to the scheduler just takes the status), runner state goes."""
        for req in d.admit:
            self.scheduler.add_request(req)
        for f in d.finish:
            if f.drop_tokens:
                del f.request.output_token_ids[-f.drop_tokens:]
            if self.scheduler.finish_request(f.request.request_id, f.status, f.stop_reason, now=now) is None:
                f.request.status = f.status
        for rid in d.release:
            self.runner.remove_request(rid)
        for move in d.beams:
            if isinstance(move, Fork):
                self.scheduler.fork_beams(move.moves, now)
            else:  # a restart: the old beams leave, the search begins again at the queue's front
                for req in move.old:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED, now=now)
                self.scheduler.add_request(move.head, front=True)

    def _fail(self, g: Group, message: str, now: float) -> RequestOutput:
        """Fail one request outside output processing; its blocks are freed at once."""
        output, decisions = self.processor.fail(g, message, now)
        self._apply(decisions, now)
        return output

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._faults is not None:
            self._check_faults(out)
        return self.runner.execute(out)

    def _check_faults(self, out: SchedulerOutput) -> None:
        """Tests only: fail this forward pass on purpose (engine/faults.py)."""
        for s in out.scheduled:
            g = self.processor.group_of(s.request_id)
            prompt = g.prompt if g is not None else None
            self._faults.check("forward", s.request_id, prompt, attribute=False)
            self._faults.check("sample", s.request_id, prompt)

    def _failed_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Contain a failed execute(): fail the request it names, else the step's requests."""
        now = time.perf_counter()
        culprit = getattr(exc, "request_id", None)
        g = self.processor.group_of(culprit) if isinstance(culprit, str) else None
        if g is not None and any(s.request_id == culprit for s in out.scheduled):
            # The others' results are dropped with the step; they are scheduled again next
            # step from the same num_computed_tokens and recompute the same tokens.
            logger.error("request %s failed in the model runner; failing it alone", g.request_id, exc_info=exc)
            return [self._fail(g, failure_message("sampling its next token", exc), now)]
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        groups: dict[str, Group] = {}
        for s in out.scheduled:
            sg = self.processor.group_of(s.request_id)
            if sg is not None:
                groups[sg.request_id] = sg
        logger.error("engine step %d failed (%d in a row); failing its %d request(s): %s", out.step,
                     self.consecutive_failed_steps, len(groups), ", ".join(groups), exc_info=exc)
        msg = failure_message("running the model on this request's batch", exc)
        outputs = [self._fail(sg, msg, now) for sg in groups.values()]
        self.device_error = self._probe_device()
        if self.device_error is not None:
            logger.error("the device is broken: %s", self.device_error)
        return outputs

    def _probe_device(self) -> str | None:
        """None if a tiny computation on the device still works, else why not.  After a
        device fault (a CUDA illegal address, say) every later kernel fails too."""
        if self._faults is not None and self._faults.device_broken():
            return "injected device fault"
        if self.tp_launcher is not None:  # a dead tensor-parallel worker fails every later step
            for rank, proc in enumerate(self.tp_launcher.procs, start=1):
                if not proc.is_alive():
                    return f"tensor-parallel worker rank {rank} exited (status {proc.exitcode})"
        try:
            x = torch.ones(4, device=self.device)
            if float((x * 2).sum()) != 8.0:
                return "the device computed 2 * 4 ones wrongly"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _notify(self, out: SchedulerOutput, res: RunnerOutput, start: float) -> None:
        """Hand the step's event to each observer; one that raises is logged and detached."""
        try:
            event = self.scheduler.make_event(out, res.sampled, start, time.perf_counter(), res.model_time)
        except Exception:
            logger.exception("building the StepEvent of step %d failed; observers skip it", out.step)
            return
        for fn in list(self.observers):
            try:
                fn(event)
            except Exception:
                logger.exception("step observer %r raised; it is detached and the engine carries on", fn)
                with contextlib.suppress(ValueError):
                    self.observers.remove(fn)
