"""Tensor parallel from plain user scripts, and nothing left running or hanging at exit.

Each test writes a script as a user would (top level, no `if __name__ == "__main__":`),
runs it with `python script.py` in a subprocess with a bounded timeout, and looks at what
it printed and at the processes it left.  The workers are forked when the script holds no
CUDA context and spawned (a fresh interpreter running only tokenloom's worker code) when
TOKENLOOM_WORKER_START_METHOD=spawn asks for it, as a CUDA context would; both must work
unguarded.  Before its LLM each script runs a parallel torch op, so the forked worker
starts with the parent's OpenMP pool already used (the case that deadlocks a naive fork).

Then the ways a process tree can end: the script falls off its end without shutdown(); it
raises after building the LLM; it is SIGKILLed while generating (its worker must go within
seconds), or while its workers are busy outside any collective (also when they were
started from a thread other than the main one, where only the death pipe holds them); a
worker is SIGKILLed (the script's next requests fail, it does not hang); a
worker cannot start (an error at once, naming it); and `serve -dp 2 -tp 2` (while it
starts) and a benchmark that launched `serve -tp 2` are SIGKILLed: their trees go with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest

from tokenloom.bench.launcher import free_port
from tokenloom.runner.worker_procs import START_METHOD_ENV, Workers, WorkerStartError, choose_start_method

from test_parity import _hf, _hf_greedy, _prompts

NEW_TOKENS = 8
SCRIPT_TIMEOUT = 240  # a tiny model on two shared cores: ~20-40 s; bounded so a hang fails the test

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree; PDEATHSIG is Linux's")

# What every script does first: a parallel torch op (OpenMP's pool now exists in this
# process), then an LLM over two ranks, then it says which workers it has.
PROLOGUE = """\
import json, os, signal, sys, threading, time
import torch
from tokenloom import LLM, SamplingParams
torch.set_num_threads(2)
x = torch.randn(256, 256)
for _ in range(3):
    x = torch.tanh(x @ x)
MODEL = {model!r}
PROMPTS = {prompts!r}
GREEDY = SamplingParams(temperature=0, max_tokens={new_tokens}, ignore_eos=True)
llm = LLM(MODEL, tensor_parallel_size=2, max_model_len=128, num_threads=2)
launcher = llm.llm_engine.tp_launcher
print("WORKERS " + json.dumps({{"method": launcher.workers.method, "pids": [p.pid for p in launcher.procs]}}),
      flush=True)
"""

GENERATE = """\
outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
"""


def _script(tmp_path: Path, model: Path, body: str, prompts: list[list[int]] | None = None,
            name: str = "script.py", first: str = "") -> Path:
    src = first + PROLOGUE.format(model=str(model), prompts=prompts or _prompts()[:2], new_tokens=NEW_TOKENS) + body
    path = tmp_path / name
    path.write_text(src)
    return path


def _env(method: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    if method:
        env[START_METHOD_ENV] = method
    return env | {"PYTHONUNBUFFERED": "1"}


def _tagged(stdout: str, tag: str):
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in:\n{stdout[-3000:]}")


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as gone: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(map(_gone, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _run(path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(path)], cwd=path.parent, env=env, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def tiny(model_factory) -> tuple[Path, list[list[int]]]:
    """A tiny Qwen2 and transformers' greedy tokens for two prompts."""
    path = model_factory("tiny-qwen2")
    return path, _hf_greedy(_hf(path), _prompts()[:2], NEW_TOKENS)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_unguarded_script_gets_transformers_tokens_and_exits_by_itself(tiny, tmp_path, method):
    """No guard, no shutdown(): the tokens are transformers', the script exits 0 on its own
    (subprocess.run's timeout would fail the test), and its worker is gone with it."""
    model, expected = tiny
    path = _script(tmp_path, model, GENERATE)
    done, took = _run(path, _env(None if method == "fork" else method))
    assert done.returncode == 0, done.stderr[-4000:]
    workers = _tagged(done.stdout, "WORKERS")
    assert workers["method"] == method and len(workers["pids"]) == 1
    assert _tagged(done.stdout, "TOKENS") == expected
    assert "bootstrapping phase" not in done.stderr and "freeze_support" not in done.stderr
    assert "could not reach every worker" not in done.stderr  # told to stop, not SIGTERMed first
    assert _all_gone(workers["pids"], 10)
    print(f"{method}: script ran {took:.1f}s")


# A weakref.finalize made before multiprocessing is imported puts Python's finalizer hook
# after multiprocessing's in the exit order (which SIGTERMs daemon children): the workers
# must still be told to stop first.
EARLY_FINALIZER = "import weakref\nclass Kept: pass\nkept = Kept()\nweakref.finalize(kept, print)\n"


def test_a_script_that_raises_after_building_the_llm_exits_with_its_error(tiny, tmp_path):
    model, _ = tiny
    path = _script(tmp_path, model, GENERATE + 'raise ValueError("a bug in the user\'s script")\n',
                   first=EARLY_FINALIZER)
    done, took = _run(path, _env())
    assert done.returncode == 1
    assert "ValueError: a bug in the user's script" in done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr[-4000:]  # the user's, nothing from the workers
    assert "could not reach every worker" not in done.stderr, done.stderr[-4000:]
    assert _all_gone(_tagged(done.stdout, "WORKERS")["pids"], 10)
    print(f"raising script ran {took:.1f}s")


def _read_tagged(proc: subprocess.Popen, tag: str, timeout: float) -> tuple[str, object]:
    """Read the process's stdout until a line starting with `tag`; (all read, its value)."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        assert time.monotonic() < deadline, f"no {tag} line after {timeout}s:\n{''.join(seen)[-3000:]}"
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            continue
        line = proc.stdout.readline()
        assert line, f"exited ({proc.wait()}) before a {tag} line:\n{''.join(seen)[-3000:]}"
        seen.append(line)
        if line.startswith(tag + " "):
            return "".join(seen), json.loads(line[len(tag) + 1:])


def _kill_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    """Cleanup whatever a failed test left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def test_sigkill_of_a_generating_script_takes_its_worker_down(tiny, tmp_path):
    model, _ = tiny
    path = _script(tmp_path, model, GENERATE + "while True:\n    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)\n")
    proc = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    children: list[int] = []
    try:
        out, _ = _read_tagged(proc, "TOKENS", SCRIPT_TIMEOUT)  # generating from here on
        workers = _tagged(out, "WORKERS")
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert sorted(children) == sorted(workers["pids"])  # found by pid before the kill
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _all_gone(children, 10), [psutil.Process(p).status() for p in children if not _gone(p)]
    finally:
        _kill_leftovers(proc, children)


# Workers busy outside any collective (loading a large shard, say: nothing from gloo would
# reach them), started from the main thread (PDEATHSIG and the death pipe) or from another
# thread (where no PDEATHSIG is set: the death pipe alone).
BUSY_WORKERS = """\
import json, sys, threading, time
from tokenloom.runner.worker_procs import Workers
def start():
    workers = Workers({method!r})
    for i in range(2):
        workers.start(f"busy{{i}}", time.sleep, 600)
    workers.wait_started()
    print("WORKERS " + json.dumps([w.pid for w in workers.procs]), flush=True)
{call}
time.sleep(600)
"""


@pytest.mark.parametrize("case", ["fork-main-thread", "fork-other-thread", "spawn-other-thread"])
def test_sigkill_of_the_parent_ends_workers_that_wait_on_nothing(tmp_path, case):
    method, where = case.split("-", 1)
    call = "start()" if where == "main-thread" else "t = threading.Thread(target=start)\nt.start()\nt.join()"
    path = tmp_path / "busy.py"
    path.write_text(BUSY_WORKERS.format(method=method, call=call))
    proc = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    children: list[int] = []
    try:
        _, pids = _read_tagged(proc, "WORKERS", SCRIPT_TIMEOUT)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert sorted(children) == sorted(pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _all_gone(children, 10)
    finally:
        _kill_leftovers(proc, children)


def test_a_dead_worker_fails_the_next_requests_instead_of_hanging(tiny, tmp_path):
    """A worker SIGKILLed while idle: the next step's broadcast sees the closed connection,
    the requests come back with an error, and the script still exits by itself."""
    model, _ = tiny
    body = textwrap.dedent("""\
        worker = launcher.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        print("FINISH " + json.dumps([o.outputs[0].finish_reason for o in outs]), flush=True)
        print("BROKEN " + json.dumps(llm.llm_engine.device_error), flush=True)
        """)
    done, took = _run(_script(tmp_path, model, body), _env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert _tagged(done.stdout, "FINISH") == ["error", "error"]
    # The engine names the dead worker as broken hardware (a server then answers 503 and exits 1).
    assert _tagged(done.stdout, "BROKEN").startswith("tensor-parallel worker rank 1 exited")
    assert "Connection closed by peer" in done.stderr  # what the log says
    print(f"dead-worker script ran {took:.1f}s")


def test_a_worker_that_cannot_start_is_an_error_at_once():
    """A spawned worker whose work cannot be loaded (its module exists only in the parent)
    exits before it runs: the parent raises naming it, rather than waiting at a rendezvous."""
    only_here = types.ModuleType("tokenloom_test_only_in_the_parent")

    def work() -> None:
        raise AssertionError("never runs")

    work.__module__ = only_here.__name__
    work.__qualname__ = "work"
    only_here.work = work
    sys.modules[only_here.__name__] = only_here
    workers = Workers("spawn")
    try:
        w = workers.start("tokenloom-test-worker", work)
        with pytest.raises(WorkerStartError, match=r"tokenloom-test-worker \(pid \d+, started by spawn\) exited "
                                                   r"with status 1 before it started"):
            workers.wait_started(timeout=120)
        assert not w.is_alive()
    finally:
        workers.kill()
        del sys.modules[only_here.__name__]


def test_the_start_method_is_fork_without_cuda_unless_asked(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert choose_start_method() == "fork"  # Linux, and no CUDA context in this process
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert choose_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='forkserver': expected one of fork, spawn"):
        choose_start_method()


def test_sigkill_of_serve_dp2_tp2_while_starting_takes_the_whole_tree_down(tiny, tmp_path):
    """`serve -dp 2 -tp 2`: a front, two replicas, each with a worker.  SIGKILL the front the
    moment all four exist (the replicas still loading, their workers at the rendezvous):
    the replicas get SIGTERM from the kernel, their workers follow them."""
    model, _ = tiny
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", str(model), "--port", str(free_port()),
           "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-model-len", "128"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        front = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 2 * SCRIPT_TIMEOUT
        while len(tree) < 4:  # 2 replicas + 1 worker each
            assert front.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
            tree = [c.pid for c in psutil.Process(front.pid).children(recursive=True)]
        front.send_signal(signal.SIGKILL)
        front.wait(10)
        assert _all_gone(tree, 60), log.read_text()[-3000:]
    finally:
        _kill_leftovers(front, tree)


def test_sigkill_of_a_benchmark_takes_its_launched_server_down(tiny, tmp_path):
    """A script that launches `serve -tp 2` through bench.launcher (as `bench serve --launch`
    does) is SIGKILLed: the server and its worker go too."""
    model, _ = tiny
    path = tmp_path / "bench.py"
    path.write_text(textwrap.dedent(f"""\
        import time
        from tokenloom.bench.launcher import start_server
        server = start_server({str(model)!r}, ["-tp", "2", "--max-model-len", "128"], timeout={SCRIPT_TIMEOUT})
        print("SERVER", server.proc.pid, flush=True)
        time.sleep(600)
        """))
    proc = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    tree: list[int] = []
    try:
        _read_tagged(proc, "SERVER", SCRIPT_TIMEOUT + 30)
        tree = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) == 2  # the server and its worker
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _all_gone(tree, 60)
    finally:
        _kill_leftovers(proc, tree)
