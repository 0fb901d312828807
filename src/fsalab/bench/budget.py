"""How long a point takes to measure, from what it took the last time it was measured: the plan
behind a run that must end within a time budget, and behind the workflow's slices of a grid.

A point's estimate is the ``elapsed_s`` of its newest measured row (its file in
``results/<platform>/<experiment>/`` or a copy set aside in ``superseded/``) times ``SPREAD``
(host and machine spread); a point never measured takes the median of the measured points of
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


def _measured(path: Path) -> tuple[str, float] | None:
    """(timestamp, elapsed_s) of a point file, None when it records no elapsed time."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    elapsed = row.get("elapsed_s")
    if not isinstance(elapsed, (int, float)):
        return None
    stamp = (row.get("provenance") or {}).get("timestamp") or row.get("timestamp") or ""
    return str(stamp), float(elapsed)


def measured_seconds(platform: str, experiment: str, results_dir: str | Path) -> dict[str, float]:
    """Point id -> ``elapsed_s`` of its newest measured row on ``platform`` (current or set aside)."""
    root = Path(results_dir) / platform
    newest: dict[str, tuple[str, float]] = {}
    files = [(p.stem, p) for p in (root / experiment).glob("*.json")]
    files += [(p.name.split(".")[0], p) for p in (root / SUPERSEDED / experiment).glob("*.json")]
    for pid, path in files:
        got = _measured(path)
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


def measured_anywhere(platform: str, experiment: str, results_dir: str | Path) -> dict[str, float]:
    """``measured_seconds`` of ``platform``, completed by the other platforms' rows of the same
    points (a first run on a new GPU plans with another GPU's times)."""
    root = Path(results_dir)
    others = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != platform) if root.is_dir() else []
    merged: dict[str, float] = {}
    for name in [*others, platform]:
        merged.update(measured_seconds(name, experiment, results_dir))
    return merged


def budget_for(points: list[dict], seconds: float | None, platform: str, results_dir: str | Path) -> Budget:
    """A ``Budget`` of ``seconds`` for ``points`` of one experiment, estimated from the measured
    rows of ``platform`` (of other platforms where it has none)."""
    if seconds is None or not points:
        return Budget(seconds, {})
    measured = measured_anywhere(platform, points[0]["experiment"], results_dir)
    return Budget(seconds - START_S, estimates(points, measured))
