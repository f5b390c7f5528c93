"""A user's ordinary mistake on the command line is one `error:` line naming what to fix.

Each subcommand runs as the user runs it (`python -m tokenloom.entrypoints.cli ...` in a
subprocess) with a mistake a first day brings: a directory without weights, a model path that is
not a directory, `--max-model-len` over the model's limit.  Every one must exit with status 2
(argparse's status for a bad command line), print exactly one `error:` line on stderr that names
the path or flag at fault, and print no traceback.  One mechanism in `tokenloom.entrypoints.cli.main`
holds this for all commands; these tests hold it command by command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.bundled import BUNDLED_MODEL_DIR

# Small settings, so that a command that wrongly got past the mistake would still end soon.
COMMANDS = {
    "generate": ["generate", "--max-tokens", "2"],
    "trace": ["trace", "--max-tokens", "2"],
    "bench throughput": ["bench", "throughput", "--num-prompts", "2", "--disable-tqdm"],
    "bench latency": ["bench", "latency", "--batch-size", "1", "--input-len", "4", "--output-len", "2",
                      "--num-iters", "1", "--num-iters-warmup", "0"],
}


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> dict[str, tuple[list[str], str]]:
    """Mistake name -> (the flags that make it, the text the error line must name)."""
    root = tmp_path_factory.mktemp("cli-errors")
    no_weights = root / "no-weights"  # config and tokenizer, no *.safetensors
    no_weights.mkdir()
    for f in BUNDLED_MODEL_DIR.glob("*.json"):
        shutil.copy(f, no_weights / f.name)
    not_a_dir = root / "weights.safetensors"
    not_a_dir.write_bytes(b"not a model directory")
    return {
        "directory without weights": (["--model", str(no_weights)], str(no_weights)),
        "path that is not a directory": (["--model", str(not_a_dir)], str(not_a_dir)),
        # the bundled model's limit is 512 positions
        "--max-model-len over the model's limit": (["--max-model-len", "100000"], "--max-model-len"),
    }


def run_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_error_line(proc: subprocess.CompletedProcess, names: str, status: int = 2) -> str:
    """Exit `status`, no traceback, exactly one `error:` line on stderr, naming `names`; returns it."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert names in errors[0], errors[0]
    assert proc.returncode == status, (proc.returncode, both)
    return errors[0]


@pytest.mark.parametrize("mistake", ["directory without weights", "path that is not a directory",
                                     "--max-model-len over the model's limit"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_mistake_is_one_error_line(command: str, mistake: str, mistakes) -> None:
    flags, names = mistakes[mistake]
    assert_one_error_line(run_cli(COMMANDS[command] + flags), names)


def test_the_other_benchmarks_and_estimates_too(mistakes) -> None:
    """The same mechanism serves every subcommand: a sweep over a directory without weights,
    a launched server that cannot load its model, an estimate of a file that is not a config."""
    flags, no_weights = mistakes["directory without weights"]
    assert_one_error_line(run_cli(["bench", "sweep", *flags, "--num-prompts", "2", "--max-num-seqs-list", "2",
                                   "--max-num-batched-tokens-list", "64", "--disable-tqdm"]), no_weights)
    flags, not_a_dir = mistakes["path that is not a directory"]
    # The launched server's own error line comes inside the launcher's message: the first `error:`
    # line is the launcher's, and the server's names the path.
    proc = run_cli(["bench", "serve", "--launch", not_a_dir, "--num-prompts", "1"])
    assert "Traceback" not in proc.stdout + proc.stderr and proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: server exited") and f"error: model path {not_a_dir!r}" in proc.stderr
    line = assert_one_error_line(run_cli(["estimate", "--model", not_a_dir]), not_a_dir)
    assert "config.json" in line


def test_serve_reports_the_same_mistakes_in_one_line(mistakes) -> None:
    """`serve` reports a model it cannot load as every other command does: one line, status 2
    (status 1 stays the running server's answer to a broken engine)."""
    for mistake in ("directory without weights", "--max-model-len over the model's limit"):
        flags, names = mistakes[mistake]
        assert_one_error_line(run_cli(["serve", *flags, "--port", "0"]), names, status=2)


def test_tokenloom_traceback_shows_where(mistakes) -> None:
    """`TOKENLOOM_TRACEBACK=1` puts the traceback back, for a bug report."""
    flags, not_a_dir = mistakes["path that is not a directory"]
    env = {**os.environ, "TOKENLOOM_TRACEBACK": "1"}
    proc = subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", "generate", *flags], env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr, proc.stderr
