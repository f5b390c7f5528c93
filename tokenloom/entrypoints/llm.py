"""The offline API, vLLM-shaped: `LLM(model, **engine_args).generate(prompts, params)`.

All prompts are submitted at once and the engine steps until every one is done —
continuous batching does the rest (the seed: "step1: A B C D / step2: A B C ...").
`LLM.beam_search` runs beam searches through the same loop, and `LLM(model,
runner="pooling").embed(prompts)` embeddings (docs/beam-search.md, docs/embeddings.md).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Sequence

from tqdm.auto import tqdm

from tokenloom.config import EngineArgs
from tokenloom.core.events import StepEvent
from tokenloom.engine.llm_engine import LLMEngine, PromptType
from tokenloom.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, EmbeddingOutput,
                               EmbeddingRequestOutput, RequestOutput)
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import LoRARequest
from tokenloom.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, observers: Iterable[Callable[[StepEvent], None]] = (), **kwargs: Any):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}; "
                            f"valid: {', '.join(sorted(EngineArgs.field_names() - {'model'}))}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args, observers)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop what runs beside this process (tensor-parallel workers); also done when the
        LLM is garbage-collected or the process exits."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def add_observer(self, fn: Callable[[StepEvent], None]) -> None:
        self.llm_engine.add_observer(fn)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        `lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the
        base model); needs `LLM(..., enable_lora=True)`.  Each adapter is read when first
        used (a missing or unsupported one raises here, before any prompt runs); prompts on
        different adapters and on the base model share the same steps.

        A failed request does not stop the others, and nothing is raised for it: its
        RequestOutput has finish_reason "error" and the reason in `RequestOutput.error`
        (check `out.error is not None`).  That holds for a prompt the engine refuses (too
        long for max_model_len, bad token ids) and for one that fails while it runs (its
        detokenizer, its sampling, or a failed forward pass of a step it was in; the
        tokens it produced until then are kept).  The other prompts produce exactly what
        they would have produced alone.

        Each call leaves the engine clean: if it is interrupted (an exception, Ctrl-C),
        its unfinished requests are aborted before the exception propagates, so nothing
        of this call runs or holds KV blocks in the next one."""
        self._require("generate", "generate")
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        self.llm_engine.grammars.precompile(sp.structured_outputs for sp in params)  # off the step loop, in parallel
        return self._run(prompts, params, use_tqdm, priority, cache_salt, _error_output, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (`out.outputs.embedding`), pooled as the model's
        sentence-transformers config says (docs/embeddings.md); needs `runner="pooling"`
        (the default for a checkpoint without an LM head).  A prompt the engine refuses
        comes back with `error` set and an empty embedding, as in `generate`.  `lora_request`
        as `generate` takes it."""
        self._require("pooling", "embed")
        prompts = _as_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = (list(pooling_params) if isinstance(pooling_params, Sequence)
                  else [pooling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, priority, None, _error_embedding, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search of each prompt (transformers' scoring: docs/beam-search.md); the
        `beam_width` best sequences of each, best first.  As in vLLM, a sequence's `tokens`
        and `text` include the prompt (`output_token_ids` / `output_text`: the generated
        part).  A prompt or setting the engine refuses raises ValueError (nothing of the call
        keeps running); a search that fails while it runs raises RuntimeError once the
        others are done.  `lora_request` as `generate` takes it."""
        self._require("generate", "beam_search")
        prompts = _as_list(prompts)
        outs = self._run(prompts, [params] * len(prompts), use_tqdm, None, None, _raise_refusal, lora_request)
        tok = self.get_tokenizer()
        results = []
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"beam search of request {out.request_id} failed: {out.error}")
            seqs = []
            for c in out.outputs:
                tokens = list(out.prompt_token_ids) + list(c.token_ids)
                score = c.cumulative_logprob / max(len(c.token_ids), 1) ** params.length_penalty
                seqs.append(BeamSearchSequence(tokens=tokens, cum_logprob=c.cumulative_logprob,
                                               text=tok.decode(tokens), output_token_ids=list(c.token_ids),
                                               output_text=c.text, score=score, finish_reason=c.finish_reason))
            results.append(BeamSearchOutput(sequences=seqs))
        return results

    def _require(self, runner: str, method: str) -> None:
        have = self.llm_engine.runner_type
        if have != runner:
            raise ValueError(f"LLM.{method} needs runner={runner!r}; this LLM was built with runner={have!r}")

    def _run(self, prompts: list[PromptType], params: list, use_tqdm: bool, priority: Sequence[int] | None,
             cache_salt: str | Sequence[str | None] | None, on_refused: Callable,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list:
        """Submit every prompt, step the engine until all are done; outputs in input order.
        `on_refused(request_id, prompt, message)`: the output of a prompt the engine refuses.
        `lora_request`: one adapter for all, or one (or None) per prompt; each is loaded first,
        so a missing or unsupported adapter raises before any prompt runs."""
        salts = list(cache_salt) if isinstance(cache_salt, (list, tuple)) else [cache_salt] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        engine = self.llm_engine
        for lr in dict.fromkeys(lr for lr in loras if lr is not None):
            if not isinstance(lr, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest (or a list of them), got {type(lr).__name__}")
            engine.add_lora(lr)
        ids: list[str] = []
        results: dict[str, Any] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                ids.append(rid)
                try:
                    engine.add_request(rid, p, sp, priority=priority[i] if priority else 0, cache_salt=salts[i],
                                       lora_request=loras[i])
                except ValueError as e:
                    results[rid] = on_refused(rid, p, e)
            bar.update(len(results))
            while len(results) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step(finished_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            engine.abort_request([r for r in ids if r not in results])  # no-op unless interrupted
        return [results[r] for r in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template (one conversation or a list of them),
        on a LoRA adapter as `generate` takes it."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": render_chat(self.get_tokenizer(), c, chat_template, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True) -> list[int]:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass --chat-template (or chat_template=...)")
    ids = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a text, a token-id list, a dict) or a sequence of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt_text(prompt: PromptType) -> str | None:
    return prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)


def _error_output(rid: str, prompt: PromptType, error: Exception) -> RequestOutput:
    out = RequestOutput(request_id=rid, prompt=_prompt_text(prompt), prompt_token_ids=[], prompt_logprobs=None,
                        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")], finished=True)
    out.error = str(error)
    return out


def _error_embedding(rid: str, prompt: PromptType, error: Exception) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(request_id=rid, outputs=EmbeddingOutput([]), prompt_token_ids=[], finished=True,
                                  prompt=_prompt_text(prompt), error=str(error))


def _raise_refusal(rid: str, prompt: PromptType, error: Exception):
    raise error
