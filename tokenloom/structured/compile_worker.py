"""The body of one grammar-compile worker process (the server's; see `compile_pool.py`).

A worker holds one xgrammar `GrammarCompiler` for the model's tokenizer and answers one
spec at a time over a pipe:

    parent -> worker   (kind, text)
    worker -> parent   ("ok", serialized CompiledGrammar JSON)  |  ("error", message)

It exists so that a compilation can be *stopped*: a thread cannot be, a process can be
killed.  The parent kills a worker whose compilation outlives its time limit or whose
client has gone, and starts a fresh one.

A worker must never outlive the server, even one killed with SIGKILL.  Its parent is the
forkserver, not the server, and the forkserver itself lives on while any child of it does,
so neither the parent's death nor a pid can tell; instead the server holds the write end of
a "lifeline" pipe that it never writes to, and a thread here waits on the read end: when the
server closes it or dies, the read ends (EOF) and the worker exits at once, mid-compilation
too (xgrammar releases the GIL while it compiles).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import xgrammar  # imported here so that the forkserver preloads it: a worker starts in milliseconds

from tokenloom.structured.xgr_specs import SPEC_ERRORS, compile_spec, spec_error_message


def _exit_with_server(lifeline: Any) -> None:
    def watch() -> None:
        try:
            lifeline.recv_bytes()  # never written to: returns only by EOF
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="grammar-worker-lifeline", daemon=True).start()


def worker_main(conn: Any, lifeline: Any, tokenizer_info_json: str) -> None:
    """Serve compile requests on `conn` until it closes; exit as soon as `lifeline` does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    _exit_with_server(lifeline)
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    # One thread each: the pool's size is the number of cores compilation may take.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", compile_spec(compiler, kind, text).serialize_json())
        except SPEC_ERRORS as e:
            reply = ("error", f"{kind}: {spec_error_message(e)}")
        except Exception as e:  # noqa: BLE001 - anything else is reported, and the worker lives on
            reply = ("internal", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
