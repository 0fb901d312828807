"""Import structure of src/fsalab (DESIGN §1): no import circles, no layer imports one above it,
and no code outside src/ and the tools' folders: results/ holds data only.

The graph is read from the source with ``ast`` (every ``import`` / ``from ... import`` statement,
at module level or inside functions): an edge a -> b when module a imports module b (``from pkg
import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import fsalab

SRC = Path(fsalab.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
# What results/<platform>/ may hold: the aggregated tables, the point files behind them, and
# the gzipped logs (and GPU-suite summaries) of the runs they come from.
RESULT_SUFFIXES = (".csv", ".json", ".log.gz", ".txt.gz")

# DESIGN §1, bottom to top: config -> ops -> modules -> models -> bench -> results ->
# reproduction / figures -> cli. The longest matching prefix names a module's layer.
LAYERS = {
    "fsalab.config": 0, "fsalab.settings": 0, "fsalab.checks": 0, "fsalab.varlen": 0, "fsalab.theory": 0,
    "fsalab.data": 0,
    "fsalab.ops": 1,
    "fsalab": 2, "fsalab.modules": 2,  # the package root re-exports NSAConfig and the module
    "fsalab.testing": 2,  # test helpers over the ops and the module; the benchmark's check uses them
    "fsalab.models": 3, "fsalab.parallel": 3,
    "fsalab.bench": 4,
    "fsalab.results": 5,
    "fsalab.reproduction": 6, "fsalab.plotting": 6,
    "fsalab.cli": 7, "fsalab.smoke": 7,
}
LAYER_NAMES = ["config", "ops", "modules", "models", "bench", "results", "reproduction/figures", "cli"]

def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _targets(module: str, is_package: bool, node: ast.AST, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, (path, is_package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(t for t in _targets(name, is_package, node, known) if t in known and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert prefix is not None, f"{module} has no layer in DESIGN §1 (add it to LAYERS)"
    return LAYERS[prefix]


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, found


def test_bench_runners_import_no_runner():
    """bench/ in layers: the shared modules (points, rows, grid, e2e_cli, ...) import no runner,
    and no runner imports another (each imports only the shared pieces below it)."""
    names = ("kernel", "dram", "versus", "compile", "decode", "train", "prefill", "convergence")
    runners = {f"fsalab.bench.{r}" for r in names}
    graph = import_graph()
    sideways = [f"{a} imports {b}" for a, targets in sorted(graph.items()) if a.startswith("fsalab.bench.")
                for b in sorted(targets & runners)]
    assert not sideways, "\n".join(sideways)


def test_layers_import_downward_only():
    graph = import_graph()
    upward = [f"{a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]})"
              for a, targets in sorted(graph.items()) for b in sorted(targets) if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_graph_sees_the_imports():
    """The walker resolves relative imports: a few edges that the code has."""
    graph = import_graph()
    assert "fsalab.ops._triton" in graph["fsalab.ops.flash"]
    assert "fsalab.ops.selected.fsa_partials" in graph["fsalab.ops.selected.fsa_bwd"]
    assert "fsalab.modules.nsa" in graph["fsalab.modules"]


def _tracked(folder: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.decode().split("\0") if f]


def test_results_hold_data_only():
    """No script, notebook, patch, kernel copy or archive under results/: every tracked file is
    a table, a point file, a compressed log or the platform's verdict table (the reproduction
    rule's REPRODUCTION.md of a platform other than the figures')."""
    files = _tracked("results")
    assert files, "git lists no file under results/"
    foreign = [f for f in files if not (f.endswith(RESULT_SUFFIXES) or re.fullmatch(r"results/[^/]+/REPRODUCTION\.md", f))]
    assert not foreign, foreign[:20]


def test_no_test_module_imports_another():
    """Tests share helpers through fsalab.testing and fixtures through tests/conftest.py."""
    tests = Path(__file__).resolve().parent
    modules = {p.stem for p in tests.glob("test_*.py")}
    found = [f"{path.name} imports {name}" for path in sorted(tests.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                          else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
             if name in modules]
    assert not found, found
