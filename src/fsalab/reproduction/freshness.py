"""Whether an artefact's rows still describe the code: the source files each experiment executes,
and which of them changed after the commit its rows were measured at.

An experiment executes its runner (``fsalab.bench.<runner>``, ``fsalab.theory`` for the cost
model), every fsalab module that one imports, directly, inside a function, or by a module name
written as a string (the impl tables import kernels by name), and the packages around them. The
experiment's YAML is not among them: a point's parameters are in its id, so a grid edit adds or
drops points without changing what a measured one ran. Rows of commit C are *fresh* when none of those files differs
between C and the checkout (uncommitted changes count; a file moved without a change does not),
*stale* when one does, and *unknown* where git cannot tell (no checkout, a commit this clone
lacks).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..bench.repo import repo_root

FRESH, STALE, UNKNOWN = "fresh", "stale", "unknown"
_MODULE_NAME = re.compile(r"fsalab(?:\.\w+)+")


def _src() -> Path:
    return repo_root() / "src"


def module_file(name: str) -> Path | None:
    """The source file of fsalab module ``name`` (a package's ``__init__.py``), None if none."""
    base = _src().joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(name: str) -> set[str]:
    """fsalab modules that module ``name`` imports anywhere in its body, and module names it
    spells out as strings; names that are not modules (an imported function) are dropped."""
    path = module_file(name)
    if path is None:
        return set()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = _package(name, path).split(".")
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
    return {m for m in found if m.startswith("fsalab") and module_file(m) is not None}


def _with_packages(name: str) -> set[str]:
    """``name`` and every package above it (importing a module runs their ``__init__``)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


@functools.cache
def module_closure(name: str) -> frozenset[str]:
    """Every fsalab module running ``name`` may execute (imports followed transitively)."""
    seen: set[str] = set()
    todo = list(_with_packages(name))
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for dep in imported_modules(mod):
            todo.extend(_with_packages(dep) - seen)
    return frozenset(m for m in seen if module_file(m) is not None)


def runner_module(experiment: str) -> str:
    from ..bench.grid import load_experiment

    runner = load_experiment(experiment)["runner"]
    return "fsalab.theory" if runner == "theory" else f"fsalab.bench.{runner}"


@functools.cache
def experiment_sources(experiment: str) -> tuple[str, ...]:
    """The repository paths (sorted) of the files ``experiment`` executes: its runner's module
    closure."""
    root = repo_root()
    return tuple(sorted(str(module_file(m).relative_to(root)) for m in module_closure(runner_module(experiment))))


@functools.cache
def changed_since(commit: str) -> frozenset[str] | None:
    """Repository paths whose content differs between ``commit`` and the checkout's working tree
    (a rename without a change is no change); None when git cannot compare them."""
    try:
        out = subprocess.run(["git", "diff", "-M", "--name-status", "-z", commit, "--"], cwd=repo_root(),
                             capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    fields = out.stdout.decode().split("\0")
    changed, i = set(), 0
    while i < len(fields) and fields[i]:
        status = fields[i]
        if status[0] in "RC":
            old, new = fields[i + 1], fields[i + 2]
            if status[1:] != "100":
                changed.update((old, new))
            i += 3
        else:
            changed.add(fields[i + 1])
            i += 2
    return frozenset(changed)


@dataclass(frozen=True)
class Freshness:
    """An artefact's rows against today's code: ``state`` fresh/stale/unknown, ``changed`` the
    executed files that differ since the rows' commit (sorted)."""

    state: str
    changed: tuple[str, ...] = ()


def freshness(commits: tuple[str, ...], experiments: tuple[str, ...]) -> Freshness:
    """Fresh when no file the ``experiments`` execute changed since any of ``commits``."""
    if not commits:
        return Freshness(UNKNOWN)
    sources = {f for e in experiments for f in experiment_sources(e)}
    changed: set[str] = set()
    for commit in commits:
        diff = changed_since(commit)
        if diff is None:
            return Freshness(UNKNOWN)
        changed |= diff & sources
    return Freshness(STALE if changed else FRESH, tuple(sorted(changed)))
