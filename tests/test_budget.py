"""Time budgets: a point's expected seconds from its last measurement, slices of a grid, and a
runner that starts only the points expected to end inside its budget (``fsalab.bench.budget``)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from fsalab.bench import budget, kernel


def _points(*specs):
    return [{"id": pid, "experiment": "exp", "op": op, "direction": "fwd"} for pid, op in specs]


def _write(folder, name, elapsed, stamp):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"elapsed_s": elapsed, "provenance": {"timestamp": stamp}}))


def test_a_point_takes_its_newest_measured_time_else_its_ops_median(tmp_path):
    _write(tmp_path / "h200" / "exp", "a.json", 10.0, "2026-12-01")
    _write(tmp_path / "h200" / "superseded" / "exp", "a.0123456.json", 99.0, "2026-11-01")  # older
    _write(tmp_path / "h200" / "superseded" / "exp", "b.0123456.json", 30.0, "2026-11-01")
    _write(tmp_path / "h100" / "exp", "c.json", 5.0, "2026-12-07")
    assert budget.measured_seconds("h200", "exp", tmp_path) == {"a": 10.0, "b": 30.0}
    # A first run on another GPU plans with the times measured elsewhere, its own first.
    assert budget.measured_anywhere("h100", "exp", tmp_path) == {"a": 10.0, "b": 30.0, "c": 5.0}
    points = _points(("a", "x"), ("b", "x"), ("new", "x"), ("other", "y"))
    est = budget.estimates(points, budget.measured_seconds("h200", "exp", tmp_path))
    assert est == pytest.approx({"a": 12.5, "b": 37.5, "new": 25.0, "other": 25.0})
    assert budget.estimates(points[2:], {}) == {"new": budget.UNKNOWN_S * budget.SPREAD,
                                                "other": budget.UNKNOWN_S * budget.SPREAD}


def test_a_count_timed_row_is_rescaled_to_the_calls_the_next_run_makes(tmp_path):
    """A whole-model row timed with 2 warm-up + 5 timed calls of 10 s in 100 s, planned for a
    run of 1 + 2 calls: its 30 s of other work stay, its 70 s of calls become 30 s. A row timed
    for a time (``rep_ms``) keeps its elapsed time."""
    counted = {"elapsed_s": 100.0, "median_ms": 10_000.0,
               "timing": {"method": "cuda_events", "warmup": 2, "repeats": 5}}
    assert budget.rescaled_seconds(counted, {"warmup": 1, "repeats": 2}) == pytest.approx(60.0)
    assert budget.rescaled_seconds(counted, {"repeats": 3}) == pytest.approx(80.0)  # warm-up count kept
    assert budget.rescaled_seconds(counted, None) == 100.0
    timed = {"elapsed_s": 4.0, "median_ms": 1.0, "timing": {"method": "auto", "warmup_ms": 10, "rep_ms": 50}}
    assert budget.rescaled_seconds(timed, {"warmup_ms": 5, "rep_ms": 20}) == 4.0
    (tmp_path / "h200" / "exp").mkdir(parents=True)
    (tmp_path / "h200" / "exp" / "a.json").write_text(json.dumps(counted))
    assert budget.measured_seconds("h200", "exp", tmp_path, {"warmup": 1, "repeats": 2}) == {"a": pytest.approx(60.0)}


def test_slices_keep_the_grid_order_and_fit_the_budget_with_one_start():
    points = _points(*((f"p{i}", "x") for i in range(6)))
    expected = {f"p{i}": s for i, s in enumerate((100, 100, 100, 500, 50, 50))}
    pieces = budget.slices(points, expected, 300)
    assert [[p["id"] for p in piece] for piece in pieces] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"]]
    # Every slice but a lone point longer than the budget fits it with the runner's start.
    for piece in pieces:
        assert len(piece) == 1 or budget.START_S + sum(expected[p["id"]] for p in piece) <= 300


def test_a_budget_starts_only_what_it_expects_to_finish():
    b = budget.Budget(100.0, {"a": 60.0, "b": 50.0, "c": 30.0})
    assert b.fits({"id": "a"})
    b.spend(60.0)
    assert not b.fits({"id": "b"}) and "expected 50 s, 40 s of the budget left" in b.note({"id": "b"})
    assert b.fits({"id": "c"})
    assert budget.Budget(None, {}).fits({"id": "anything"})


def test_the_kernel_runner_leaves_points_that_do_not_fit(tmp_path):
    """With a budget below the runner's start, no point starts and none is written."""
    from fsalab.bench import grid

    exp = grid.load_experiment("kernel", smoke=True)
    points = grid.expand(exp)[:2]
    stream = io.StringIO()
    written = kernel.run_points(points, exp, torch.device("cpu"), tmp_path, "cpu-interpret", stream=stream,
                                budget_s=1.0)
    assert written == [] and stream.getvalue().count("left for a later run") == 2
    assert not any(tmp_path.rglob("*.json"))
