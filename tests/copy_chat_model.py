"""A chat model whose answers a test chooses: the hand-wired copy model with think tags.

scripts/wire_copy_model.py writes an induction circuit into an ordinary LlamaForCausalLM
checkpoint (transformers' LlamaConfig + save_pretrained): the model continues its prompt with
what followed the last earlier occurrence of the prompt's end.  With the bundled ChatML
tokenizer, a conversation whose last assistant turn said A ends with
`<|im_start|>assistant\\n`, which occurred before A: so the model says A again, then
`<|im_end|>` (an EOS of the generation config).  `ask(A)` builds such a conversation.  The
tokenizer gets `<think>` and `</think>` as added (non-special) tokens, as Qwen3's and
DeepSeek-R1's have, so the reasoning parsers can be run on answers that think.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

from script_modules import load_script

THINK_TOKENS = ["<think>", "</think>"]


def make_copy_chat_model(out: Path) -> Path:
    wcm = load_script("wire_copy_model")
    args = wcm.parse_args(["--out", str(out)])
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tok.add_tokens(THINK_TOKENS)
    model = wcm.wire(args, len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    GenerationConfig(bos_token_id=tok.convert_tokens_to_ids("<|bos|>"), eos_token_id=eos,
                     pad_token_id=tok.convert_tokens_to_ids("<|pad|>")).save_pretrained(out)
    return out


def ask(answer: str, question: str = "Say it.", again: str = "Again, please.") -> list[dict[str, str]]:
    """A conversation the copy model answers with `answer`."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
            {"role": "user", "content": again}]
