"""Structured output: grammar-constrained decoding with xgrammar.

A request that asks for a JSON schema, a regex, a choice or an EBNF grammar gets a grammar
compiled once per distinct spec (`GrammarCompiler`, a small thread-safe cache) and a
`GrammarState` of its own that tracks how far the output has come.  Each step the sampler
asks every constrained row's state for the set of tokens that may follow (a bitmask over
the model's vocabulary) and sets the others' logits to -inf; after the engine appends the
sampled token, the state accepts it.  Padding ids past the tokenizer's vocabulary (Qwen2.5
pads 151,665 tokens to 151,936) are never allowed.

xgrammar is an optional dependency (the `structured` extra); it is imported only when a
request asks for structure.  For a reasoning model the grammar waits until the thinking is
over (`ReasoningGate`): it constrains the answer only.
"""

from tokenloom.structured.compiler import GrammarCompiler, GrammarError
from tokenloom.structured.masks import StepMasks, apply_grammar_masks
from tokenloom.structured.reasoning_gate import ReasoningGate, gate_grammar
from tokenloom.structured.state import GrammarState

__all__ = ["GrammarCompiler", "GrammarError", "GrammarState", "ReasoningGate", "StepMasks", "apply_grammar_masks",
           "gate_grammar"]
