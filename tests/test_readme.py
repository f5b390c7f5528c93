"""The README works as shown: its commands and code blocks, run the way a newcomer runs them.

Blocks are read from README.md when the tests run, so an edit to the README is tested as it
stands.  On the bundled model (what every command uses when given no model):

- the quick start: the README's `tokenloom serve --port 8000` as a real process (on a free port),
  then its `curl` line, verbatim but for the port;
- the Python blocks: the offline one in a subprocess, the structured-output one against that
  server (the `model` it names must be what `/v1/models` lists: an unknown name is a 404, as
  in vLLM);
- every `tokenloom ...` line of its fenced blocks, each either run (placeholders substituted)
  or listed in `SKIP` with the reason and the test that runs it instead, so that a new command
  in the README needs a decision here;
- and every `tokenloom ...` command line in the README and docs/*.md is parsed by the real
  argument parser (without running it), so a renamed or removed flag cannot stay documented.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BIN = Path(sys.executable).parent  # where `pip install -e .` put the `tokenloom` command
TIMEOUT = 300  # per command; generous, the two cores are shared


# ---------------------------------------------------------------- reading the blocks
@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    return [Block(path, text[:m.start()].count("\n") + 1, m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def shell_lines(block: Block) -> list[str]:
    """The block's lines with backslash continuations joined and `$ ` prompts dropped."""
    lines = []
    for line in re.sub(r"\\\n\s*", " ", block.text).splitlines():
        line = line.strip()
        lines.append(line[2:] if line.startswith("$ ") else line)
    return lines


def loop_values(block: Block) -> dict[str, str]:
    """`for NAME in A B ...` in a block: NAME -> A (enough to parse the command inside)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\bfor (\w+) in (\S+)", block.text)}


def tokenloom_argvs(line: str, variables: dict[str, str]) -> list[list[str]]:
    """Each `tokenloom ...` command of a shell line, split as bash splits it (comments, quotes,
    `&&` / `;`, `$'...'`, `$NAME` of an enclosing for loop)."""
    if not re.search(r"(^|&&|;|\||\bdo)\s*tokenloom\s", line):
        return []  # output shown in the block, a comment, another program
    line = line.replace("$'", "'")  # ANSI-C quoting: its \n stays literal, which is fine for parsing
    for name, value in variables.items():
        line = re.sub(rf"\$\{{{name}\}}|\${name}\b", value, line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for word in list(lexer) + [";"]:
        if word in (";", "&&", "||", "|", "&"):
            if current and current[0] == "tokenloom":
                commands.append(current)
            current = []
        else:
            current.append(word)
    return commands


def is_synopsis(argv: list[str]) -> bool:
    """A usage line (`[--flag X]`, `{a,b}`, `...`), not a command."""
    return any(w.startswith("[") or re.fullmatch(r"\{[\w,-]+\}", w) or w.endswith(("...", "…")) for w in argv)


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `tokenloom` command in the README and the docs: fenced blocks,
    and the inline code of the README's tables (prose may quote a fragment of a command)."""
    out = []
    for path in [README, *DOCS]:
        for block in fenced_blocks(path):
            if block.lang not in ("", "bash", "sh", "shell", "console"):
                continue
            for line in shell_lines(block):
                out += [(block.where(), argv) for argv in tokenloom_argvs(line, loop_values(block))]
    for m in re.finditer(r"`(tokenloom [^`]+)`", readme_table_rows()):
        out += [(f"README.md (table: `{m.group(1)}`)", argv) for argv in tokenloom_argvs(m.group(1), {})]
    return out


def readme_table_rows() -> str:
    return "\n".join(line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("|"))


# ---------------------------------------------------------------- every documented command parses
def test_every_documented_command_parses() -> None:
    from tokenloom.entrypoints.cli import build_parser

    commands = [(where, argv) for where, argv in documented_commands() if not is_synopsis(argv)]
    assert len(commands) > 30  # the extraction found them
    bad = []
    for where, argv in commands:
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            bad.append(f"{where}: {shlex.join(argv)}")
    assert not bad, "documented commands the CLI no longer accepts:\n" + "\n".join(bad)


# ---------------------------------------------------------------- running the README's commands
def run_shell(command: str, cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """`command` run by bash as a user types it, with this venv's `tokenloom` first on PATH."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def run_python(code: str, cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def readme_block(lang: str, containing: str) -> Block:
    found = [b for b in fenced_blocks(README) if b.lang == lang and containing in b.text]
    assert len(found) == 1, f"README.md: {len(found)} ```{lang} blocks contain {containing!r}"
    return found[0]


def readme_fenced_commands() -> list[str]:
    """Every `tokenloom ...` line of the README's unlabeled fenced blocks, comment removed."""
    out = []
    for block in fenced_blocks(README):
        if block.lang == "":
            out += [line.split("  #")[0].strip() for line in shell_lines(block) if line.startswith("tokenloom ")]
    return out


def readme_inline_command(prefix: str) -> str:
    found = [c for c in re.findall(r"`(tokenloom [^`]+)`", readme_table_rows()) if c.startswith(prefix)]
    assert found, f"README.md: no inline `{prefix} ...`"
    return found[0]


# Commands of the README's fenced blocks that are not run here: why, and what runs them instead.
SKIP = {
    "tokenloom serve DIR -tp 2": "a server over 2 processes that runs until stopped: tests/test_tensor_parallel.py",
    "tokenloom serve DIR -dp 2": "2 replicas and a router that run until stopped: tests/test_router.py",
    "tokenloom router --backend http://a:8000": "needs servers on hosts a and b: tests/test_router.py runs it on local ones",
    "tokenloom simulate --compare-with": "replays the JSON of a benchmark run: tests/test_sim_validate.py, test_sim_fleet.py",
    "tokenloom serve [MODEL]": "the usage synopsis of `serve`, not a command (parsed flags: the test above)",
    "tokenloom bench ": "benchmarks take minutes on 2 cores: tests/test_bench_e2e.py runs each on a tiny model",
}
# Commands run as shown (from a fresh directory), each with the files it must leave there.
RUN = {
    "tokenloom trace": [],
    'tokenloom trace "def fib(n):" "import os" --html t.html --png t.png --max-tokens 8': ["t.html", "t.png"],
    "tokenloom estimate --hardware rtx4090 --model qwen2.5-0.5b --dtype float16 --batch-size 1,8,32": [],
    "tokenloom simulate --hardware h100-sxm --model llama-3-8b --workload mixed-long --request-rate 4": [],
}


def test_every_readme_command_is_run_or_skipped_with_a_reason() -> None:
    commands = readme_fenced_commands()
    assert len(commands) >= 10
    undecided = [c for c in commands if c not in RUN and not any(c.startswith(s) for s in SKIP)]
    assert not undecided, f"README commands neither run nor skipped here (add them to RUN or SKIP): {undecided}"
    assert set(RUN) <= set(commands), f"RUN lists commands the README no longer shows: {set(RUN) - set(commands)}"


@pytest.mark.parametrize("command", list(RUN))
def test_readme_command_runs_as_shown(command: str, tmp_path: Path) -> None:
    proc = run_shell(command, tmp_path)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), command
    for name in RUN[command]:
        assert (tmp_path / name).stat().st_size > 0, name


def test_readme_table_make_model_and_generate(tmp_path: Path) -> None:
    """The table's `make-model` (with the tiny preset: 2 GB of random Qwen2.5-0.5B weights is no
    test) makes a model that `generate --model DIR` then runs; the table's `generate` runs as shown."""
    make = readme_inline_command("tokenloom make-model")
    assert re.fullmatch(r"tokenloom make-model --preset \S+ --out DIR", make), make
    proc = run_shell(re.sub(r"--preset \S+", "--preset tiny-llama", make), tmp_path)
    assert proc.returncode == 0 and (tmp_path / "DIR" / "config.json").exists(), proc.stderr
    generate = readme_inline_command("tokenloom generate")
    for command in (generate, f"{generate} --model DIR --max-tokens 4"):
        proc = run_shell(command, tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith("def quicksort(arr):"), (command, proc.stderr[-3000:])


def test_readme_offline_block(tmp_path: Path) -> None:
    block = readme_block("python", "LLM()")
    proc = run_python(block.text, tmp_path)
    assert proc.returncode == 0, f"{block.where()}\n{proc.stderr[-3000:]}"
    assert re.search(r"\b(length|stop)\b", proc.stdout), proc.stdout  # print(text, finish_reason, ttft)


def test_docs_bundled_model_block(tmp_path: Path) -> None:
    block = next(b for b in fenced_blocks(ROOT / "docs" / "bundled-model.md") if b.lang == "python")
    proc = run_python(block.text, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip(), f"{block.where()}\n{proc.stderr[-3000:]}"


# ---------------------------------------------------------------- the quick start, served
@dataclass
class Served:
    port: int
    model: str  # what /v1/models lists first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> Iterator[Served]:
    """The README's install-and-serve line, run from its `tokenloom serve` on (the installs made
    this environment), on a free port instead of 8000."""
    block = readme_block("bash", "tokenloom serve")
    line = next(line for line in shell_lines(block) if "tokenloom serve" in line)
    *installs, serve = [part.strip() for part in line.split("&&")]
    assert installs and all(p.startswith("pip install") for p in installs), line
    assert serve.startswith("tokenloom serve") and "--port 8000" in serve, serve
    port = free_port()
    cwd = tmp_path_factory.mktemp("quick-start")
    log = (cwd / "serve.log").open("w")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", "-c", "exec " + serve.replace("--port 8000", f"--port {port}")], cwd=cwd,
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, f"the server exited:\n{(cwd / 'serve.log').read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no /health in time"
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
        yield Served(port, models[0]["id"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_quick_start_curl(quick_start: Served, tmp_path: Path) -> None:
    block = readme_block("bash", "tokenloom serve")
    curl = next(line for line in shell_lines(block) if line.startswith("curl "))
    assert "localhost:8000" in curl, curl
    proc = run_shell(curl.replace("localhost:8000", f"localhost:{quick_start.port}"), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["model"] == quick_start.model and body["choices"][0]["text"], body
    assert 0 < body["usage"]["completion_tokens"] <= 48


def test_structured_output_block(quick_start: Served, tmp_path: Path) -> None:
    block = readme_block("python", "response_format=City")
    named = set(re.findall(r'model="([^"]+)"', block.text))
    assert named == {quick_start.model}, (
        f"{block.where()} names model(s) {named}; the server serves {quick_start.model!r} and answers 404 otherwise")
    assert "127.0.0.1:8000" in block.text
    code = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{quick_start.port}") + "\nprint(city.model_dump_json())\n"
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, f"{block.where()}\n{proc.stderr[-3000:]}"
    city = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(city["name"], str) and len(city["name"]) <= 40 and 0 <= city["population"] <= 100_000_000
