"""How long a point takes to measure, from what it took the last time it was measured: the plan
behind a run that must end within a time budget, and behind the workflow's slices of a grid.

A point's estimate is the ``elapsed_s`` of its newest measured row (its file in
``results/<platform>/<experiment>/`` or a copy set aside in ``superseded/``) times ``SPREAD``
(host and machine spread). A row timed by a count of calls (``timing.warmup`` + ``timing.repeats``,
whole-model steps of seconds each) is first rescaled to the counts the run will use: its calls
(``median_ms`` each) are replaced by the new number of them, the rest of its time (model build,
autotuning, checks) kept. A point never measured takes the median of the measured points of
the same op and direction in the experiment, else the experiment's median, else ``UNKNOWN_S``.
Each run of a runner process adds ``START_S`` (imports, the first Triton compiles from a warm
cache).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path


SPREAD = 1.25
START_S = 30.0
UNKNOWN_S = 60.0
SUPERSEDED = "superseded"


def _calls(timing: dict) -> int | None:
    """Timed and warm-up calls of a count-based timing, None for a time-based one (``rep_ms``)."""
    repeats = timing.get("repeats")
    return repeats + timing.get("warmup", 0) if isinstance(repeats, int) else None


def rescaled_seconds(row: dict, timing: dict | None) -> float:
    """A row's ``elapsed_s`` had it made the calls of ``timing`` (the experiment's timing section
    the next run uses; None or time-based: unchanged)."""
    elapsed = float(row["elapsed_s"])
    old = _calls(row.get("timing") or {})
    median_ms = row.get("median_ms")
    if old is None or not timing or not isinstance(median_ms, (int, float)):
        return elapsed
    new = _calls({**row["timing"], **timing})
    if new is None:
        return elapsed
    per_call = median_ms / 1e3
    return max(elapsed - per_call * old, 0.0) + per_call * new


def _measured(path: Path, timing: dict | None) -> tuple[str, float] | None:
    """(timestamp, expected seconds) of a point file (``rescaled_seconds``), None when it records
    no elapsed time."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row.get("elapsed_s"), (int, float)):
        return None
    stamp = (row.get("provenance") or {}).get("timestamp") or row.get("timestamp") or ""
    return str(stamp), rescaled_seconds(row, timing)


def measured_seconds(platform: str, experiment: str, results_dir: str | Path,
                     timing: dict | None = None) -> dict[str, float]:
    """Point id -> seconds of its newest measured row on ``platform`` (current or set aside),
    rescaled to ``timing`` (``rescaled_seconds``)."""
    root = Path(results_dir) / platform
    newest: dict[str, tuple[str, float]] = {}
    files = [(p.stem, p) for p in (root / experiment).glob("*.json")]
    aside = (root / SUPERSEDED / experiment).glob("*.json")  # <point>.<commit>.json
    files += [(p.name.removesuffix(".json").rsplit(".", 1)[0], p) for p in aside]
    for pid, path in files:
        got = _measured(path, timing)
        if got is not None and (pid not in newest or got[0] > newest[pid][0]):
            newest[pid] = got
    return {pid: s for pid, (_, s) in newest.items()}


def estimates(points: Iterable[dict], measured: dict[str, float]) -> dict[str, float]:
    """Point id -> expected seconds (``SPREAD`` x the last measurement, or the proxies of the
    module docstring)."""
    points = list(points)
    by_kind: dict[tuple, list[float]] = {}
    for p in points:
        if p["id"] in measured:
            by_kind.setdefault((p.get("op"), p.get("direction")), []).append(measured[p["id"]])
    every = [s for values in by_kind.values() for s in values]
    out = {}
    for p in points:
        if p["id"] in measured:
            seconds = measured[p["id"]]
        elif (p.get("op"), p.get("direction")) in by_kind:
            seconds = statistics.median(by_kind[(p.get("op"), p.get("direction"))])
        else:
            seconds = statistics.median(every) if every else UNKNOWN_S
        out[p["id"]] = seconds * SPREAD
    return out


def slices(points: list[dict], expected: dict[str, float], budget_s: float) -> list[list[dict]]:
    """``points`` in order, cut into consecutive slices each expected to take at most ``budget_s``
    with one runner start (a point longer than that alone is a slice of its own)."""
    out: list[list[dict]] = []
    used = budget_s
    for p in points:
        need = expected[p["id"]]
        if out and used + need <= budget_s:
            out[-1].append(p)
            used += need
        else:
            out.append([p])
            used = START_S + need
    return out


class Budget:
    """The time left to a run of points: ``fits(point)`` before starting one, ``spend(seconds)``
    after it. ``seconds`` None means no budget (everything fits)."""

    def __init__(self, seconds: float | None, expected: dict[str, float]):
        self.left, self.expected = seconds, expected

    def fits(self, point: dict) -> bool:
        return self.left is None or self.expected.get(point["id"], UNKNOWN_S) <= self.left

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds

    def note(self, point: dict) -> str:
        return (f"left for a later run: expected {self.expected.get(point['id'], UNKNOWN_S):.0f} s, "
                f"{max(self.left or 0.0, 0.0):.0f} s of the budget left")


def measured_anywhere(platform: str, experiment: str, results_dir: str | Path,
                      timing: dict | None = None) -> dict[str, float]:
    """``measured_seconds`` of ``platform``, completed by the other platforms' rows of the same
    points (a first run on a new GPU plans with another GPU's times)."""
    root = Path(results_dir)
    others = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != platform) if root.is_dir() else []
    merged: dict[str, float] = {}
    for name in [*others, platform]:
        merged.update(measured_seconds(name, experiment, results_dir, timing))
    return merged


def budget_for(points: list[dict], seconds: float | None, platform: str, results_dir: str | Path,
               timing: dict | None = None) -> Budget:
    """A ``Budget`` of ``seconds`` for ``points`` of one experiment timed with ``timing``, estimated
    from the measured rows of ``platform`` (of other platforms where it has none)."""
    if seconds is None or not points:
        return Budget(seconds, {})
    measured = measured_anywhere(platform, points[0]["experiment"], results_dir, timing)
    return Budget(seconds - START_S, estimates(points, measured))
