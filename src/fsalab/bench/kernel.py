"""Kernel-level benchmark runner: one grid point -> one result row (a JSON file).

For each point: bind the op/impl (``ops.bind``), build inputs (``inputs.make_inputs``: block
indices from the compression path), check correctness once against the reference
(``check.check``), time the requested direction (``timing.measure``), measure peak memory, and
write ``results/<platform>/<experiment>/<point>.json`` with the DESIGN §2 columns, the samples
and the provenance. Every failure becomes a row: ``unsupported`` (op/impl not available or
rejecting the configuration), ``oom``, or ``error`` (with the message; a failed correctness
check is an error too); ``run_safely`` turns whatever a runner raises into such a row, so a
sweep never loses the rows of the points that did run. ``write_row`` refuses to put a row into
another machine's results folder (``provenance.check_destination``). The runner never plots.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from . import ops
from .check import check, with_leaves
from .inputs import attended_keys, input_key, make_inputs
from .provenance import check_destination, detect_platform, machine_platform, provenance
from .timing import measure, peak_memory

STATUSES = ("ok", "oom", "error", "unsupported")
# DESIGN §2: every aggregated table has at least these columns, in this order.
COLUMNS = (
    "experiment", "op", "impl", "direction", "model", "N", "batch", "h", "h_kv", "g", "d",
    "block_size", "topk", "dtype", "median_ms", "p20_ms", "p80_ms", "n_samples",
    "useful_tflops", "peak_mem_gib", "status",
)
_PARAM_KEYS = (
    "kernel_size", "kernel_stride", "window_size", "init_blocks", "local_blocks", "seed", "label", "options",
)


def result_path(results_dir: str | Path, platform: str, experiment: str, point_id: str) -> Path:
    """``<results_dir>/<platform>/<experiment>/<point_id>.json``."""
    return Path(results_dir) / platform / experiment / f"{point_id}.json"


def _base_row(p: dict, platform: str) -> dict:
    row = {c: None for c in COLUMNS}
    row.update({k: p.get(k) for k in COLUMNS if k in p})
    row.update(
        experiment=p["experiment"], point=p["id"], h=p["h_kv"] * p["g"], model=p.get("model", ""),
        platform=platform, status=None, message="",
    )
    row.update({k: p.get(k) for k in _PARAM_KEYS})
    return row


@contextlib.contextmanager
def _value_checks_off():
    """Time kernels without fsalab's input-value checks (the launch path then has no extra ops)."""
    old = os.environ.get("FSALAB_VALUE_CHECKS")
    os.environ["FSALAB_VALUE_CHECKS"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FSALAB_VALUE_CHECKS", None)
        else:
            os.environ["FSALAB_VALUE_CHECKS"] = old


def _timed_callable(bound: ops.BoundOp, inputs, direction: str, seed: int):
    """A zero-argument callable that launches the measured work for ``direction``."""
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return bound.fn(inputs)[0]

        return fwd
    x = with_leaves(inputs, bound.grad_args)
    leaves = [x.tensors[n] for n in bound.grad_args]
    o = bound.fn(x)[0]
    gen = torch.Generator(device=o.device).manual_seed(seed + 2)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32).to(o.dtype)
    if direction == "bwd":
        graph_out = o
        return lambda: torch.autograd.grad(graph_out, leaves, do, retain_graph=True, allow_unused=True)
    del o  # fwd+bwd rebuilds the graph on every call; don't hold this one during timing
    return lambda: torch.autograd.grad(bound.fn(x)[0], leaves, do, allow_unused=True)


def _classify(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    if isinstance(exc, (ops.Unsupported, NotImplementedError, ValueError)):
        return "unsupported"
    if isinstance(exc, TypeError) and "keyword argument" in str(exc):
        return "unsupported"  # an impl that lacks a requested switch (ablation options)
    return "error"


def failure_row(p: dict, platform: str, exc: BaseException) -> dict:
    """The row of a point whose runner raised before it could build its own: the point's
    parameters, the DESIGN columns it has (the others null), status and message from ``exc``."""
    row = {c: None for c in COLUMNS}
    row.update({k: v for k, v in p.items() if k != "id"})
    row.update(experiment=p.get("experiment"), point=p.get("id"), model=p.get("model") or "", platform=platform)
    if row.get("h") is None and isinstance(p.get("h_kv"), int) and isinstance(p.get("g"), int):
        row["h"] = p["h_kv"] * p["g"]
    row["status"] = _classify(exc)
    row["message"] = f"{type(exc).__name__}: {exc}"[:4000]
    row["traceback"] = traceback.format_exc()[-4000:]
    row["provenance"] = provenance()
    return row


def run_safely(runner, p: dict, exp: dict, device: torch.device, platform: str) -> dict:
    """``runner(p, exp, device, platform)``, or ``failure_row`` when it raises anything at all."""
    try:
        return runner(p, exp, device, platform)
    except Exception as exc:  # noqa: BLE001 - a failed point is a row, never a crash of the sweep
        return failure_row(p, platform, exc)


def run_point(p: dict, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Measure one point of experiment ``exp``; always returns a row (never raises for the op)."""
    platform = platform or detect_platform()
    row = _base_row(p, platform)
    timing_cfg, check_cfg = exp.get("timing", {}), exp.get("check", {})
    started = time.time()
    try:
        bound = ops.bind(p["op"], p["impl"], p.get("options"))
        row["sources"] = bound.sources
        inputs = make_inputs(p, device, need_indices=bound.need_indices)
        row["inputs"] = inputs.info
        keys = attended_keys(inputs)
        rows_cmp = p["batch"] * inputs.cfg.num_compressed(p["N"])
        flops = ops.useful_flops(p["op"], keys, p["d"], inputs.cfg, p["h_kv"], rows_cmp)
        row["useful_flops"] = flops * ops.DIRECTION_FLOP_FACTOR[p["direction"]]
        if check_cfg.get("enabled", True):
            row["check"] = check(bound, inputs, p["direction"], check_cfg.get("max_tokens", 4096),
                                 check_cfg.get("factor", 2.0), p["seed"])
        else:
            row["check"] = {"status": "skipped"}
        with _value_checks_off():
            fn = _timed_callable(bound, inputs, p["direction"], p["seed"])
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
        row["status"] = _classify(exc)
        row["message"] = f"{type(exc).__name__}: {exc}"[:4000]
        if row["status"] == "error":
            row["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["elapsed_s"] = round(time.time() - started, 3)
    row["provenance"] = provenance()
    return row


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_row(row: dict, path: str | Path, force: bool = False) -> Path:
    """Write ``row`` as JSON atomically (a sweep killed mid-write leaves no half file).

    PlatformMismatch (nothing written) when the row was measured on another machine than the one
    its platform folder, or the row it would replace, belongs to; ``force`` writes anyway."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.is_file() else None
    check_destination(row, row.get("platform") or path.parent.parent.name, existing, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(row), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def check_writable(path: str | Path, platform: str, force: bool = False) -> None:
    """What ``write_row`` would refuse, checked before anything is measured: PlatformMismatch
    when this machine may not write ``path`` in ``results/<platform>/``."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.is_file() else None
    mine = {"provenance": {"machine": machine_platform()}, "point": path.stem, "experiment": path.parent.name}
    check_destination(mine, platform, existing, force)


def run_points(
    points: list[dict], exp: dict, device: torch.device, results_dir: str | Path, platform: str | None = None,
    skip_existing: bool = False, stream=sys.stderr, runner=None, force: bool = False,
) -> list[Path]:
    """Run points in this process, one file each, printing progress (index, status, latency, ETA).

    ``runner(point, exp, device, platform) -> row`` defaults to ``run_point`` (``dram.run_point``
    profiles instead of timing). Each row is written as soon as it exists and a runner that
    raises gives a failure row (``run_safely``), so one bad point costs no other point's file."""
    runner = runner or run_point
    platform = platform or detect_platform()
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
        row = run_safely(runner, p, exp, device, platform)
        written.append(write_row(row, path, force))
        eta = (time.time() - t0) / i * (len(points) - i)
        lat = f"{row['median_ms']:.3f} ms" if row.get("median_ms") is not None else row["message"][:80]
        print(f"[{i}/{len(points)}] {p['id']}: {row['status']} {lat} (eta {eta:.0f} s)", file=stream, flush=True)
    return written
