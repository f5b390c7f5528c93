"""POST /v1/chat/completions: messages -> chat template -> token ids -> the engine.

The template is the tokenizer's (or `--chat-template`); a request's own `chat_template` is
refused unless the server runs with `--trust-request-chat-template`, since a template is a
program the server would run.  Rendering happens here, on the request, in a worker thread
(a slow template stalls no stream), so a template error is a 400 for this request alone.
Streaming follows OpenAI: each choice's first chunk carries `delta.role`, later ones
`delta.content`, the last one `finish_reason`; with `stream_options.include_usage` a final
chunk with empty `choices` carries the usage.  Text held back because it may be a tool call
sends no chunk until it is known (OpenAI's deltas carry `content: null`, never runs of "").
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, AsyncIterator, Literal, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_engine import RequestStream
from tokenloom.engine.detokenizer import TokenTexts
from tokenloom.entrypoints.openai.errors import OpenAIError, bad_request, output_cut_off, sse_error
from tokenloom.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatLogprobs, ChatMessage, ChatResponseMessage,
                                                   ChatTokenLogprob, TopLogprob)
from tokenloom.entrypoints.openai.serving_common import (ChunkFrame, ServingContext, SSEResponse, abort_all,
                                                         add_requests, check_request, collect_final, compile_grammar,
                                                         encode_text, finite_logprob, make_usage, merge_streams, new_id,
                                                         off_loop, sampling_params, sse_body, structured_outputs,
                                                         validate_prompt)
from tokenloom.entrypoints.openai.reasoning_parsers import ReasoningParser
from tokenloom.entrypoints.openai.tool_calls import ToolPlan, constrained_calls, plan_tools
from tokenloom.entrypoints.openai.tool_parsers import get_parser, parser_for_template
from tokenloom.outputs import PositionLogprobs, RequestOutput

logger = logging.getLogger("tokenloom.server")
_noted_auto_as_text: set[str] = set()  # the templates already named in the log


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a plain string."""
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported, got type "
                                  f"{part.get('type')!r}", param=f"messages.{i}.content", code="unsupported")
            texts.append(part["text"])
        content = "\n".join(texts)
    d["content"] = content if content is not None else ""
    if isinstance(d.get("tool_calls"), list):
        d["tool_calls"] = [_template_tool_call(tc) for tc in d["tool_calls"]]
    return d


def _template_tool_call(tc: Any) -> Any:
    """An earlier assistant tool call as templates expect it: OpenAI sends `arguments` as
    JSON text, templates (Llama 3.1's, Qwen2.5's) print it with `tojson`, which wants the object."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**tc, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return tc


@lru_cache(maxsize=8)
def _reserved_kwargs(tokenizer_type: type) -> frozenset[str]:
    """apply_chat_template's own parameters: a request may not set them through
    chat_template_kwargs (tokenize=False, a template smuggled in, ...)."""
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return frozenset(name for name, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def check_chat_template_request(ctx: ServingContext, chat_template: str | None,
                                template_kwargs: dict[str, Any] | None) -> None:
    """400 for a request-supplied template (unless trusted) or a reserved template kwarg."""
    if chat_template is not None and not ctx.limits.trust_request_chat_template:
        raise bad_request("a request may not supply its own chat_template on this server (start it with "
                          "--trust-request-chat-template to allow it)", param="chat_template", code="not_allowed")
    if template_kwargs:
        reserved = _reserved_kwargs(type(ctx.engine.tokenizer)) | {"messages", "chat_template"}
        clash = sorted(k for k in template_kwargs if k in reserved)
        if clash:
            raise bad_request(f"chat_template_kwargs may only hold template variables; {', '.join(clash)} "
                              f"cannot be set this way", param="chat_template_kwargs")


def render_messages(ctx: ServingContext, messages: Sequence[ChatMessage], *, chat_template: str | None,
                    add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    route: Literal["generate", "tokenize"] = "generate") -> list[int]:
    """Messages -> prompt token ids; every failure is a 400.  Blocking (a template render and
    a tokenizer): call it through `off_loop`.  `tools` go to the template as transformers'
    `apply_chat_template(tools=...)` gives them.  The rendered text is tokenized as transformers
    would (no special tokens added), unless its length alone shows it cannot fit the limit of
    `route` (`serving_common.encode_text`): a huge conversation is refused before tokenizing."""
    check_chat_template_request(ctx, chat_template, template_kwargs)
    msgs = [_message_dict(m, i) for i, m in enumerate(messages)]
    tok = ctx.engine.tokenizer
    if chat_template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template, so /v1/chat/completions cannot format messages; "
                          "start the server with --chat-template FILE, or use /v1/completions",
                          param="messages", code="missing_chat_template")
    try:
        # Extra template variables: vLLM's chat_template_kwargs, e.g. enable_thinking.
        text = tok.apply_chat_template(msgs, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                       tokenize=False, tools=tools, **(template_kwargs or {}))
    except Exception as e:  # jinja errors (raise_exception in templates), bad kwargs, ...
        raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                          param="messages", code="chat_template_error") from None
    return encode_text(ctx, text, add_special_tokens=False, param="messages", route=route)


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int,
                  texts: TokenTexts, last: bool = False) -> ChatLogprobs:
    """Chat-format logprobs: per token its text, bytes, logprob and the `top_n` likeliest.

    Each token's text is what it adds in context (`TokenTexts`: SentencePiece tokens keep
    their leading space; the tokens' texts join up to the message), the alternatives' what
    they would have added there.  `texts` walks one choice's tokens across stream chunks;
    `last`: this is the choice's final piece (text still held goes to its last token)."""
    content = []
    for i, (tok, pos) in enumerate(zip(token_ids, positions)):
        chosen = pos.get(tok)
        tops = sorted(((t, v) for t, v in pos.items() if v.rank is not None and v.rank <= top_n),
                      key=lambda tv: tv[1].rank)[:top_n]
        text, alts = texts.next(tok, [t for t, _ in tops])
        if last and i == len(token_ids) - 1:
            text += texts.finish()
        top_list = []
        for t, v in tops:
            s = text if t == tok else alts[t]
            top_list.append(TopLogprob(token=s, logprob=finite_logprob(v.logprob), bytes=list(s.encode("utf-8"))))
        content.append(ChatTokenLogprob(token=text, logprob=finite_logprob(chosen.logprob) if chosen else -9999.0,
                                        bytes=list(text.encode("utf-8")), top_logprobs=top_list))
    return ChatLogprobs(content=content)


def _texts(p: "_Prepared", out: RequestOutput) -> TokenTexts:
    """A walker over one choice's tokens, in the context of the rendered prompt."""
    return TokenTexts(p.tokenizer, out.prompt_token_ids, p.req.skip_special_tokens)


@dataclass
class _Prepared:
    request_id: str
    model: str
    req: ChatCompletionRequest
    top_n: int | None  # None: no logprobs
    tokenizer: Any
    tools: ToolPlan
    parser_name: str | None = None
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the answer is what follows the thinking
    inside: bool | None = None  # where the output starts (ReasoningTags.starts_inside)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, answer text) of a choice's text; the answer is "" where there is none yet."""
        if self.reasoning is None:
            return None, text
        reasoning, answer = self.reasoning.split(text, self.inside, final=final)
        return reasoning, answer or ""


def _render_and_validate(ctx: ServingContext, req: ChatCompletionRequest, params: Any,
                         tools: list[dict[str, Any]] | None) -> list[int]:
    ids = render_messages(ctx, req.messages, chat_template=req.chat_template,
                          add_generation_prompt=req.add_generation_prompt, template_kwargs=req.chat_template_kwargs,
                          tools=tools)
    try:
        return validate_prompt(ctx, ids, params, param="messages")[1]
    except OpenAIError as e:  # name the limit the client sent, as it spelled it
        if e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.param = "max_completion_tokens"
        raise


def _have_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def tool_call_parser(ctx: ServingContext, chat_template: str | None) -> str | None:
    """`--tool-call-parser`, or else the one for the chat template's family (None: no parser
    fits, and tool_choice "auto" answers in text)."""
    if ctx.tool_call_parser is not None:
        return ctx.tool_call_parser
    template = chat_template if chat_template is not None else getattr(ctx.engine.tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: any of them may be the tool one
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    return parser_for_template(template if isinstance(template, str) else None)


def _note_auto_as_text(template: str) -> None:
    """Say once per template, in the server log, why tool_choice "auto" answers in text."""
    if template in _noted_auto_as_text or len(_noted_auto_as_text) > 64:
        return
    _noted_auto_as_text.add(template)
    logger.warning("tool_choice \"auto\": no tool-call parser fits this chat template, so answers are text and "
                   "the tools are left out of the prompt; start the server with --tool-call-parser to read calls")


async def _prepare(ctx: ServingContext, req: ChatCompletionRequest,
                   raw: Request) -> tuple[_Prepared, list[RequestStream]]:
    lora = check_request(ctx, req)
    check_chat_template_request(ctx, req.chat_template, req.chat_template_kwargs)
    parser_name = tool_call_parser(ctx, req.chat_template) if req.tools else None
    plan = plan_tools(req.tools, req.tool_choice, parser_name, req.parallel_tool_calls)
    if req.tools and plan.mode == "none" and req.tool_choice != "none":
        _note_auto_as_text(req.chat_template or "the server's chat template")
    if plan.constraint is not None and structured_outputs(req)[0] is not None:
        raise bad_request("tool_choice \"required\" or a named function constrains the output already; "
                          f"drop {structured_outputs(req)[1]}", param="tool_choice")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if top_n is not None and not 0 <= top_n <= 20:
        raise bad_request(f"top_logprobs must be in [0, 20], got {top_n}", param="top_logprobs")
    params = sampling_params(req, max_tokens=max_tokens, logprobs=top_n, prompt_logprobs=req.prompt_logprobs)
    if plan.constraint is not None:
        params.structured_outputs = plan.constraint
    if ctx.reasoning is not None:  # a grammar then waits for the thinking to end
        params.reasoning_tags = ctx.reasoning.tags
    ids = await off_loop(_render_and_validate, ctx, req, params, plan.template_tools)
    # A function's parameters that are not a usable JSON schema are the tools' fault; a
    # missing xgrammar is not: then the tool_choice asked for what this environment cannot do.
    tools_param = ("tools" if _have_xgrammar() else "tool_choice") if plan.constraint is not None else None
    await compile_grammar(ctx, req, params, raw, param=tools_param)
    rid = new_id("chatcmpl")
    streams = add_requests(ctx, rid, [(None, ids)], params, priority=req.priority, cache_salt=req.cache_salt,
                           lora_request=lora)
    return _Prepared(rid, req.model or ctx.model_name, req, top_n, ctx.engine.tokenizer, plan, parser_name,
                     ctx.reasoning, ctx.reasoning.starts_inside(ids) if ctx.reasoning is not None else None), streams


def _answer(p: _Prepared, text: str, finish_reason: str | None,
            num_tokens: int = 0) -> tuple[str | None, list[dict] | None, str | None]:
    """A finished choice's (content, tool_calls, finish_reason): tool calls read from the
    constrained document or, for tool_choice "auto", from the model's own format.

    `required` / a named function never answer without a call (OpenAI's contract, which
    LangChain's `tool_choice="any"` relies on): when max_tokens cut the document, the calls
    finished before the cut are the answer (`finish_reason` "length"), and if there are none
    the request fails with OpenAI's "could not finish the message" 400 (`output_cut_off`)."""
    plan = p.tools
    if plan.constraint is not None:
        if finish_reason not in ("stop", "length"):  # aborted: nothing to read
            return text, None, finish_reason
        calls, complete = constrained_calls(plan, text)
        if not calls:
            if finish_reason == "length" or not complete:
                req = p.req
                raise output_cut_off("max_completion_tokens" if req.max_completion_tokens is not None
                                     else "max_tokens", num_tokens, explicit=req.max_completion_tokens is not None
                                     or req.max_tokens is not None)
            raise OpenAIError(500, "the constrained tool-call answer held no call", code="internal_error")
        return None, [c.to_openai() for c in calls], "tool_calls" if complete else "length"
    if plan.mode == "auto" and p.parser_name and finish_reason in ("stop", "length"):
        content, calls = get_parser(p.parser_name).parse(text, plan.names)
        if calls:
            return content, [c.to_openai() for c in calls], "tool_calls"
    return text, None, finish_reason


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    p, streams = await _prepare(ctx, req, raw)
    if req.stream:
        return SSEResponse(sse_body(ctx, streams, _stream(ctx, p, streams)), on_close=lambda: abort_all(ctx, streams))
    finals = await collect_final(ctx, streams, raw)
    if finals is None:
        return JSONResponse({}, status_code=499)
    out = finals[0]
    choices = []
    for c in out.outputs:
        logprobs = None
        if p.top_n is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], p.top_n, _texts(p, out), last=True)
        reasoning, text = p.split(c.text)
        content, tool_calls, reason = _answer(p, text, c.finish_reason, len(c.token_ids))
        if reasoning is not None and not content and not tool_calls:
            content = None  # the thinking was all there is (cut off before its end)
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls)
        choices.append(ChatChoice(index=c.index, message=message,
                                  logprobs=logprobs, finish_reason=reason, stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=p.request_id, model=p.model, choices=choices, usage=make_usage(finals))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServingContext, p: _Prepared, streams: list[RequestStream]) -> AsyncIterator[str]:
    req = p.req
    frame = ChunkFrame(p.request_id, "chat.completion.chunk", p.model, req.stream_options)
    text_sent: dict[int, int] = {}
    reasoning_sent: dict[int, int] = {}
    tokens_sent: dict[int, int] = {}
    done: set[int] = set()
    latest: list[RequestOutput] = []
    walkers: dict[int, TokenTexts] = {}
    # Tool calls: a constrained answer streams no content; each call goes out whole as soon as
    # it is complete (for `required`, as each array item closes; a call is never sent half
    # written, so one that max_tokens cuts off is never sent at all).  With tool_choice "auto"
    # the text that may begin a call is held back.
    calls_sent: dict[int, int] = {}
    plan = p.tools
    parser = get_parser(p.parser_name) if plan.mode == "auto" and p.parser_name else None
    hold_all = plan.constraint is not None
    # The role comes first, before any token exists: clients show "assistant is typing".  A
    # constrained tool call has no content at all: null, as OpenAI sends it.
    for j in range(req.n):
        text_sent[j] = tokens_sent[j] = calls_sent[j] = reasoning_sent[j] = 0
        yield frame.chunk({"index": j, "delta": {"role": "assistant", "content": None if hold_all else ""},
                           "logprobs": None, "finish_reason": None}, latest)
    async for _, out in merge_streams(streams):
        latest = [out]
        for c in out.outputs:
            j = c.index
            if j in done:
                continue
            new_ids = c.token_ids[tokens_sent[j]:]
            finished = c.finish_reason is not None
            if not new_ids and not finished:
                continue
            # With --reasoning-parser the thinking goes out as reasoning_content (all but a tail
            # that may be the end tag) and everything below works on the answer after it.
            reasoning, text = p.split(c.text, final=finished)
            delta: dict[str, Any] = {}
            if reasoning is not None and len(reasoning) > reasoning_sent[j]:
                delta["reasoning_content"] = reasoning[reasoning_sent[j]:]
                reasoning_sent[j] = len(reasoning)
            visible = len(text)
            if not finished and hold_all:
                visible = text_sent[j]
            elif not finished and parser is not None:
                visible = max(text_sent[j], parser.safe_prefix(text))
            reason = c.finish_reason if finished else None
            if not finished and plan.mode == "required":
                ready = constrained_calls(plan, text)[0][calls_sent[j]:]
                if ready:
                    delta["tool_calls"] = [call.to_openai(calls_sent[j] + k) for k, call in enumerate(ready)]
                    calls_sent[j] += len(ready)
            if finished and (hold_all or parser is not None):
                try:
                    content, tool_calls, reason = _answer(p, text, c.finish_reason, len(c.token_ids))
                except OpenAIError as e:  # the status is 200 already: the error goes in the stream
                    yield sse_error(e)
                    return
                if tool_calls is not None:
                    # the content before the calls, less what was streamed; then the calls
                    visible = text_sent[j] + len((content or "")[text_sent[j]:])
                    unsent = [{"index": k, **tc} for k, tc in enumerate(tool_calls) if k >= calls_sent[j]]
                    if unsent:
                        delta["tool_calls"] = unsent
            delta_text = text[text_sent[j]:visible]
            logprobs = None
            if p.top_n is not None:
                new_lp = (c.logprobs or [])[tokens_sent[j]:tokens_sent[j] + len(new_ids)]
                texts = walkers.setdefault(j, _texts(p, out))
                logprobs = chat_logprobs(new_ids, new_lp, p.top_n, texts, last=finished).model_dump(mode="json")
            text_sent[j], tokens_sent[j] = max(text_sent[j], visible), len(c.token_ids)
            if finished:
                done.add(j)
            held = (hold_all or parser is not None) and not delta_text
            if held and not finished and logprobs is None and not delta:
                continue  # nothing to say yet: the text so far may be (or is) a tool call
            if p.reasoning is not None and not (finished or delta_text or delta or logprobs is not None):
                continue  # nothing to say yet: the text so far may be a tag
            if delta_text or not (finished or delta or held):
                delta = {"content": delta_text, **delta}
            elif "tool_calls" in delta or (held and not finished):
                delta = {"content": None, **delta}
            yield frame.chunk({"index": j, "delta": delta,
                               "logprobs": logprobs, "finish_reason": reason,
                               "stop_reason": c.stop_reason if finished else None}, latest)
    if (usage := frame.usage_chunk(latest)) is not None:
        yield usage
