"""The benchmark runners on the GPU: a few small points of every kernel-level experiment through
``fsalab.bench.kernel`` (inputs from the compression kernels, the correctness check, timing,
peak memory), the decode runner's smoke points (decode steps, inference, generate), and the
DRAM runner's verdict where Nsight Compute is missing.

Each point's row must be ``ok`` with a passing check (``unsupported`` only for the decode
libraries that are optional packages, flash-attn and FlashInfer, where they are absent). Timing
is cut to three CUDA-event samples for the kernel runners: these tests check the runners, the
experiment grids measure.
"""

from __future__ import annotations

import re

import pytest

from fsalab.bench import dram, grid, kernel

pytestmark = pytest.mark.gpu

QUICK = {"method": "cuda_events", "warmup": 1, "repeats": 3, "memory": True}
# experiment -> point ids to run (a regular expression over the grid's ids)
POINTS = {
    "kernel": r"^(selected-(nsa|fsa|fsapaper)|compressed-triton|window-triton|fullattention-sdpacudnn|"
              r"nsaattention-(nsa|fsa))-(fwd|bwd|fwdbwd)-N8192-b1-hkv4-g4-d128-B64-T16-bf16-",
    "breakdown": r"-N32768-b1-hkv4-g4-d128-B64-T16-bf16-",
    "ablation": r"-fwd-N65536-b1-hkv4-g4-d128-B64-T16-bf16-",
    "buffers": r"^selected-fsa-fwd-N32768-.*-B64-T16-",
    "longctx": r"-fwd-N131072-b1-hkv16-g4-d128-B64-T16-",
}


@pytest.mark.parametrize("name", sorted(POINTS))
def test_kernel_runner_points(name, device):
    exp = grid.load_experiment(name)
    exp["timing"] = QUICK
    points = [p for p in grid.expand(exp) if re.search(POINTS[name], p["id"])]
    assert points, f"no point of {name} matches {POINTS[name]}"
    for p in points:
        row = kernel.run_point(p, exp, device, platform="gpu-test")
        assert row["status"] == "ok", (p["id"], row["message"])
        assert row["check"]["status"] == "pass" and row["median_ms"] > 0, (p["id"], row["check"])


def test_dram_runner_row(device):
    """Under Nsight Compute a DRAM byte count; without it an ``unsupported`` row, never a crash."""
    exp = grid.load_experiment("dram")
    p = next(p for p in grid.expand(exp) if re.search(r"^selected-fsa-fwd-N65536-b1-hkv4-g4-d128-B64-T16-", p["id"]))
    row = dram.run_point(p, exp, device, platform="gpu-test")
    if dram.find_ncu() is None:
        assert row["status"] == "unsupported"
    else:
        assert row["status"] == "ok" and row["dram_bytes"] > 0, row["message"]


@pytest.mark.parametrize("name", ["decode", "inference", "generate"])
def test_decode_runner_smoke_points(name, device, decode_smoke_rows):
    """The decode runner on CUDA tensors (its grids run nowhere else before the device calls): every
    smoke point of the experiment gives a schema-valid row, ok with a passing check."""
    for row in decode_smoke_rows(name, device):
        if row["status"] == "unsupported" and row["impl"] in ("flash_attn", "flashinfer"):
            continue
        assert row["status"] == "ok", (row["point"], row["message"])
        assert row["check"]["status"] == "pass" and row["median_ms"] > 0, (row["point"], row["check"])
