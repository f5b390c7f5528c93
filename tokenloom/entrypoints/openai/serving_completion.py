"""POST /v1/completions: legacy text completions, whole or streamed as SSE.

A request may carry several prompts (strings or token-id lists); each becomes one engine
request of `n` samples, and choice `index = prompt_index * n + sample_index`, as OpenAI does.
Streaming turns the engine's cumulative outputs into deltas: per choice we remember how
much text and how many tokens were already sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_engine import RequestStream
from tokenloom.entrypoints.openai.errors import bad_request
from tokenloom.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                   CompletionResponse)
from tokenloom.entrypoints.openai.serving_common import (ChunkFrame, ServingContext, SSEResponse, abort_all,
                                                         add_requests, collect_final, finite_logprob, make_usage,
                                                         merge_streams, new_id, sampling_params, sse_body,
                                                         validate_prompt)
from tokenloom.outputs import PositionLogprobs, RequestOutput


def _split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def legacy_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], tokenizer,
                    offset: int) -> CompletionLogprobs:
    """OpenAI's completions logprobs (parallel lists) for `token_ids`; text offsets start at `offset`."""
    lp = CompletionLogprobs()
    for tok, pos in zip(token_ids, positions):
        if pos is None:  # the first prompt token has no logprob: nothing predicted it
            text = tokenizer.decode([tok])
            lp.tokens.append(text)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            chosen = pos.get(tok)
            text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
                else tokenizer.decode([tok])
            lp.tokens.append(text)
            lp.token_logprobs.append(finite_logprob(chosen.logprob) if chosen is not None else None)
            top: dict[str, float] = {}
            # Several tokens can print the same (byte-level pieces of one character all show as
            # U+FFFD); the likelier one keeps the key, so the chosen token's entry is never undercut.
            for t, v in sorted(pos.items(), key=lambda tv: -tv[1].logprob):
                key = v.decoded_token if v.decoded_token is not None else tokenizer.decode([t])
                top.setdefault(key, finite_logprob(v.logprob))
            lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


@dataclass
class _Prepared:
    request_id: str
    model: str
    prompt_texts: list[str]  # what echo prints for each prompt
    req: CompletionRequest
    tokenizer: Any


@dataclass
class _ChoiceState:
    """How much of one choice a stream has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    offset: int = 0  # text_offset of the next token
    started: bool = False
    done: bool = False


def _prepare(ctx: ServingContext, req: CompletionRequest) -> tuple[_Prepared, list[RequestStream]]:
    ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported by this server", param="best_of",
                          code="unsupported")
    echo_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
    prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else echo_lp
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_lp)
    tok = ctx.engine.tokenizer
    prompts: list[tuple[str | None, list[int]]] = []
    texts: list[str] = []
    # Validate every prompt before queuing any, so a bad one in a list leaves nothing behind.
    for p in _split_prompts(req.prompt):
        if isinstance(p, str):
            ids = tok.encode(p, add_special_tokens=req.add_special_tokens)
            _, ids = validate_prompt(ctx, ids, params)
            prompts.append((p, ids))
            texts.append(p)
        else:
            _, ids = validate_prompt(ctx, p, params)
            prompts.append((None, ids))
            texts.append(tok.decode(ids) if req.echo else "")
    rid = new_id("cmpl")
    streams = add_requests(ctx, rid, prompts, params, priority=req.priority, cache_salt=req.cache_salt)
    return _Prepared(rid, req.model or ctx.model_name, texts, req, tok), streams


def _jsonable_prompt_logprobs(out: RequestOutput) -> list | None:
    if out.prompt_logprobs is None:
        return None
    return [None if pos is None else {t: {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                      for t, v in pos.items()}
            for pos in out.prompt_logprobs]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    p, streams = _prepare(ctx, req)
    if req.stream:
        return SSEResponse(sse_body(ctx, streams, _stream(ctx, p, streams)), on_close=lambda: abort_all(ctx, streams))
    finals = await collect_final(ctx, streams, raw)
    if finals is None:  # the client is gone (its requests are aborted); nobody reads this
        return JSONResponse({}, status_code=499)
    choices: list[CompletionChoice] = []
    for i, out in enumerate(finals):
        echo_text = p.prompt_texts[i] if req.echo else ""
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = legacy_logprobs(c.token_ids, c.logprobs or [], p.tokenizer, len(echo_text))
                if req.echo and out.prompt_logprobs is not None:
                    logprobs = _concat(legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs, p.tokenizer, 0),
                                       logprobs)
            choices.append(CompletionChoice(
                index=i * req.n + c.index, text=echo_text + c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=_jsonable_prompt_logprobs(out) if req.prompt_logprobs is not None else None))
    resp = CompletionResponse(id=p.request_id, model=p.model, choices=choices, usage=make_usage(finals))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServingContext, p: _Prepared, streams: list[RequestStream]) -> AsyncIterator[str]:
    req = p.req
    frame = ChunkFrame(p.request_id, "text_completion", p.model, req.stream_options)
    states: dict[int, _ChoiceState] = {}
    latest: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        latest[i] = out
        for c in out.outputs:
            idx = i * req.n + c.index
            echo_text = p.prompt_texts[i] if req.echo else ""
            st = states.setdefault(idx, _ChoiceState(offset=len(echo_text)))
            if st.done:
                continue
            new_ids = c.token_ids[st.tokens_sent:]
            finished = c.finish_reason is not None
            echo_now = req.echo and not st.started
            if not new_ids and not finished and not echo_now:
                continue
            # The detokenizer only releases prefix-stable text, so a slice is the delta.
            text = (echo_text if echo_now else "") + c.text[st.text_sent:]
            logprobs = None
            if req.logprobs is not None:
                new_lp = (c.logprobs or [])[st.tokens_sent:st.tokens_sent + len(new_ids)]
                logprobs = legacy_logprobs(new_ids, new_lp, p.tokenizer, st.offset)
                if logprobs.tokens:
                    st.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if echo_now and out.prompt_logprobs is not None:
                    logprobs = _concat(legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs, p.tokenizer, 0),
                                       logprobs)
            st.started, st.done = True, finished
            st.text_sent, st.tokens_sent = max(st.text_sent, len(c.text)), len(c.token_ids)
            yield frame.chunk({"index": idx, "text": text,
                               "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                               "finish_reason": c.finish_reason if finished else None,
                               "stop_reason": c.stop_reason if finished else None}, list(latest.values()))
    if (usage := frame.usage_chunk([latest[i] for i in sorted(latest)])) is not None:
        yield usage
