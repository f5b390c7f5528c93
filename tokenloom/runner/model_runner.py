"""Model runner: a SchedulerOutput becomes one forward pass and sampled tokens.

The scheduler decides *what* to compute; the runner computes it.  All scheduled tokens
of all requests are flattened into one batch (decode tokens first, then prefill
chunks), with their positions and KV slots; one forward pass runs over all of them;
logits are computed only for rows that emit a token (the last token of each request
that catches up this step, plus prompt positions when `prompt_logprobs` was asked).
A decode carrying speculative drafts feeds them as extra decode rows (one per position,
each attending to the rows before it) and gets logits at each; spec_decode/verify.py
keeps the drafts the model agrees with.

Two kinds of request take something other than a sampled token from their last row:
a beam of a beam search gets its top log-probabilities (the engine's beam search picks
among all beams' candidates), and an embedding request gets no logits at all -- its
hidden states are pooled instead (runner/pooler.py), chunk by chunk.  Beam search also
shares KV blocks between beams; the copies the scheduler's copy-on-write asked for
(`SchedulerOutput.kv_copies`) are made before the forward pass writes anything.

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
from tokenloom.model.pooling_config import PoolingConfig
from tokenloom.model.ops import build_ops
from tokenloom.model.weights.parallel import TPGroup
from tokenloom.model.weights.loader import LoadedModel
from tokenloom.kernels import glibc_heap
from tokenloom.model.lora import LoRARows, LoRASlots, apply_for, lora_wrapper
from tokenloom.runner.logprobs import logprob_rows
from tokenloom.runner.lora_step import LoRAStep, by_adapter
from tokenloom.runner.cpu_graphs import CpuDecodeGraphs
from tokenloom.runner.cuda_graphs import DecodeGraphs, capture_sizes
from tokenloom.runner.pooler import Pooler
from tokenloom.runner.tp_comm import recv_step, send_step
from tokenloom.runner.sampler import PendingSample, SamplingRow, sample, sample_start
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
    # beam search: request id -> (token ids, log-probabilities) of its most likely next
    # tokens (`Request.beam_topk` of them), most likely first
    beam_candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    # embedding requests whose prompt ended this step: request id -> the pooled vector (CPU, float32)
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
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


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued (`ModelRunner.launch`); `collect`
    turns it into the RunnerOutput.  `rows`: request id -> its row in `pending.token_ids`."""

    out: SchedulerOutput
    result: RunnerOutput
    t0: float
    t_model: float = 0.0
    model_timed: bool = False  # model_time measured at launch (else: up to `collect`)
    pending: PendingSample | None = None
    rows: dict[str, int] = field(default_factory=dict)


def _split_beams(ends: list) -> tuple[list, list]:
    """(request, row) pairs of rows after a request's last token -> (sampled, beams)."""
    if not any(s.request.beam_topk for s, _ in ends):
        return ends, []
    return [e for e in ends if not e[0].request.beam_topk], [e for e in ends if e[0].request.beam_topk]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks (source -> copy) in every layer, in the order given.  One
    gather-scatter per tensor when no block is both written and read, else one by one."""
    src = [a for a, _ in copies]
    dst = [b for _, b in copies]
    if len(set(dst)) == len(dst) and not set(dst) & set(src):
        device = kv_caches[0][0].device
        si = torch.tensor(src, dtype=torch.long, device=device)
        di = torch.tensor(dst, dtype=torch.long, device=device)
        for k, v in kv_caches:
            k[di] = k[si]
            v[di] = v[si]
        return
    for a, b in copies:
        for k, v in kv_caches:
            k[b].copy_(k[a])
            v[b].copy_(v[a])


class RequestError(RuntimeError):
    """A failure that belongs to one request (`request_id`): the engine fails it alone."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id}: {type(cause).__name__}")
        self.request_id = request_id


def _sample_or_blame(logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None = None) -> PendingSample:
    """`sample_start`, and if it raises, the row that makes it raise found by sampling each row
    alone (only on failure), so one request's bad settings fail that request, not the step."""
    try:
        return sample_start(logits, rows, masks)
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
                 pooling: PoolingConfig | None = None, lora_slots: LoRASlots | None = None, draft_rows: int = 0):
        """`plan`: what runs (model/backends.py), as resolved before `loaded` was loaded for it
        (`loaded.plan` when not given); the runner builds what it names and decides nothing.
        `draft_rows`: the most decode rows a step's drafts add (speculative decoding): CPU graphs
        are sized for them too, so a verifying step replays even at `max_num_seqs` 1.
        `pooling`: how embedding requests pool (an engine run with `--runner pooling`).
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
        # wait for the forward before sampling, so model_time is the model's alone; async
        # scheduling turns it off (the host must not wait until it needs the tokens)
        self.sync_model_time = True
        self.pooler = Pooler(pooling) if pooling is not None else None
        if self.device.type == "cpu":
            glibc_heap.keep_step_buffers()  # every step's temporaries reused, not faulted in anew
        self.attn = build_backend(plan.attention, self.device, loaded.dtype, a.head_dim, a.num_kv_heads,
                                  self.model.attention_kinds)
        self.ops = build_ops(plan.ops, loaded.dtype, plan.fused_kv_write)
        self.lora: LoRAStep | None = None
        wrap = None
        if lora_slots is not None:  # every layer's linears wrapped with the slots' adapters (model/lora.py)
            rows = LoRARows()
            wrap = lora_wrapper(lora_slots, rows, apply_for(plan.lora, self.device, loaded.dtype))
            self.lora = LoRAStep(lora_slots, rows)
        # model/llama.py: the layers as they run
        self.model.bind(self.ops, self.attn, flat=plan.flat_calls, wrap=wrap)
        self.max_blocks = -(-(max_model_len or a.max_position_embeddings) // block_size)
        # LongRoPE: a request longer than `long_from` tokens rotates with the second table,
        # `long_offset` rows on (model/layers.py RotaryEmbedding); the scheduler recomputes a
        # request the step it grows past that length, as transformers does.
        self._long_from, self._long_offset = self.model.rope.long_from, self.model.rope.long_offset
        self._forward = self.model.forward
        if plan.compile:
            # One graph per step kind (decode-only, prefill-only, mixed: which metadata
            # fields are None), every size symbolic.  Without this, dynamo's "duck sizing"
            # guards on sizes that happen to coincide (e.g. block-table width == number of
            # decodes) and recompiles whenever they stop coinciding.
            torch.fx.experimental._config.use_duck_shape = False
            self._forward = torch.compile(self.model.forward, dynamic=True)
        # Decode-only steps through one CUDA graph per batch size (runner/cuda_graphs.py), or
        # on a CPU one recorded op list per batch size (runner/cpu_graphs.py).
        self.graphs: DecodeGraphs | None = None
        self.graphs_off_reason = plan.cpu_graphs_off if self.device.type == "cpu" else plan.cuda_graphs_off
        if plan.cuda_graphs:
            self.graphs = self.make_decode_graphs(max_num_seqs)
            self.graphs.capture()
        elif plan.cpu_graphs:
            self.graphs = CpuDecodeGraphs(self.model, self.kv_caches, self.attn, max_num_seqs + draft_rows,
                                          self.max_blocks, self.device)

    def make_decode_graphs(self, max_num_seqs: int) -> DecodeGraphs:
        """The padded decode forward over persistent buffers (captured by `.capture()` on a GPU)."""
        return DecodeGraphs(self.model, self.kv_caches, self.attn, capture_sizes(max_num_seqs), self.max_blocks,
                            self.device)

    def describe(self) -> str:
        """One line for the start-up summary: the backend plan and the decode graphs (CUDA or CPU)."""
        graphs = f"; {self.graphs.describe()}" if self.graphs is not None else ""
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
        if self.pooler is not None:
            self.pooler.forget(request_id)

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
    def _decode_inputs(self, decodes: list[ScheduledRequest], bs: int,
                       known: bool = True) -> tuple[list[int], list[int], list[int], list[int]]:
        """ids, positions, KV slots and context lengths (the tokens each attends to, its own
        included) of one-token decodes: plain Python ints (the hot path).  A position carries
        its rotary table's offset (`_rope_offset`); a length never does.  `known=False`: the ids
        are still on the device (async scheduling); zeros stand in."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        for s in decodes:
            c = s.num_computed_before
            ids.append(s.request.token_at(c) if known else 0)
            pos.append(c)
            slots.append(s.block_ids[c // bs] * bs + c % bs)
            lens.append(c + 1)
        if self._long_from is not None:
            pos = [p + self._rope_offset(s) for s, p in zip(decodes, pos)]
        return ids, pos, slots, lens

    def _draft_rows(self, decodes: list[ScheduledRequest]
                    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """ids, positions, KV slots, context lengths and each request's first row, of decodes
        with drafts (speculative decoding) laid out as decode rows: a request with k drafts
        becomes 1 + k rows, row j the token at position c + j attending to c + j + 1 tokens.
        Every row's K/V is written before any row attends, so each sees the drafts before it:
        a short causal chunk run through the (fast) decode path, eagerly or replayed
        (`_graph_decodes`)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        offsets: list[int] = []
        for s in decodes:
            c = s.num_computed_before
            offsets.append(len(ids))
            ids.append(s.request.token_at(c))
            ids.extend(s.spec_token_ids)
            off = self._rope_offset(s)
            for p in range(c, c + s.num_new_tokens):
                pos.append(p + off)
                slots.append(s.block_ids[p // bs] * bs + p % bs)
                lens.append(p + 1)
        return ids, pos, slots, lens, offsets

    def _rope_offset(self, s: ScheduledRequest) -> int:
        """Where the request's rotation rows start in the tables: past the first table for a
        request longer than LongRoPE's pretraining length."""
        return self._long_offset if self._long_from is not None and s.request.num_tokens > self._long_from else 0

    def _prepare(self, out: SchedulerOutput, known: bool = True):
        bs = self.block_size
        decodes = [s for s in out.scheduled if s.phase == "decode"]
        prefills = [s for s in out.scheduled if s.phase != "decode"]
        if self.lora is not None and known:
            # each adapter's rows together: one run per adapter (runner/lora_step.py); not when the
            # ids arrive from the step before on the device (async scheduling), in the scheduler's
            # order: the segments then follow that order, more of them, the same deltas
            decodes, prefills = by_adapter(decodes), by_adapter(prefills)
        order = decodes + prefills
        spec = any(s.spec_token_ids for s in decodes)
        if spec:
            ids, pos, slots, decode_ctx, offsets = self._draft_rows(decodes)
            decodes = [s for s in decodes for _ in range(s.num_new_tokens)]
        else:
            ids, pos, slots, decode_ctx = self._decode_inputs(decodes, bs, known)
            offsets = list(range(len(decodes)))
        t = len(decodes)
        for s in prefills:
            c, n = s.num_computed_before, s.num_new_tokens
            ids.extend(s.request.token_slice(c, c + n))
            p = np.arange(c, c + n, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            pos.extend((p + self._rope_offset(s)).tolist())
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
    def _graph_decodes(self, out: SchedulerOutput, drafts: bool = True) -> list[ScheduledRequest] | None:
        """The step's requests if it runs through the decode graphs: decodes only, each
        sampling, as many rows as the largest captured batch at most.  Decodes with drafts
        count one row per token (`_draft_rows`); `drafts=False` (async scheduling, whose ids
        arrive on the device one a request) takes none."""
        if self.graphs is None or len(out.scheduled) > self.graphs.max_size:
            return None
        rows = 0
        for s in out.scheduled:
            if s.phase != "decode" or not s.sample or (s.spec_token_ids and not drafts):
                return None
            rows += s.num_new_tokens if s.spec_token_ids else 1
        return out.scheduled if rows <= self.graphs.max_size else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, feed: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Prepare the step's inputs and queue its forward pass and sampling, without waiting
        for the device (on CUDA the host returns while the GPU works; on the CPU the work is
        done on return).  `feed`: the step before it, still running, whose sampled tokens are
        this step's input ids (async scheduling: every request here is a one-token decode of
        a request that samples in `feed`); they go from its sampler's output to this step's
        inputs on the device, never through the host."""
        t0 = time.perf_counter()
        launched = LaunchedStep(out, RunnerOutput(), t0)
        if out.is_empty:
            return launched
        result = launched.result
        if out.kv_copies:  # copy-on-write of shared beam blocks, before this step writes any
            copy_blocks(self.kv_caches, out.kv_copies)
        fed = None
        if feed is not None:
            src = [feed.rows[s.request_id] for s in out.scheduled]
            tokens = feed.pending.token_ids
            if src == list(range(len(src))):  # the usual order: a prefix of the rows, no gather
                fed = tokens[:len(src)]
            else:
                fed = tokens[self._index(src)]
        decodes = self._graph_decodes(out, drafts=fed is None)
        hidden = None
        spec_sched: list = []
        pool_sched: list = []
        if decodes is not None:
            if any(s.spec_token_ids for s in decodes):  # verifying rows, laid out as `_prepare` does
                ids, pos, slots, lens, offsets = self._draft_rows(decodes)
                tables = [s.block_ids for s in decodes for _ in range(s.num_new_tokens)]
            else:
                ids, pos, slots, lens = self._decode_inputs(decodes, self.block_size, known=fed is None)
                offsets, tables = list(range(len(decodes))), [s.block_ids for s in decodes]
            ends = [(s, off) for s, off in zip(decodes, offsets) if not s.spec_token_ids]
            sample_sched, beam_sched = _split_beams(ends)
            spec_sched = [(s, off) for s, off in zip(decodes, offsets) if s.spec_token_ids]
            masks = StepMasks.start([s.request.grammar for s, _ in sample_sched])  # filled during the forward
            t_model = time.perf_counter()
            logits = self.graphs.run(ids, pos, slots, tables, fed, lens)
            if beam_sched or (spec_sched and sample_sched):
                # the sampled rows first, then the beams', then every verifying row (the eager path's order)
                logits = logits[[i for _, i in sample_sched] + [i for _, i in beam_sched]
                                + [off + j for s, off in spec_sched for j in range(s.num_new_tokens)]]
        else:
            order, offsets, input_ids, positions, meta = self._prepare(out, known=fed is None)
            if fed is not None:
                input_ids = fed  # decodes only, in `out.scheduled` order
            ends = [(s, off + s.num_new_tokens - 1) for s, off in zip(order, offsets)
                    if s.sample and not s.spec_token_ids and s.request.pooling is None]
            sample_sched, beam_sched = _split_beams(ends)
            # decodes with drafts: logits at the decode token and at every draft (verify.py)
            spec_sched = [(s, off) for s, off in zip(order, offsets) if s.spec_token_ids]
            pool_sched = [(s, off) for s, off in zip(order, offsets) if s.request.pooling is not None]
            spans = self._prompt_spans(order, offsets)
            rows_idx = torch.tensor([i for _, i in sample_sched] + [i for _, i in beam_sched]
                                    + [off + j for s, off in spec_sched for j in range(s.num_new_tokens)],
                                    dtype=torch.long, device=self.device)
            masks = StepMasks.start([s.request.grammar for s, _ in sample_sched])  # filled during the forward
            t_model = time.perf_counter()
            if self.tp is not None:  # the other ranks run the same forward and logits (collectives)
                send_step(input_ids, positions, meta, [rows_idx] + [sp.rows for sp in spans], out.kv_copies)
            hidden = self._forward(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[rows_idx]) if len(rows_idx) else None
        launched.t_model = t_model
        if self.device.type != "cuda" or self.sync_model_time:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the sampler syncs anyway; this makes model_time honest
            result.model_time = time.perf_counter() - t_model
            launched.model_timed = True
        ns, nb = len(sample_sched), len(beam_sched)
        if spec_sched:
            self._verify(spec_sched, logits[ns + nb:], result)
        if beam_sched:
            self._beam_candidates(beam_sched, logits[ns:ns + nb], result)
        if sample_sched:
            rows = [self._sampling_row(s) for s, _ in sample_sched]
            launched.pending = _sample_or_blame(logits[:ns] if nb or spec_sched else logits, rows, masks)
            launched.rows = {s.request_id: i for i, (s, _) in enumerate(sample_sched)}
        if hidden is not None:  # decode-only steps have no prompt left to score or pool
            self._prompt_logprobs(spans, hidden, result)
            if pool_sched:
                self._pool(pool_sched, hidden, result)
        return launched

    def collect(self, launched: "LaunchedStep") -> RunnerOutput:
        """The launched step's results as Python values: waits for the device."""
        result = launched.result
        if launched.pending is not None:
            so = launched.pending.finish()
            for rid, i in launched.rows.items():
                result.sampled[rid] = so.token_ids[i]
                if so.logprobs[i] is not None:
                    result.logprobs[rid] = so.logprobs[i]
        now = time.perf_counter()
        if launched.t_model and not launched.model_timed:  # not synchronised at launch: up to the tokens
            result.model_time = now - launched.t_model
        result.forward_time = now - launched.t0
        return result

    def _index(self, rows: list[int]) -> torch.Tensor:
        """`rows` as an index tensor on the device, copied without waiting for the device (a
        plain `torch.tensor(..., device=cuda)` would wait for the step still running)."""
        t = torch.tensor(rows, dtype=torch.long)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _beam_candidates(self, beam_sched, logits: torch.Tensor, result: RunnerOutput) -> None:
        """Each beam's most likely next tokens and their log-probabilities (the model's own
        log-softmax in float32, as transformers' beam search scores them)."""
        k = min(max(s.request.beam_topk for s, _ in beam_sched), logits.shape[-1])
        vals, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        for (s, _), v, i in zip(beam_sched, vals.tolist(), ids.tolist()):
            n = s.request.beam_topk
            result.beam_candidates[s.request_id] = (i[:n], v[:n])

    def _pool(self, pool_sched, hidden: torch.Tensor, result: RunnerOutput) -> None:
        """Embedding requests: their chunk's rows, after the final norm, into the pooler."""
        if self.pooler is None:
            raise RuntimeError("an embedding request reached a runner that does not pool (--runner generate)")
        picks = [self.pooler.rows(s, off) for s, off in pool_sched]
        flat = [r for rows in picks for r in rows]
        normed = self.model.normed(hidden[flat]) if flat else hidden[:0]
        start = 0
        for (s, _), rows in zip(pool_sched, picks):
            vec = self.pooler.feed(s, normed[start:start + len(rows)])
            start += len(rows)
            if vec is not None:
                result.embeddings[s.request_id] = vec

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
            input_ids, positions, fields, logit_rows, kv_copies = _to(step, dev)
            meta = AttentionMetadata(backend=self.attn, **fields)
            with torch.inference_mode():
                if kv_copies:
                    copy_blocks(self.kv_caches, kv_copies)
                hidden = self._forward(input_ids, positions, self.kv_caches, meta)
                for rows in logit_rows:
                    if len(rows):
                        self.model.compute_logits(hidden[rows])
