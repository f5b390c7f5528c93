"""`tokenloom trace`: the seed's decode walk-through, produced by a real run.

The seed follows one prompt (「北京是中国的首都，上海是」) through tokenization, Prefill
and Decode Step 1, 2, 3 ..., and draws continuous batching as `step1: A B C D /
step2: A B C / step3: A B`.  This package records what the engine really did — only
through its public observer API (`StepEvent`s) and `LLM.generate`'s outputs — and
shows it in those terms:

  recorder.py  the observer, the `Trace` (JSON round-trip)
  tokens.py    readable token strings, even for partial UTF-8 byte tokens
  timeline.py  the (request x step) grid every renderer draws
  text.py      the console walk-through (rich)
  html.py      one self-contained HTML timeline page
  png.py       the timeline as an image (matplotlib)
  cli.py       the `tokenloom trace` subcommand

Importing this package is cheap: renderers import rich / matplotlib when used.
"""

from tokenloom.trace.recorder import Trace, TraceRecorder, run_trace

__all__ = ["Trace", "TraceRecorder", "run_trace"]
