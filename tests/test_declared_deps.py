"""Every third-party module the code imports is declared in pyproject.toml.

`pip install -e ".[test]"` in a fresh venv installs what pyproject.toml declares and nothing more:
an import that only works because an earlier job left the package on the machine (as scipy once
did) breaks the README's test command on a new machine.  So every `import` in `tokenloom/` must
come from `dependencies`, and every `import` in `tests/` from `dependencies` plus the `test`
extra.  Modules are found with `ast` (module level, inside functions, under `TYPE_CHECKING`
alike) and mapped to the distributions that install them with
`importlib.metadata.packages_distributions()`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# Imported by tokenloom/ only where present: not a runtime dependency, declared for the tests.
OPTIONAL_AT_RUNTIME: dict[str, str] = {
    "triton": "GPU kernels, imported only where kernels.triton.available() says it is installed "
              "(CUDA builds of torch bring it); the test extra installs it for the interpreter tests",
}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def declared(extras: tuple[str, ...] = ()) -> set[str]:
    """Normalized names of `dependencies` plus the given optional-dependency groups."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {requirement_name(r) for r in reqs}


def imported_modules(files: list[Path]) -> dict[str, set[str]]:
    """Top-level module name -> files that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(f.relative_to(ROOT)))
    return found


@functools.cache
def distributions_of_modules() -> dict[str, list[str]]:
    return md.packages_distributions()


def undeclared(files: list[Path], allowed: set[str], local: set[str], optional: dict[str, str]) -> list[str]:
    """One line per third-party module imported in `files` whose distribution is not in `allowed`."""
    providers = distributions_of_modules()
    problems = []
    for module, where in sorted(imported_modules(files).items()):
        if module in sys.stdlib_module_names or module in local or module in optional:
            continue
        dists = {normalize(d) for d in providers.get(module, [])}
        if dists & allowed:
            continue
        what = f"distribution {', '.join(sorted(dists))}" if dists else "not installed here"
        problems.append(f"{module} ({what}) imported by {', '.join(sorted(where))}")
    return problems


def test_the_package_imports_only_its_dependencies() -> None:
    files = sorted((ROOT / "tokenloom").rglob("*.py"))
    problems = undeclared(files, declared(), {"tokenloom"}, OPTIONAL_AT_RUNTIME)
    assert not problems, "undeclared in pyproject.toml's dependencies:\n" + "\n".join(problems)


def test_the_tests_import_only_dependencies_and_the_test_extra() -> None:
    files = sorted(TESTS.glob("*.py"))
    local = {"tokenloom", "tests"} | {f.stem for f in files}  # `from test_parity import ...`
    problems = undeclared(files, declared(("test",)), local, {})
    assert not problems, "undeclared in pyproject.toml's dependencies or test extra:\n" + "\n".join(problems)


def test_optional_runtime_imports_are_declared_for_the_tests() -> None:
    """What the package imports only where present is still installed for the tests that use it."""
    missing = [m for m in OPTIONAL_AT_RUNTIME if normalize(m) not in declared(("test",))]
    assert not missing, missing


@pytest.mark.parametrize("drop", ["scipy", "openai", "transformers"])
def test_a_dropped_declaration_is_found(drop: str) -> None:
    """The check can fail: without one declared name, the modules it provides are reported."""
    files = sorted(TESTS.glob("*.py"))
    local = {"tokenloom", "tests"} | {f.stem for f in files}
    problems = undeclared(files, declared(("test",)) - {drop}, local, {})
    assert any(p.startswith(drop + " ") for p in problems), problems
