"""Model runner: a SchedulerOutput becomes one forward pass and sampled tokens.

The scheduler decides *what* to compute; the runner computes it.  All scheduled tokens
of all requests are flattened into one batch (decode tokens first, then prefill
chunks), with their positions and KV slots; one forward pass runs over all of them;
logits are computed only for rows that emit a token (the last token of each request
that catches up this step, plus prompt positions when `prompt_logprobs` was asked).

It also owns the paged KV cache tensors: per layer, K and V of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, allocated once at start-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenloom.core.scheduler import ScheduledRequest, SchedulerOutput
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.kernels import hugepages
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.loader import LoadedModel
from tokenloom.runner import glibc_heap
from tokenloom.runner.sampler import SamplingRow, sample


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # request id -> (logprob of sampled token, rank, top-N [(token, logprob)])
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]] = field(default_factory=dict)
    # request id -> list of (prompt position, logprob of that prompt token, rank, top-N)
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
    forward_time: float = 0.0  # the whole execute(): input prep + model + sampling
    model_time: float = 0.0  # the model alone: forward pass + logits


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    a = loaded.args
    elem = torch.tensor([], dtype=loaded.dtype).element_size()
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, compile: bool = False):
        self.loaded = loaded
        self.model = loaded.model
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
        # Chosen once: our paged decode kernel where it runs, else SDPA (needs a mask).
        self._decode_op = cpu_kernels.decode_attention_op(self.device, loaded.dtype, a.head_dim)
        self._forward = self.model.forward
        if compile:
            # One graph per step kind (decode-only, prefill-only, mixed: which metadata
            # fields are None), every size symbolic.  Without this, dynamo's "duck sizing"
            # guards on sizes that happen to coincide (e.g. block-table width == number of
            # decodes) and recompiles whenever they stop coinciding.
            torch.fx.experimental._config.use_duck_shape = False
            self._forward = torch.compile(self.model.forward, dynamic=True)

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
    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        decodes = [s for s in out.scheduled if s.phase == "decode"]
        prefills = [s for s in out.scheduled if s.phase != "decode"]
        order = decodes + prefills
        # Decodes are the hot path (one token each, every step): plain Python ints, no numpy.
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            c = s.num_computed_before
            ids.append(s.request.token_at(c))
            pos.append(c)
            slots.append(s.block_ids[c // bs] * bs + c % bs)
        offsets = list(range(len(decodes)))
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
        input_ids = torch.tensor(ids, dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        slots_t = torch.tensor(slots, dtype=torch.long)

        def tables(group: list[ScheduledRequest]) -> tuple[torch.Tensor, int]:
            nb = max(len(s.block_ids) for s in group)
            rows = [s.block_ids + [0] * (nb - len(s.block_ids)) for s in group]
            return torch.tensor(rows, dtype=torch.long), nb * bs

        dbt = dmask = ctx = pbt = pmask = pgather = pscatter = None
        if decodes:
            dbt, L = tables(decodes)
            ctx = torch.tensor([s.num_computed_before + 1 for s in decodes])
            if self._decode_op is None:
                dmask = (torch.arange(L).unsqueeze(0) < ctx.unsqueeze(1)).view(len(decodes), 1, 1, L)
        if prefills:
            pbt, L = tables(prefills)
            cs = torch.tensor([s.num_computed_before for s in prefills])
            ns = torch.tensor([s.num_new_tokens for s in prefills])
            offs = torch.tensor(offsets[len(decodes):])
            max_q = int(ns.max())
            ar = torch.arange(max_q).unsqueeze(0)
            row = torch.minimum(ar, (ns - 1).unsqueeze(1))  # padded rows repeat the last real query
            qpos = cs.unsqueeze(1) + row
            pmask = (torch.arange(L).view(1, 1, L) <= qpos.unsqueeze(2)).unsqueeze(1)
            pgather = offs.unsqueeze(1) + row
            valid = ar < ns.unsqueeze(1)
            pscatter = torch.arange(len(prefills) * max_q).view(len(prefills), max_q)[valid]

        def to(x):
            return None if x is None else x.to(dev, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to(slots_t),
            num_decode=len(decodes),
            decode_block_tables=to(dbt),
            decode_mask=to(dmask),
            decode_context_lens=to(ctx),
            prefill_block_tables=to(pbt),
            prefill_mask=to(pmask),
            prefill_gather=to(pgather),
            prefill_scatter=to(pscatter),
            decode_op=self._decode_op,
        )
        return order, offsets, to(input_ids), to(positions), meta

    # ---- one step ---------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result = RunnerOutput()
        if out.is_empty:
            return result
        order, offsets, input_ids, positions, meta = self._prepare(out)
        t_model = time.perf_counter()
        hidden = self._forward(input_ids, positions, self.kv_caches, meta)

        sample_sched = [(s, off + s.num_new_tokens - 1) for s, off in zip(order, offsets) if s.sample]
        if sample_sched:
            rows_idx = torch.tensor([i for _, i in sample_sched], device=self.device)
            logits = self.model.compute_logits(hidden[rows_idx])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the sampler syncs anyway; this makes model_time honest
            result.model_time = time.perf_counter() - t_model
            rows = [
                SamplingRow(
                    request_id=s.request_id,
                    params=s.request.sampling_params,
                    prompt_token_ids=s.request.prompt_token_ids,
                    output_token_ids=s.request.output_token_ids,
                    eos_token_ids=s.request.eos_token_ids,
                    generator=self._generator(s),
                )
                for s, _ in sample_sched
            ]
            so = sample(logits, rows)
            for (s, _), tok, lp in zip(sample_sched, so.token_ids, so.logprobs):
                result.sampled[s.request_id] = tok
                if lp is not None:
                    result.logprobs[s.request_id] = lp
        else:
            result.model_time = time.perf_counter() - t_model
        self._prompt_logprobs(order, offsets, hidden, result)
        result.forward_time = time.perf_counter() - t0
        return result

    def _prompt_logprobs(self, order, offsets, hidden, result: RunnerOutput) -> None:
        """Logprobs of prompt tokens, from the logits of the position before each one."""
        for s, off in zip(order, offsets):
            req = s.request
            n_top = req.sampling_params.prompt_logprobs
            if n_top is None or req.num_output_tokens > 0:  # not during recompute after preemption
                continue
            c, n = s.num_computed_before, s.num_new_tokens
            last = min(c + n, req.num_prompt_tokens - 1)  # position p predicts prompt token p+1
            if last <= c:
                continue
            logits = self.model.compute_logits(hidden[off : off + (last - c)])
            lps = logits.log_softmax(dim=-1)
            targets = torch.tensor(req.prompt_token_ids[c + 1 : last + 1], device=lps.device)
            tok_lp = lps.gather(1, targets.unsqueeze(1)).squeeze(1)
            ranks = (lps > tok_lp.unsqueeze(1)).sum(dim=1) + 1
            tops = lps.topk(n_top, dim=1) if n_top else None
            frag = result.prompt_logprobs.setdefault(req.request_id, [])
            for j in range(last - c):
                top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
                frag.append((c + 1 + j, tok_lp[j].item(), int(ranks[j]), top))
