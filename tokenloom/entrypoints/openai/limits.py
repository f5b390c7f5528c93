"""What one request may cost the server, and the checks that hold it to that.

A request's cost is not only its tokens: every stop string is searched for after every
generated token (on the engine thread, which all requests share), every prompt in a list
becomes its own engine request, a `logit_bias` entry is a tensor write per step, and the
body itself is read into memory before anything else happens.  Each such cost has a limit
here, set by a `tokenloom serve` flag, with a default generous enough for real clients
(lm-eval-harness, the openai SDK, chat UIs) and small enough that one request cannot
occupy the engine for everyone.  Breaking a limit is a 400 naming the field (413 for the
body, by `BodySizeLimitMiddleware` in body_limit.py), decided by counting -- before any
per-token work is done.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

# No FastAPI at import time: the CLI builds its parser from this module (`tokenloom --help`
# should not pay for the web stack); the checks import the error helpers when they run.


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the HTTP server (see `add_limit_args` for the flags)."""

    max_request_body_bytes: int = 10 * 2**20
    max_prompts_per_request: int = 256
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_logit_bias: int = 1024
    max_n: int = 128
    max_queued_requests: int | None = 1024  # None: no cap
    trust_request_chat_template: bool = False
    # Stalled readers (engine/async_engine.py StallPolicy; docs/reliability.md): a stream whose
    # client leaves this many tokens of one sequence unread is paused (0: never paused), and
    # aborted after `stalled_stream_timeout` seconds paused; `max_unsent_bytes` bounds what a
    # connection holds unsent, so that a stalled client blocks its stream early (unsent_bound.py).
    max_unread_stream_tokens: int = 64
    stalled_stream_timeout: float = 60.0
    max_unsent_bytes: int = 16384
    # /tokenize counts texts longer than the context (lm-eval-harness cuts documents into
    # windows), up to this many tokens or max_model_len if larger; a text that certainly has
    # more is refused by its length, before it is tokenized (engine/prompt_bound.py).
    max_tokenize_tokens: int = 131072
    # Grammar compilation (structured output, tool_choice "required"/named) runs in killable
    # worker processes (structured/compile_pool.py): each compile is held to a time limit, at
    # most this many run at once (one core each), and the compiled grammars kept are bounded in bytes.
    max_grammar_compile_seconds: float = 10.0
    max_concurrent_grammar_compiles: int = field(default_factory=lambda: default_grammar_compiles())
    max_grammar_cache_bytes: int = 128 * 2**20

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerLimits":
        """The limits from parsed `serve` flags; ValueError names a flag whose value is impossible."""
        limits = cls(
            max_request_body_bytes=args.max_request_body_bytes,
            max_prompts_per_request=args.max_prompts_per_request,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_logit_bias=args.max_logit_bias,
            max_n=args.max_n,
            max_queued_requests=None if args.max_queued_requests is None or args.max_queued_requests < 0
            else args.max_queued_requests,
            trust_request_chat_template=args.trust_request_chat_template,
            max_unread_stream_tokens=getattr(args, "max_unread_stream_tokens", cls.max_unread_stream_tokens),
            stalled_stream_timeout=getattr(args, "stalled_stream_timeout", cls.stalled_stream_timeout),
            max_unsent_bytes=getattr(args, "max_unsent_bytes", cls.max_unsent_bytes),
            max_tokenize_tokens=getattr(args, "max_tokenize_tokens", cls.max_tokenize_tokens),
            max_grammar_compile_seconds=getattr(args, "max_grammar_compile_seconds", cls.max_grammar_compile_seconds),
            max_concurrent_grammar_compiles=getattr(args, "max_concurrent_grammar_compiles",
                                                    default_grammar_compiles()),
            max_grammar_cache_bytes=getattr(args, "max_grammar_cache_bytes", cls.max_grammar_cache_bytes),
        )
        if not limits.max_grammar_compile_seconds > 0:
            raise ValueError(f"--max-grammar-compile-seconds must be > 0, got {limits.max_grammar_compile_seconds}")
        if not limits.stalled_stream_timeout > 0:
            raise ValueError(f"--stalled-stream-timeout must be > 0, got {limits.stalled_stream_timeout}")
        for flag, value in (("--max-request-body-bytes", limits.max_request_body_bytes),
                            ("--max-prompts-per-request", limits.max_prompts_per_request),
                            ("--max-tokenize-tokens", limits.max_tokenize_tokens),
                            ("--max-concurrent-grammar-compiles", limits.max_concurrent_grammar_compiles),
                            ("--max-n", limits.max_n)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, value in (("--max-stop-strings", limits.max_stop_strings),
                            ("--max-stop-string-chars", limits.max_stop_string_chars),
                            ("--max-unread-stream-tokens", limits.max_unread_stream_tokens),
                            ("--max-unsent-bytes", limits.max_unsent_bytes),
                            ("--max-grammar-cache-bytes", limits.max_grammar_cache_bytes),
                            ("--max-logit-bias", limits.max_logit_bias)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        return limits


def default_grammar_compiles() -> int:
    """Half the cores, 1 to 4: compilation never takes the cores the engine decodes on."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = p.add_argument_group("per-request limits (each answered with a 400 naming the field; the body with 413)")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help=f"largest request body accepted (default {d.max_request_body_bytes})")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help=f"prompts in one /v1/completions request (default {d.max_prompts_per_request})")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help=f"stop strings per request (default {d.max_stop_strings})")
    g.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
                   help=f"characters in one stop string (default {d.max_stop_string_chars})")
    g.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias,
                   help=f"entries in logit_bias (default {d.max_logit_bias})")
    g.add_argument("--max-n", type=int, default=d.max_n, help=f"samples per prompt, `n` (default {d.max_n})")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help=f"answer 429 when this many sequences already wait to be scheduled "
                        f"(default {d.max_queued_requests}; a negative value: no cap)")
    g.add_argument("--max-tokenize-tokens", type=int, default=d.max_tokenize_tokens,
                   help=f"most tokens /tokenize counts in one text, or max_model_len if larger "
                        f"(default {d.max_tokenize_tokens})")
    g.add_argument("--max-grammar-compile-seconds", type=float, default=d.max_grammar_compile_seconds,
                   help=f"stop compiling a request's grammar (JSON schema, regex, EBNF, tool schema) after this long "
                        f"and answer 400 (default {d.max_grammar_compile_seconds:g})")
    g.add_argument("--max-concurrent-grammar-compiles", type=int, default=d.max_concurrent_grammar_compiles,
                   help=f"grammar compile worker processes (one core each); a request waits for one at most "
                        f"--max-grammar-compile-seconds, then gets 429 (default here "
                        f"{d.max_concurrent_grammar_compiles}: half the cores, at most 4)")
    g.add_argument("--max-grammar-cache-bytes", type=int, default=d.max_grammar_cache_bytes,
                   help=f"bytes of compiled grammars kept for reuse, least recently used dropped first "
                        f"(default {d.max_grammar_cache_bytes})")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="honour a `chat_template` sent in a request (refused by default: a template is code, "
                        "and rendering it runs on this server)")
    g.add_argument("--max-unread-stream-tokens", type=int, default=d.max_unread_stream_tokens,
                   help=f"pause a stream (out of the batch, KV kept) while its client leaves this many tokens of a "
                        f"sequence unread; resumed when it reads (default {d.max_unread_stream_tokens}; 0: never pause)")
    g.add_argument("--stalled-stream-timeout", type=float, default=d.stalled_stream_timeout,
                   help=f"abort a stream paused this many seconds, freeing its KV cache "
                        f"(default {d.stalled_stream_timeout:g})")
    g.add_argument("--max-unsent-bytes", type=int, default=d.max_unsent_bytes,
                   help=f"bytes a connection may hold unsent, in the kernel (TCP_NOTSENT_LOWAT) and in the server's "
                        f"write buffer each, so that a client that stops reading blocks its stream after kilobytes, "
                        f"not megabytes (default {d.max_unsent_bytes}; 0: the kernel's and asyncio's defaults)")


def check_sampling_limits(limits: ServerLimits, *, n: int, stop: str | list[str] | None,
                          logit_bias: dict[str, float] | None, token_lists: dict[str, list[int] | None],
                          vocab_size: int) -> None:
    """Counts and lengths first: none of these loops over more than the limit allows."""
    from tokenloom.entrypoints.openai.errors import bad_request

    if n > limits.max_n:
        raise bad_request(f"n must be <= {limits.max_n}, got {n}", param="n", code="limit_exceeded")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)} "
                          f"(--max-stop-strings)", param="stop", code="limit_exceeded")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(f"a stop string may have at most {limits.max_stop_string_chars} characters, got one of "
                          f"{longest} (--max-stop-string-chars)", param="stop", code="limit_exceeded")
    if logit_bias is not None and len(logit_bias) > limits.max_logit_bias:
        raise bad_request(f"logit_bias may have at most {limits.max_logit_bias} entries, got {len(logit_bias)} "
                          f"(--max-logit-bias)", param="logit_bias", code="limit_exceeded")
    for param, ids in token_lists.items():
        # More entries than the vocabulary has tokens can only be repeats: refused before any
        # per-id work (a mask or a set) is built from them.
        if ids is not None and len(ids) > vocab_size:
            raise bad_request(f"{param} may have at most {vocab_size} entries (the vocabulary size), got {len(ids)}",
                              param=param, code="limit_exceeded")


def check_prompt_count(limits: ServerLimits, count: int) -> None:
    from tokenloom.entrypoints.openai.errors import bad_request

    if count > limits.max_prompts_per_request:
        raise bad_request(f"at most {limits.max_prompts_per_request} prompts are allowed per request, got {count} "
                          f"(--max-prompts-per-request)", param="prompt", code="limit_exceeded")
