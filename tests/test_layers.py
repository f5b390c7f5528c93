"""The package's layers point down only, and no two modules import each other in a circle.

Every `import` in `tokenloom/` counts -- at module level, inside functions, under
`TYPE_CHECKING` -- and so does a string literal that names one of our modules (what
`importlib.import_module` and the CLI's lazy command table are handed).  Each module is
mapped to a unit, each unit to a rank in `LAYERS`; a module may import its own unit or a
unit of a lower rank.  Units that share a rank are siblings and may not import each other.

Why the order is what it is:

- `kernels` is the ground floor: native code and platform helpers; it imports nothing of ours.
- `base`: plain data every layer speaks (sampling parameters, requests, outputs, engine
  settings, the version) -- no torch, no engine.
- `core`: the scheduler, the paged KV block manager and the step events: pure Python,
  shared by the engine and the simulator.
- `model` (the forward pass) never sees `runner` or `engine`; `specs` (hardware figures,
  microbenchmarks, model arithmetic) sits on `model` so that both `bench` and `sim` read it.
- `runner` drives the model for one step; `engine` runs steps; `router` spreads requests over
  servers (it knows HTTP, not the engine); `entrypoints` serve the engine and start routers.
- `sampling` holds the pieces the runner's sampler and the speculative verifier share;
  `measure` (workloads, metrics, reports) is what `bench` and `sim` both stand on.
- `bench` measures the engine; `sim` predicts it and fits a calibration to runs it is handed;
  `trace` renders a run.  Nothing below imports them.
- `commands`: the few commands that live in `entrypoints` with the others but drive a tool
  above it (`tokenloom trace` runs `LLM` and renders with `trace`; the calibration run feeds
  the server with `bench`'s client for `sim` to fit, and the `tokenloom` command hands it to `sim`).
- On top: the package root (public names, imported lazily) and the `tokenloom` command,
  which dispatches to every subcommand.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "tokenloom"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# (rank order, lowest first) -> units -> module-name prefixes.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"kernels": ("tokenloom.kernels",)},
    {"base": ("tokenloom.version", "tokenloom.config", "tokenloom.sampling_params", "tokenloom.pooling_params",
              "tokenloom.request",
              "tokenloom.outputs", "tokenloom.bundled")},
    {"core": ("tokenloom.core",), "structured": ("tokenloom.structured",),
     "spec_decode": ("tokenloom.spec_decode",)},  # drafting; its verification sits with the runner
    {"sampling": ("tokenloom.sampling",)},  # the sampling pieces the runner and the verifier share
    {"model": ("tokenloom.model",)},
    {"specs": ("tokenloom.specs",)},
    {"runner": ("tokenloom.runner", "tokenloom.spec_decode.verify")},
    {"engine": ("tokenloom.engine",), "router": ("tokenloom.router",), "dashboard": ("tokenloom.dashboard",)},
    {"router": ("tokenloom.router",)},
    {"entrypoints": ("tokenloom.entrypoints",)},
    {"measure": ("tokenloom.measure",)},  # workloads, metrics, reports: what bench and sim share
    {"bench": ("tokenloom.bench",)},
    {"sim": ("tokenloom.sim",), "trace": ("tokenloom.trace",)},
    # commands kept with the others in entrypoints that drive a tool above entrypoints
    {"commands": ("tokenloom.entrypoints.cmd_trace", "tokenloom.entrypoints.calibration_run")},
    {"top": ("tokenloom", "tokenloom.entrypoints.cli")},  # "tokenloom": the root module alone
]


# ---------------------------------------------------------------- the import graph
def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (packages by their __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = [package, *p.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in (`a.b.func` -> `a.b`), if it is ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _not_imports(tree: ast.Module) -> set[int]:
    """String constants that name no import: docstrings, `python -m MODULE` command lines
    (another process, not this one's import graph) and logger names."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        elif isinstance(node, (ast.List, ast.Tuple)):
            for prev, cur in zip(node.elts, node.elts[1:]):
                if isinstance(prev, ast.Constant) and prev.value == "-m":
                    ids.add(id(cur))
        elif isinstance(node, ast.Call):
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) == "getLogger":
                ids.update(id(a) for a in node.args)
    return ids


def imports_of(module: str, path: Path, modules: dict[str, Path], package: str = PACKAGE) -> dict[str, int]:
    """Our modules `module` imports (-> first line), wherever the import statement stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    here = module if is_pkg else module.rpartition(".")[0]
    not_imports = _not_imports(tree)
    found: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        target = _owner(name, modules) if name else None
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{full}.{a.name}"
                add(sub if sub in modules else full, node.lineno)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in not_imports
              and node.value in modules and node.value.startswith(package + ".")):
            add(node.value, node.lineno)  # importlib.import_module("tokenloom.x.y"), lazy command tables
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    modules = module_files(root, package)
    return {m: imports_of(m, p, modules, package) for m, p in modules.items()}


# ---------------------------------------------------------------- the rules
def unit_of(module: str, layers: list[dict[str, tuple[str, ...]]] = LAYERS) -> tuple[int, str]:
    """(rank, unit) of a module: the unit with the longest matching prefix (the package
    name itself matches only the root module, so a new subpackage must be placed)."""
    best: tuple[int, int, str] | None = None
    for rank, units in enumerate(layers):
        for unit, prefixes in units.items():
            for pre in prefixes:
                if module == pre or ("." in pre and module.startswith(pre + ".")):
                    if best is None or len(pre) > best[0]:
                        best = (len(pre), rank, unit)
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return best[1], best[2]


def upward_imports(graph: dict[str, dict[str, int]], layers=LAYERS) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        rank, unit = unit_of(mod, layers)
        for tgt, line in sorted(targets.items()):
            trank, tunit = unit_of(tgt, layers)
            if tunit != unit and trank >= rank:
                how = "a sibling" if trank == rank else "a higher layer"
                bad.append(f"{mod} ({unit}) line {line} imports {tgt}: {how} ({tunit})")
    return bad


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        # Iterative DFS: (node, iterator over its successors).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


# ---------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    missing = []
    for m in graph:
        try:
            unit_of(m)
        except LookupError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_imports_point_down_only(graph):
    bad = upward_imports(graph)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_kernels_import_nothing_of_ours(graph):
    bad = [f"{m} imports {t}" for m, ts in graph.items() if unit_of(m)[1] == "kernels"
           for t in ts if unit_of(t)[1] != "kernels"]
    assert not bad, "\n".join(bad)


def test_core_and_config_do_not_import_torch():
    """The scheduler, KV blocks, step events and the resolved engine settings run without
    torch (the simulator and `tokenloom estimate` rely on it)."""
    bad = []
    for m, p in module_files(ROOT).items():
        if unit_of(m)[1] != "core" and m != "tokenloom.config":
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{m} line {node.lineno} imports {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_upward_imports_and_cycles(tmp_path):
    """The rules above fail on a package that breaks them (so their passing means something)."""
    pkg = tmp_path / "toypkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from toypkg.high import b  # upward, inside a function\n")
    (pkg / "high" / "b.py").write_text("from toypkg.low.a import f\nfrom . import c\n")
    (pkg / "high" / "c.py").write_text("import importlib\nimportlib.import_module('toypkg.high.b')\n")
    (pkg / "high" / "d.py").write_text("import logging\nlog = logging.getLogger('toypkg.low.a')  # a name, no import\n")
    g = import_graph(pkg, "toypkg")
    assert g["toypkg.low.a"] == {"toypkg.high.b": 2}
    assert g["toypkg.high.c"] == {"toypkg.high.b": 2}
    layers = [{"low": ("toypkg.low",)}, {"high": ("toypkg.high",)}, {"top": ("toypkg",)}]
    bad = upward_imports(g, layers)
    assert bad == ["toypkg.low.a (low) line 2 imports toypkg.high.b: a higher layer (high)"]
    assert cycles(g) == [["toypkg.high.b", "toypkg.high.c", "toypkg.low.a"]]
    assert g["toypkg.high.d"] == {}
    with pytest.raises(LookupError):  # a new subpackage is no layer's until it is placed
        unit_of("toypkg.other.e", layers)
