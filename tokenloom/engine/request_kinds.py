"""The two kinds of request that are not plain sampling, as the engine admits them.

An embedding (`PoolingParams`) is one scheduler request that computes its prompt and ends;
its group carries the pooling parameters and, once computed, the vector.  A beam search
(`BeamSearchParams`) starts as one request -- its first beam, holding a batch seat for each
beam it will fork into -- and its group carries the search (engine/beam_search.py).
`check_beam_search` says, before anything is queued, whether a search can run here at all:
its candidates fit the vocabulary, its beams one step's seats and the KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenloom.engine.beam_search import BeamGroup, beam_request
from tokenloom.engine.output_processor import Group, Sample
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import Request
from tokenloom.sampling_params import BeamSearchParams, SamplingParamError, SamplingParams


def beam_topk(params: BeamSearchParams, eos_token_ids: frozenset[int]) -> int:
    """Candidates each beam hands the search per step (transformers' count: enough that the
    best `beam_width` never all end at once)."""
    return max(2, 1 + (0 if params.ignore_eos else len(eos_token_ids))) * params.beam_width


def check_beam_search(params: BeamSearchParams, prompt_len: int, max_tokens: int, *, eos_token_ids: frozenset[int],
                      vocab_size: int, num_seats: int, num_blocks: int, block_size: int) -> None:
    """SamplingParamError naming `beam_width` if the search cannot run on this engine."""
    width, keep = params.beam_width, beam_topk(params, eos_token_ids)
    if keep > vocab_size:
        raise SamplingParamError("beam_width", f"{width} beams weigh {keep} candidates a step, more than the "
                                               f"vocabulary's {vocab_size} tokens")
    if width > num_seats:
        raise SamplingParamError("beam_width", f"{width} beams must all run in one step: at most {num_seats} "
                                               f"(--max-num-seqs)")
    need = width * -(-(prompt_len + max_tokens) // block_size)  # every beam apart, at worst
    if need > num_blocks:
        raise SamplingParamError("beam_width", f"{width} beams of {prompt_len + max_tokens} tokens may need {need} "
                                               f"KV blocks; the cache has {num_blocks}")


def embedding_group(request_id: str, text: str | None, ids: list[int], params: PoolingParams, arrival: float,
                    priority: int, cache_salt: str | None, **lora: Any) -> Group:
    """An embedding request and its group (the one request is `samples[0].req`); `lora`: its
    LoRA adapter's fields of `Request` (lora_request, lora_adapter), if it runs on one."""
    sp = SamplingParams(max_tokens=1, detokenize=False)
    req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=sp, arrival_time=arrival,
                  max_tokens=1, priority=priority, cache_salt=cache_salt, pooling=params, **lora)
    return Group(request_id=request_id, prompt=text, prompt_token_ids=ids, params=sp, samples=[Sample(req, None, None)],
                 pending=[], arrival_time=arrival, pooling=params)


def beam_search_group(request_id: str, text: str | None, ids: list[int], params: BeamSearchParams, max_tokens: int,
                      eos_token_ids: frozenset[int], arrival: float, priority: int, cache_salt: str | None,
                      **lora: Any) -> Group:
    """A beam search's group; its first beam (`samples[0].req`) is what enters the scheduler.
    Beam i is the request `<request_id>-beam<i>` (each on the LoRA adapter of `lora`, if any)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=params.ignore_eos)
    template = Request(request_id=f"{request_id}-beam0", prompt_token_ids=ids, sampling_params=sp,
                       arrival_time=arrival, eos_token_ids=eos_token_ids, max_tokens=max_tokens, priority=priority,
                       cache_salt=cache_salt, **lora)
    width, topk = params.beam_width, beam_topk(params, eos_token_ids)
    beams = BeamGroup(dataclasses.replace(params, max_tokens=max_tokens), eos_token_ids,
                      lambda i: beam_request(template, i, width, topk))
    return Group(request_id=request_id, prompt=text, prompt_token_ids=ids, params=dataclasses.replace(sp, n=width),
                 samples=[Sample(beams.slots[0], None, None)], pending=[], arrival_time=arrival, beam=beams)
