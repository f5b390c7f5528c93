"""POST /v1/completions: legacy text completions, whole or streamed as SSE.

A request may carry several prompts (strings or token-id lists); each becomes one engine
request of `n` samples, and choice `index = prompt_index * n + sample_index`, as OpenAI does.
Streaming turns the engine's cumulative outputs into deltas: per choice we remember how
much text and how many tokens were already sent.

`max_tokens: 0` with `echo` scores the prompt (lm-eval-harness's loglikelihood recipe): the
engine runs the prompt and generates one token, which is dropped, so the answer is the
prompt itself with its logprobs and `completion_tokens` is 0.

`use_beam_search: true` (vLLM's extension) searches `n` beams per prompt and returns the
`n` best sequences, best first, scored as transformers scores them with `length_penalty`
(docs/beam-search.md).  Settings beam search cannot honour -- logprobs, echo, stop strings
and ids, penalties, biases, output constraints, min_tokens -- are a 400 naming the field
(`openapi_limits.BEAM_SEARCH_DEFAULTS`); the sampling knobs (temperature, top_p, top_k,
min_p, seed) have nothing to act on and are ignored, as in vLLM.  The result arrives
whole, also when streamed (one chunk per choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_engine import RequestStream
from tokenloom.engine.detokenizer import TokenTexts
from tokenloom.entrypoints.openai.errors import OpenAIError, bad_request
from tokenloom.entrypoints.openai.limits import check_prompt_count
from tokenloom.entrypoints.openai.openapi_limits import BEAM_SEARCH_DEFAULTS
from tokenloom.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                   CompletionResponse)
from tokenloom.entrypoints.openai.serving_common import (ChunkFrame, ServingContext, SSEResponse, abort_all,
                                                         add_requests, check_prompt_bound, check_request, collect_final,
                                                         compile_grammar, finite_logprob, make_usage, merge_streams,
                                                         new_id, off_loop,
                                                         sampling_params, sse_body, validate_prompt)
from tokenloom.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenloom.request import LoRARequest
from tokenloom.sampling_params import BeamSearchParams, SamplingParamError, SamplingParams


def _split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def legacy_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], texts: TokenTexts,
                    offset: int, final: bool = False) -> CompletionLogprobs:
    """OpenAI's completions logprobs (parallel lists) for `token_ids`; text offsets start at `offset`.

    Each token's string is the text it adds in context (`texts` walks the sequence, and
    gets the last token the text still held back when `final`), so the strings concatenate
    to the choice's text and `text_offset` indexes it: SentencePiece's "▁there" is " there"."""
    lp = CompletionLogprobs()
    for k, (tok, pos) in enumerate(zip(token_ids, positions)):
        text, alt_texts = texts.next(tok, pos or ())
        if final and k == len(token_ids) - 1:
            text += texts.finish()
        lp.tokens.append(text)
        if pos is None:  # the first prompt token has no logprob: nothing predicted it
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            chosen = pos.get(tok)
            lp.token_logprobs.append(finite_logprob(chosen.logprob) if chosen is not None else None)
            top: dict[str, float] = {}
            # Several tokens can print the same (the bytes of one character are "" until the
            # last); the chosen token keeps its key, then the likelier one.
            for t, v in sorted(pos.items(), key=lambda tv: (tv[0] != tok, -tv[1].logprob)):
                top.setdefault(text if t == tok else alt_texts[t], finite_logprob(v.logprob))
            lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def _answer_texts(p: "_Prepared", out: RequestOutput) -> TokenTexts:
    """Token strings of a choice: its tokens after its prompt, as the engine detokenized them."""
    return TokenTexts(p.tokenizer, out.prompt_token_ids, p.req.skip_special_tokens)


def _prompt_texts(p: "_Prepared", out: RequestOutput) -> TokenTexts:
    """Token strings of an echoed prompt: a string prompt echoes as typed (a BOS the tokenizer
    added prints nothing); a token-id prompt as decoded, special tokens included."""
    return TokenTexts(p.tokenizer, [], skip_special_tokens=out.prompt is not None)


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
    score_only: bool = False  # max_tokens 0 with echo: the one generated token is not reported

    def outputs(self, out: RequestOutput) -> list[CompletionOutput]:
        """The choices to report: as generated, or (scoring) without the generated token."""
        if not self.score_only:
            return list(out.outputs)
        return [CompletionOutput(index=c.index, text="", token_ids=[], finish_reason="length", logprobs=[])
                for c in out.outputs]


@dataclass
class _ChoiceState:
    """How much of one choice a stream has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    offset: int = 0  # text_offset of the next token
    started: bool = False
    done: bool = False
    texts: TokenTexts | None = None  # walks the choice's tokens for their logprob strings


def _tokenize_all(ctx: ServingContext, prompts: list[str | list[int]], params: SamplingParams,
                  req: CompletionRequest) -> tuple[list[tuple[str | None, list[int]]], list[str]]:
    """Token ids and echo text of every prompt (blocking: runs in a worker thread).  Every
    prompt is checked before any is queued, so a bad one in a list leaves nothing behind."""
    tok = ctx.engine.tokenizer
    for p in prompts:  # every text's length first: a batch with one huge prompt is refused before any tokenizing
        if isinstance(p, str):
            check_prompt_bound(ctx, p)
    out: list[tuple[str | None, list[int]]] = []
    texts: list[str] = []
    for p in prompts:
        if isinstance(p, str):
            ids = tok.encode(p, add_special_tokens=req.add_special_tokens)
            _, ids = validate_prompt(ctx, ids, params)
            out.append((p, ids))
            texts.append(p)
        else:
            _, ids = validate_prompt(ctx, p, params)
            out.append((None, ids))
            texts.append(tok.decode(ids) if req.echo else "")
    return out, texts


async def _prepare(ctx: ServingContext, req: CompletionRequest,
                   raw: Request | None = None) -> tuple[_Prepared, list[RequestStream]]:
    lora = check_request(ctx, req)
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported by this server", param="best_of",
                          code="unsupported")
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise bad_request("max_tokens may be 0 only with echo=true (scoring the prompt)", param="max_tokens")
    single = _split_prompts(req.prompt)
    check_prompt_count(ctx.limits, len(single))
    if req.use_beam_search:
        return await _prepare_beams(ctx, req, single, lora)
    echo_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
    prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else echo_lp
    params = sampling_params(req, max_tokens=1 if score_only else req.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=prompt_lp)
    prompts, texts = await off_loop(_tokenize_all, ctx, single, params, req)
    await compile_grammar(ctx, req, params, raw)  # stopped if the client leaves meanwhile
    rid = new_id("cmpl")
    streams = add_requests(ctx, rid, prompts, params, priority=req.priority, cache_salt=req.cache_salt,
                           lora_request=lora)
    return _Prepared(rid, req.model or ctx.model_name, texts, req, ctx.engine.tokenizer, score_only), streams


async def _prepare_beams(ctx: ServingContext, req: CompletionRequest, single: list[str | list[int]],
                         lora: LoRARequest | None = None) -> tuple[_Prepared, list[RequestStream]]:
    """use_beam_search: one beam search per prompt, `n` beams each (see the module docstring),
    on the LoRA adapter the request's model names, if any."""
    for name, default in BEAM_SEARCH_DEFAULTS.items():
        if getattr(req, name) != default or (default is None) != (getattr(req, name) is None):
            raise bad_request(f"{name} cannot be used with use_beam_search", param=name, code="unsupported_value")

    def params_for(max_tokens: int) -> BeamSearchParams:
        try:
            return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                    length_penalty=req.length_penalty)
        except SamplingParamError as e:
            raise bad_request(str(e), param="n" if e.param == "beam_width" else e.param) from None

    def work() -> tuple[list[tuple[str | None, list[int]]], list[BeamSearchParams]]:
        # each prompt tokenized and checked with the search it gets (max_tokens null: up to max_model_len)
        prompts, _ = _tokenize_all(ctx, single, params_for(1), req)
        params = [params_for(req.max_tokens or ctx.engine.max_model_len - len(ids)) for _, ids in prompts]
        for (_, ids), bp in zip(prompts, params):
            validate_prompt(ctx, ids, bp)
        return prompts, params

    try:
        prompts, params = await off_loop(work)
    except OpenAIError as e:
        if e.param == "beam_width":  # the width is the request's n
            e.param = "n"
        raise
    rid = new_id("cmpl")
    streams = add_requests(ctx, rid, prompts, params, priority=req.priority, cache_salt=req.cache_salt,
                           lora_request=lora)
    return _Prepared(rid, req.model or ctx.model_name, [""] * len(prompts), req, ctx.engine.tokenizer), streams


def _jsonable_prompt_logprobs(out: RequestOutput) -> list | None:
    if out.prompt_logprobs is None:
        return None
    return [None if pos is None else {t: {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                      for t, v in pos.items()}
            for pos in out.prompt_logprobs]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    p, streams = await _prepare(ctx, req, raw)
    if req.stream:
        return SSEResponse(sse_body(ctx, streams, _stream(ctx, p, streams)), on_close=lambda: abort_all(ctx, streams))
    finals = await collect_final(ctx, streams, raw)
    if finals is None:  # the client is gone (its requests are aborted); nobody reads this
        return JSONResponse({}, status_code=499)
    choices: list[CompletionChoice] = []
    for i, out in enumerate(finals):
        echo_text = p.prompt_texts[i] if req.echo else ""
        for c in p.outputs(out):
            logprobs = None
            if req.logprobs is not None:
                logprobs = legacy_logprobs(c.token_ids, c.logprobs or [], _answer_texts(p, out), len(echo_text),
                                           final=True)
                if req.echo and out.prompt_logprobs is not None:
                    logprobs = _concat(legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                       _prompt_texts(p, out), 0, final=True), logprobs)
            choices.append(CompletionChoice(
                index=i * req.n + c.index, text=echo_text + c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=_jsonable_prompt_logprobs(out) if req.prompt_logprobs is not None else None))
    usage = make_usage(finals, completion_tokens=0 if p.score_only else None)
    resp = CompletionResponse(id=p.request_id, model=p.model, choices=choices, usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServingContext, p: _Prepared, streams: list[RequestStream]) -> AsyncIterator[str]:
    req = p.req
    frame = ChunkFrame(p.request_id, "text_completion", p.model, req.stream_options, score_only=p.score_only)
    states: dict[int, _ChoiceState] = {}
    latest: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        latest[i] = out
        for c in p.outputs(out):
            idx = i * req.n + c.index
            echo_text = p.prompt_texts[i] if req.echo else ""
            st = states.setdefault(idx, _ChoiceState(offset=len(echo_text)))
            if st.done:
                continue
            new_ids = c.token_ids[st.tokens_sent:]
            finished = out.finished if p.score_only else c.finish_reason is not None
            echo_now = req.echo and not st.started
            if not new_ids and not finished and not echo_now:
                continue
            # The detokenizer only releases prefix-stable text, so a slice is the delta.
            text = (echo_text if echo_now else "") + c.text[st.text_sent:]
            logprobs = None
            if req.logprobs is not None:
                new_lp = (c.logprobs or [])[st.tokens_sent:st.tokens_sent + len(new_ids)]
                if st.texts is None:
                    st.texts = _answer_texts(p, out)
                logprobs = legacy_logprobs(new_ids, new_lp, st.texts, st.offset, final=finished)
                if logprobs.tokens:
                    st.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if echo_now and out.prompt_logprobs is not None:
                    logprobs = _concat(legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                       _prompt_texts(p, out), 0, final=True), logprobs)
            st.started, st.done = True, finished
            st.text_sent, st.tokens_sent = max(st.text_sent, len(c.text)), len(c.token_ids)
            yield frame.chunk({"index": idx, "text": text,
                               "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                               "finish_reason": c.finish_reason if finished else None,
                               "stop_reason": c.stop_reason if finished else None}, list(latest.values()))
    if (usage := frame.usage_chunk([latest[i] for i in sorted(latest)])) is not None:
        yield usage
