"""Model runner: a SchedulerOutput becomes one forward pass and sampled tokens.

The scheduler decides *what* to compute; the runner computes it.  All scheduled tokens
of all requests are flattened into one batch (decode tokens first, then prefill
chunks), with their positions and KV slots; one forward pass runs over all of them;
logits are computed only for rows that emit a token (the last token of each request
that catches up this step, plus prompt positions when `prompt_logprobs` was asked).
A decode carrying speculative drafts feeds them as extra decode rows (one per position,
each attending to the rows before it) and gets logits at each; spec_decode/verify.py
keeps the drafts the model agrees with.

It also owns the paged KV cache tensors: per layer, K and V of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, allocated once at start-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenloom.core.scheduler import ScheduledRequest, SchedulerOutput
from tokenloom.kernels import hugepages
from tokenloom.config import BackendPlan
from tokenloom.model.attention import AttentionMetadata, build_backend
from tokenloom.model.ops import build_ops
from tokenloom.model.weights.parallel import TPGroup
from tokenloom.model.weights.loader import LoadedModel
from tokenloom.kernels import glibc_heap
from tokenloom.model.lora import LoRARows, LoRASlots, apply_for, attach
from tokenloom.runner.logprobs import logprob_rows
from tokenloom.runner.lora_step import LoRAStep, by_adapter
from tokenloom.runner.cuda_graphs import DecodeGraphs, capture_sizes
from tokenloom.runner.tp_comm import recv_step, send_step
from tokenloom.runner.sampler import SamplingRow, sample
from tokenloom.spec_decode.verify import verify
from tokenloom.structured import StepMasks


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # request id -> (logprob of sampled token, rank, top-N [(token, logprob)])
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]] = field(default_factory=dict)
    # request id -> list of (prompt position, logprob of that prompt token, rank, top-N)
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
    # speculative decoding: request id -> its drafts the model accepted (a prefix of them),
    # which come before its token in `sampled`
    accepted: dict[str, list[int]] = field(default_factory=dict)
    forward_time: float = 0.0  # the whole execute(): input prep + model + sampling
    model_time: float = 0.0  # the model alone: forward pass + logits


def _to(x, device: torch.device):
    """Every tensor in a nest of tuples, lists and dicts moved to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


@dataclass
class _PromptSpan:
    """A request's prompt rows scored this step: positions start..last-1 predict tokens start+1..last."""

    request: object
    start: int
    last: int
    rows: torch.Tensor  # their rows in the step's hidden states


class RequestError(RuntimeError):
    """A failure that belongs to one request (`request_id`): the engine fails it alone."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id}: {type(cause).__name__}")
        self.request_id = request_id


def _sample_or_blame(logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None = None):
    """`sample`, and if it raises, the row that makes it raise found by sampling each row
    alone (only on failure), so one request's bad settings fail that request, not the step."""
    try:
        return sample(logits, rows, masks)
    except Exception as exc:
        for i, row in enumerate(rows):
            try:
                sample(logits[i:i + 1].clone(), [row])
            except Exception:
                raise RequestError(row.request_id, exc) from exc
        raise


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, plan: BackendPlan | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None, tp: TPGroup | None = None,
                 lora_slots: LoRASlots | None = None):
        """`plan`: what runs (model/backends.py), as resolved before `loaded` was loaded for it
        (`loaded.plan` when not given); the runner builds what it names and decides nothing.
        `lora_slots`: with --enable-lora, the adapters' weight slots (allocated by the engine
        before the KV cache was sized); each step's rows then run their requests' adapters."""
        self.loaded = loaded
        self.model = loaded.model
        self.plan = plan = plan or loaded.plan
        self.tp = tp  # tensor parallel: rank 0 sends every step to the other ranks (runner/tp_worker.py)
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        a = loaded.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        # zeros, not empty: masked-out slots still enter the attention matmul, and NaN
        # garbage there would poison the softmax (0 * NaN = NaN).  On CPU in 2 MiB pages,
        # which attention streams like the weights (kernels/hugepages.py).
        self.kv_caches = [
            (hugepages.zeros(shape, loaded.dtype, self.device), hugepages.zeros(shape, loaded.dtype, self.device))
            for _ in range(a.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        if self.device.type == "cpu":
            glibc_heap.keep_step_buffers()  # every step's temporaries reused, not faulted in anew
        self.attn = build_backend(plan.attention, self.device, loaded.dtype, a.head_dim, a.num_kv_heads,
                                  a.sliding_window)
        self.ops = build_ops(plan.ops, loaded.dtype, plan.fused_kv_write)
        self.model.bind(self.ops, self.attn, flat=plan.flat_calls)  # model/llama.py: the layers as they run
        self.lora: LoRAStep | None = None
        if lora_slots is not None:  # every layer's linears wrapped with the slots' adapters (model/lora.py)
            rows = LoRARows()
            attach(self.model, lora_slots, rows, apply_for(plan.lora, self.device, loaded.dtype))
            self.lora = LoRAStep(lora_slots, rows)
        self.max_blocks = -(-(max_model_len or a.max_position_embeddings) // block_size)
        self._forward = self.model.forward
        if plan.compile:
            # One graph per step kind (decode-only, prefill-only, mixed: which metadata
            # fields are None), every size symbolic.  Without this, dynamo's "duck sizing"
            # guards on sizes that happen to coincide (e.g. block-table width == number of
            # decodes) and recompiles whenever they stop coinciding.
            torch.fx.experimental._config.use_duck_shape = False
            self._forward = torch.compile(self.model.forward, dynamic=True)
        # Decode-only steps through one CUDA graph per batch size (runner/cuda_graphs.py).
        self.graphs: DecodeGraphs | None = None
        self.graphs_off_reason = plan.cuda_graphs_off
        if plan.cuda_graphs:
            self.graphs = self.make_decode_graphs(max_num_seqs)
            self.graphs.capture()

    def make_decode_graphs(self, max_num_seqs: int) -> DecodeGraphs:
        """The padded decode forward over persistent buffers (captured by `.capture()` on a GPU)."""
        return DecodeGraphs(self.model, self.kv_caches, self.attn, capture_sizes(max_num_seqs), self.max_blocks,
                            self.device)

    def describe(self) -> str:
        """One line for the start-up summary: the backend plan and the CUDA graphs captured."""
        g = self.graphs
        graphs = (f"; CUDA graphs for decode batches {g.sizes[0]}..{g.sizes[-1]} ({len(g.graphs)} captured in "
                  f"{g.capture_seconds:.1f} s, {g.graph_memory_bytes / 2**20:.0f} MiB)" if g is not None else "")
        tp = f"tensor parallel over {self.tp.size} ranks, " if self.tp is not None else ""
        lora = ""
        if self.lora is not None:
            sl = self.lora.slots
            lora = f"; {sl.max_loras} LoRA slot(s) of rank {sl.max_rank} ({sl.nbytes / 2**20:.0f} MiB)"
        return f"{tp}{self.plan.describe()}{graphs}{lora}"

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.request.sampling_params.seed
        if seed is None or s.request.sampling_params.greedy:
            return None
        g = self.generators.get(s.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self.generators[s.request_id] = g
        return g

    # ---- input preparation ------------------------------------------
    @staticmethod
    def _decode_inputs(decodes: list[ScheduledRequest], bs: int) -> tuple[list[int], list[int], list[int]]:
        """ids, positions and KV slots of one-token decodes: plain Python ints (the hot path)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            c = s.num_computed_before
            ids.append(s.request.token_at(c))
            pos.append(c)
            slots.append(s.block_ids[c // bs] * bs + c % bs)
        return ids, pos, slots

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        decodes = [s for s in out.scheduled if s.phase == "decode"]
        prefills = [s for s in out.scheduled if s.phase != "decode"]
        if self.lora is not None:  # each adapter's rows together: one run per adapter (runner/lora_step.py)
            decodes, prefills = by_adapter(decodes), by_adapter(prefills)
        order = decodes + prefills
        spec = any(s.spec_token_ids for s in decodes)
        if spec:
            # A decode with drafts (speculative decoding) becomes 1 + k decode rows: row j is the
            # token at position c+j attending to c+j+1 tokens.  Every row's K/V is written before
            # any row attends, so each sees the drafts before it -- a short causal chunk run
            # through the (fast) decode path.
            decodes = [s for s in decodes for _ in range(s.num_new_tokens)]
            ids, pos, slots, offsets = [], [], [], []
            for s in order[:len(order) - len(prefills)]:
                c = s.num_computed_before
                offsets.append(len(ids))
                ids.append(s.request.token_at(c))
                ids.extend(s.spec_token_ids)
                for p in range(c, c + s.num_new_tokens):
                    pos.append(p)
                    slots.append(s.block_ids[p // bs] * bs + p % bs)
            decode_ctx = [p + 1 for p in pos]
        else:
            ids, pos, slots = self._decode_inputs(decodes, bs)
            offsets = list(range(len(decodes)))
            decode_ctx = [s.num_computed_before + 1 for s in decodes]
        t = len(decodes)
        for s in prefills:
            c, n = s.num_computed_before, s.num_new_tokens
            ids.extend(s.request.token_slice(c, c + n))
            p = np.arange(c, c + n, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            pos.extend(p.tolist())
            slots.extend((table[p // bs] * bs + p % bs).tolist())
            offsets.append(t)
            t += n
        dev = self.device

        def tables(group: list[ScheduledRequest]) -> torch.Tensor:
            nb = max(len(s.block_ids) for s in group)
            return torch.tensor([s.block_ids + [0] * (nb - len(s.block_ids)) for s in group], dtype=torch.long)

        def to(x):
            return x.to(dev, non_blocking=True)

        layout = {}
        if decodes:
            layout.update(decode_block_tables=tables(decodes), decode_context_lens=torch.tensor(decode_ctx))
        if prefills:
            layout.update(prefill_block_tables=tables(prefills),
                          prefill_q_starts=torch.tensor(offsets[len(order) - len(prefills):]),
                          prefill_q_lens=torch.tensor([s.num_new_tokens for s in prefills]),
                          prefill_ctx_lens=torch.tensor([s.num_computed_before for s in prefills]))
        # the attention backend adds what it reads besides (masks, split counts): model/attention.py
        meta = self.attn.metadata(torch.tensor(slots, dtype=torch.long), dev, bs, **layout)
        if self.lora is not None:
            self.lora.prepare(order, offsets)
        return order, offsets, to(torch.tensor(ids, dtype=torch.long)), to(torch.tensor(pos, dtype=torch.long)), meta

    # ---- one step ---------------------------------------------------
    def _graph_decodes(self, out: SchedulerOutput) -> list[ScheduledRequest] | None:
        """The step's requests if it runs through the decode graphs: decodes only, each
        sampling, no more than the largest captured batch."""
        if self.graphs is None or len(out.scheduled) > self.graphs.max_size:
            return None
        for s in out.scheduled:
            if s.phase != "decode" or not s.sample or s.spec_token_ids:
                return None
        return out.scheduled

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result = RunnerOutput()
        if out.is_empty:
            return result
        decodes = self._graph_decodes(out)
        hidden = None
        if decodes is not None:
            ids, pos, slots = self._decode_inputs(decodes, self.block_size)
            sample_sched = [(s, i) for i, s in enumerate(decodes)]
            masks = StepMasks.start([s.request.grammar for s, _ in sample_sched])  # filled during the forward
            t_model = time.perf_counter()
            logits = self.graphs.run(ids, pos, slots, [s.block_ids for s in decodes])
        else:
            order, offsets, input_ids, positions, meta = self._prepare(out)
            sample_sched = [(s, off + s.num_new_tokens - 1) for s, off in zip(order, offsets)
                            if s.sample and not s.spec_token_ids]
            # decodes with drafts: logits at the decode token and at every draft (verify.py)
            spec_sched = [(s, off) for s, off in zip(order, offsets) if s.spec_token_ids]
            spans = self._prompt_spans(order, offsets)
            rows_idx = torch.tensor([i for _, i in sample_sched]
                                    + [off + j for s, off in spec_sched for j in range(s.num_new_tokens)],
                                    dtype=torch.long, device=self.device)
            masks = StepMasks.start([s.request.grammar for s, _ in sample_sched])  # filled during the forward
            t_model = time.perf_counter()
            if self.tp is not None:  # the other ranks run the same forward and logits (collectives)
                send_step(input_ids, positions, meta, [rows_idx] + [sp.rows for sp in spans])
            hidden = self._forward(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[rows_idx]) if len(rows_idx) else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sampler syncs anyway; this makes model_time honest
        result.model_time = time.perf_counter() - t_model
        if decodes is None and spec_sched:
            self._verify(spec_sched, logits[len(sample_sched):], result)
        if sample_sched:
            rows = [self._sampling_row(s) for s, _ in sample_sched]
            so = _sample_or_blame(logits[:len(sample_sched)] if decodes is None and spec_sched else logits, rows, masks)
            for (s, _), tok, lp in zip(sample_sched, so.token_ids, so.logprobs):
                result.sampled[s.request_id] = tok
                if lp is not None:
                    result.logprobs[s.request_id] = lp
        if hidden is not None:  # decode-only steps have no prompt left to score
            self._prompt_logprobs(spans, hidden, result)
        result.forward_time = time.perf_counter() - t0
        return result

    def _sampling_row(self, s: ScheduledRequest) -> SamplingRow:
        return SamplingRow(
            request_id=s.request_id,
            params=s.request.sampling_params,
            prompt_token_ids=s.request.prompt_token_ids,
            output_token_ids=s.request.output_token_ids,
            eos_token_ids=s.request.eos_token_ids,
            generator=self._generator(s),
            grammar=s.request.grammar,
        )

    def _verify(self, spec_sched, logits: torch.Tensor, result: RunnerOutput) -> None:
        """Speculative decoding: accept or reject each request's drafts (spec_decode/verify.py)."""
        rows = [self._sampling_row(s) for s, _ in spec_sched]
        try:
            verdicts = verify(logits, rows, [s.spec_token_ids for s, _ in spec_sched])
        except Exception as exc:  # find the request whose settings break it, as _sample_or_blame does
            start = 0
            for (s, _), row in zip(spec_sched, rows):
                n = s.num_new_tokens
                try:
                    verify(logits[start:start + n].clone(), [row], [s.spec_token_ids])
                except Exception:
                    raise RequestError(row.request_id, exc) from exc
                start += n
            raise
        for (s, _), v in zip(spec_sched, verdicts):
            result.sampled[s.request_id] = v.token
            result.accepted[s.request_id] = v.accepted

    def _prompt_spans(self, order, offsets) -> list[_PromptSpan]:
        """The rows whose logits score prompt tokens this step (`prompt_logprobs`)."""
        spans = []
        for s, off in zip(order, offsets):
            req = s.request
            n_top = req.sampling_params.prompt_logprobs
            if n_top is None or req.num_output_tokens > 0:  # not during recompute after preemption
                continue
            c, n = s.num_computed_before, s.num_new_tokens
            last = min(c + n, req.num_prompt_tokens - 1)  # position p predicts prompt token p+1
            if last > c:
                spans.append(_PromptSpan(req, c, last, torch.arange(off, off + (last - c), device=self.device)))
        return spans

    def _prompt_logprobs(self, spans: list[_PromptSpan], hidden, result: RunnerOutput) -> None:
        """Logprobs of prompt tokens, from the logits of the position before each one."""
        for sp in spans:
            req, c, last = sp.request, sp.start, sp.last
            n_top = req.sampling_params.prompt_logprobs
            logits = self.model.compute_logits(hidden[sp.rows])
            found = logprob_rows(logits, torch.tensor(req.prompt_token_ids[c + 1 : last + 1]), n_top)
            frag = result.prompt_logprobs.setdefault(req.request_id, [])
            for j in range(last - c):
                frag.append((c + 1 + j, *found.row(j)))

    # ---- the other ranks of a tensor-parallel group -------------------
    def serve_steps(self) -> None:
        """Rank > 0: run each step rank 0 sends (forward, then the same logits rows, taking
        part in every collective), until it sends the end."""
        while (step := recv_step()) is not None:
            dev = self.device  # tensors arrive on rank 0's device
            input_ids, positions, fields, logit_rows = _to(step, dev)
            meta = AttentionMetadata(backend=self.attn, **fields)
            with torch.inference_mode():
                hidden = self._forward(input_ids, positions, self.kv_caches, meta)
                for rows in logit_rows:
                    if len(rows):
                        self.model.compute_logits(hidden[rows])
