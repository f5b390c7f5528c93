"""POST /v1/embeddings: OpenAI's embeddings over an engine run with `--runner pooling`.

`input` takes OpenAI's four shapes (a string, a list of strings, a token-id list, a list
of token-id lists); each becomes one engine request, prefill only, pooled as the model's
sentence-transformers config says (docs/embeddings.md).  `encoding_format: "base64"` sends
each vector as the base64 of its little-endian float32 bytes (what the `openai` client
asks for by default, and decodes); `dimensions` is honoured by matryoshka models only.
Every bad field is a 400 naming it, checked before anything is queued: an input longer
than max_model_len (an embedding needs no room for a generated token, so exactly
max_model_len fits), an empty one, a token id outside the vocabulary, `dimensions` on a
model that cannot shorten its vectors.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.llm_engine import PromptTooLongError
from tokenloom.engine.prompt_bound import prompt_bound
from tokenloom.entrypoints.openai.errors import OpenAIError, bad_request
from tokenloom.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from tokenloom.entrypoints.openai.serving_common import (ServingContext, add_requests, collect_final, new_id,
                                                         off_loop)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParamError


def split_inputs(value: str | list) -> list[str | list[int]]:
    """OpenAI's four input shapes -> a list of single inputs."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)


def too_long(max_model_len: int, tokens: int | str) -> OpenAIError:
    return OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your input "
                            f"resulted in {tokens} tokens. Please reduce the length of the input.",
                       param="input", code="context_length_exceeded")


def _tokenize_all(ctx: ServingContext, inputs: list[str | list[int]], params: PoolingParams,
                  req: EmbeddingRequest) -> list[tuple[str | None, list[int]]]:
    """Every input's token ids, each checked as the engine will (blocking: a worker thread).
    All are checked before any is queued, so a bad one in a list leaves nothing behind."""
    engine, max_len = ctx.engine, ctx.engine.max_model_len
    bound = prompt_bound(engine.tokenizer)
    for x in inputs:  # lengths first: a huge text is refused before any tokenizing
        if isinstance(x, str) and bound.min_tokens(x) > max_len:
            raise too_long(max_len, f"at least {bound.min_tokens(x)}")
        if isinstance(x, list) and len(x) > max_len:
            raise too_long(max_len, len(x))
    out = []
    for x in inputs:
        ids = engine.tokenizer.encode(x, add_special_tokens=req.add_special_tokens) if isinstance(x, str) else x
        try:
            _, ids = engine.validate(ids, params)
        except PromptTooLongError as e:
            raise too_long(max_len, e.prompt_tokens) from None
        except SamplingParamError as e:
            raise bad_request(str(e), param=e.param) from None
        except ValueError as e:
            raise bad_request(str(e), param="input") from None
        out.append((x if isinstance(x, str) else None, ids))
    return out


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request) -> Response:
    lora = ctx.check_model(req.model)
    inputs = split_inputs(req.input)
    cap = ctx.limits.max_prompts_per_request
    if len(inputs) > cap:
        raise bad_request(f"at most {cap} inputs are allowed per request, got {len(inputs)} "
                          f"(--max-prompts-per-request)", param="input", code="limit_exceeded")
    try:
        params = PoolingParams(dimensions=req.dimensions)
    except SamplingParamError as e:
        raise bad_request(str(e), param=e.param) from None
    prompts = await off_loop(_tokenize_all, ctx, inputs, params, req)
    rid = new_id("embd")
    streams = add_requests(ctx, rid, prompts, params, priority=req.priority, cache_salt=None, lora_request=lora)
    finals = await collect_final(ctx, streams, raw)
    if finals is None:  # the client is gone (its requests are aborted); nobody reads this
        return JSONResponse({}, status_code=499)
    data = [EmbeddingData(index=i, embedding=encode_vector(out.outputs.embedding, req.encoding_format))
            for i, out in enumerate(finals)]
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    resp = EmbeddingResponse(id=rid, model=req.model or ctx.model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(resp.model_dump_json(), media_type="application/json")
