"""Kernel-level benchmark runner: one grid point -> one result row (a JSON file).

For each point: bind the op/impl (``ops.bind``), build inputs (``inputs.make_inputs``: block
indices from the compression path), check correctness once against the reference
(``check.check``), time the requested direction (``timing.measure``), measure peak memory, and
write ``results/<platform>/<experiment>/<point>.json`` with the DESIGN §2 columns, the samples
and the provenance (``rows``). Every failure becomes a row: ``unsupported`` (op/impl not
available or rejecting the configuration), ``oom``, or ``error`` (with the message; a failed
correctness check is an error too). The runner never plots.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from .. import settings
from . import flops, grid, ops
from .budget import budget_for
from .check import check
from .inputs import attended_keys, input_key, make_inputs
from .points import KernelPoint
from .provenance import detect_platform
from .rows import check_writable, fail_row, finish_row, kernel_row, result_path, run_safely, write_row
from .timing import measure, peak_memory


def run_point(p: KernelPoint, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Measure one point of experiment ``exp``; always returns a row (never raises for the op)."""
    platform = platform or detect_platform()
    row = kernel_row(p, platform)
    timing_cfg, check_cfg = exp.get("timing", {}), exp.get("check", {})
    started = time.time()
    try:
        bound = ops.bind(p.op, p.impl, p.options)
        row["sources"] = bound.sources
        inputs = make_inputs(p, device, need_indices=bound.need_indices)
        row["inputs"] = inputs.info
        keys = attended_keys(inputs)
        rows_cmp = p.batch * inputs.cfg.num_compressed(p.N)
        fwd_flops = flops.useful_flops(p.op, keys, p.d, inputs.cfg, p.h_kv, rows_cmp)
        row["useful_flops"] = fwd_flops * flops.DIRECTION_FLOP_FACTOR[p.direction]
        if check_cfg.get("enabled", True):
            row["check"] = check(bound, inputs, p.direction, check_cfg.get("max_tokens", 4096),
                                 check_cfg.get("factor", 2.0), p.seed)
        else:
            row["check"] = {"status": "skipped"}
        with settings.override(value_checks=False):
            fn = ops.direction_callable(bound, inputs, p.direction, p.seed)
            t = measure(
                fn, device, timing_cfg.get("method", "auto"), timing_cfg.get("warmup_ms", 25),
                timing_cfg.get("rep_ms", 100), timing_cfg.get("warmup", 1), timing_cfg.get("repeats", 3),
            )
            mem = peak_memory(fn, device) if timing_cfg.get("memory", True) else {}
        row.update(t.summary())
        row["samples_ms"] = t.samples_ms
        row["timing"] = {"method": t.method, **t.settings}
        row.update(mem)
        row["useful_tflops"] = row["useful_flops"] / (row["median_ms"] * 1e-3) / 1e12 if row["median_ms"] > 0 else None
        if row["check"]["status"] == "fail":
            row["status"], row["message"] = "error", "correctness check failed: " + row["check"].get("message", "")
        else:
            row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure of the measured op becomes a row
        fail_row(row, exc)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return finish_row(row, started)


def nsa_attention_calls(impl: str, length: int, h_kv: int, g: int, d: int, block_size: int, topk: int,
                        device: torch.device | str = "cpu", options: dict | None = None):
    """(fwd, bwd): zero-argument calls of whole NSA attention (compression, compressed attention,
    block selection, selected and window attention, gates) as this runner times its
    ``nsa_attention`` op with ``impl`` and ``options``, on one random fp16 sequence of ``length``
    tokens: compression windows of ``block_size`` tokens with stride ``block_size / 2``, a window
    of ``4 x block_size``. fwd returns (o, block_idx); small shapes, for launch counts and
    host-time studies."""
    p = grid.kernel_point({"op": "nsa_attention", "impl": impl, "direction": "fwd", "N": length, "h_kv": h_kv, "g": g,
                           "d": d, "block_size": block_size, "topk": topk, "kernel_size": block_size,
                           "kernel_stride": block_size // 2, "window_size": 4 * block_size, "dtype": "float16",
                           "options": options or {}}, "nsa_attention_calls")
    bound = ops.bind(p.op, p.impl, p.options)
    x = make_inputs(p, torch.device(device), bound.need_indices)

    def fwd():
        with torch.no_grad():
            return bound.fn(x)

    return fwd, ops.direction_callable(bound, x, "bwd", p.seed)


def run_points(
    points: list[Mapping], exp: dict, device: torch.device, results_dir: str | Path, platform: str | None = None,
    skip_existing: bool = False, stream=sys.stderr, runner=None, force: bool = False, budget_s: float | None = None,
) -> list[Path]:
    """Run points in this process, one file each, printing progress (index, status, latency, ETA).

    ``runner(point, exp, device, platform) -> row`` defaults to ``run_point`` (``dram.run_point``
    profiles instead of timing, ``decode.run_point`` runs the decode experiments' dict points).
    Each row is written as soon as it exists and a runner that raises gives a failure row
    (``run_safely``), so one bad point costs no other point's file. With ``budget_s``, a point is
    started only when it is expected to end inside the budget (``bench.budget``: its last measured
    time); the others are left for a later run."""
    runner = runner or run_point
    platform = platform or detect_platform()
    budget = budget_for(points, budget_s, platform, results_dir, exp.get("timing"))
    # Points sharing inputs run back to back (every impl and direction of one grid point in turn).
    points = sorted(points, key=lambda p: repr(input_key(p)))
    paths = [result_path(results_dir, platform, p["experiment"], p["id"]) for p in points]
    for path in paths:  # refuse the whole sweep up front, before any file is written
        if not (skip_existing and path.exists()):
            check_writable(path, platform, force)
    written, t0 = [], time.time()
    for i, (p, path) in enumerate(zip(points, paths), 1):
        if skip_existing and path.exists():
            print(f"[{i}/{len(points)}] {p['id']}: exists, skipped", file=stream, flush=True)
            continue
        if not budget.fits(p):
            print(f"[{i}/{len(points)}] {p['id']}: {budget.note(p)}", file=stream, flush=True)
            continue
        started = time.time()
        row = run_safely(runner, p, exp, device, platform)
        written.append(write_row(row, path, force))
        budget.spend(time.time() - started)
        eta = (time.time() - t0) / i * (len(points) - i)
        lat = f"{row['median_ms']:.3f} ms" if row.get("median_ms") is not None else row["message"][:80]
        print(f"[{i}/{len(points)}] {p['id']}: {row['status']} {lat} (eta {eta:.0f} s)", file=stream, flush=True)
    return written
