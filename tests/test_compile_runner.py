"""The first-call runner of Table 11 (fsalab.bench.compile) on CPU: two child processes per
point on one fresh Triton cache, a row with the first-call columns, failures as rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsalab.bench import compile as first_call
from fsalab.bench import grid


def test_compile_point_gives_a_first_call_row(tmp_path):
    exp = grid.load_experiment("compile", smoke=True)
    (point,) = grid.expand(exp)
    row = first_call.run_point(point, exp, torch.device("cpu"), "cpu-test")
    assert row["status"] == "ok", row["message"]
    assert row["first_call_s"] > 0 and row["cached_first_call_s"] > 0 and row["median_ms"] > 0
    assert row["compile_s"] == pytest.approx(row["first_call_s"] - row["median_ms"] / 1e3)
    assert row["timing"]["method"] == "first_call" and row["n_samples"] == exp["timing"]["repeats"]


def test_compile_point_failure_is_a_row():
    exp = grid.load_experiment("compile", smoke=True)
    (point,) = grid.expand(exp)
    row = first_call.run_point(dataclasses.replace(point, impl="no_such_impl"), exp, torch.device("cpu"), "cpu-test")
    assert row["status"] == "error" and "child exit" in row["message"] and "first_call_s" not in row
