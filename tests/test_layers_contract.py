"""The layering is a contract a tool checks (.importlinter, import-linter): entrypoints >
engine > runner > spec_decode > sampling > model > kernels; core imports no torch and
nothing above it; sim and bench stand side by side on tokenloom.measure; nothing below
entrypoints imports it; the router stands alone.  A wrong import fails this test with
import-linter's report, which names the importing module, the imported one and the line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_every_layering_contract_is_kept():
    run = _lint(ROOT / ".importlinter")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_wrong_import_is_reported_by_name(tmp_path):
    """The tool does catch a violation: a contract the tree breaks (the runner imports the
    model, so forbidding it must fail) is reported with the offending import."""
    config = tmp_path / "broken.ini"
    config.write_text("[importlinter]\nroot_package = tokenloom\n\n"
                      "[importlinter:contract:x]\nname = runner without model\ntype = forbidden\n"
                      "source_modules =\n    tokenloom.runner.model_runner\n"
                      "forbidden_modules =\n    tokenloom.model.attention\n")
    run = _lint(config)
    assert run.returncode != 0
    assert "tokenloom.runner.model_runner -> tokenloom.model.attention" in run.stdout
