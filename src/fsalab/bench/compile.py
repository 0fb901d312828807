"""First-call cost of an op (Table 11): Triton's JIT compile and autotuning, FSA against NSA.

``run_point`` runs this module twice as a child process (``--target <point JSON>``), both on
one fresh Triton cache folder (``TRITON_CACHE_DIR``) and with ``auto``'s dispatch cache in
memory only (``FSALAB_DISPATCH_CACHE=``, so ``auto`` profiles as on a first run):

1. *cold*: the cache is empty, so the first call compiles every kernel and runs every autotune;
2. *cached*: a new process on the cache the first one filled: compiled kernels come from disk,
   autotuning runs again (Triton keeps its choices in memory).

Each child builds the point's inputs (the block indices come from the compression path, whose
kernels therefore compile before the timed call), then times, with a synchronised wall clock,
the first call (for ``fwd+bwd`` including the autograd set-up's one forward) and ``repeats``
further calls (median = the steady call), and prints one JSON line. Row columns:
``first_call_s`` / ``cached_first_call_s`` (the two processes' first calls), ``compile_s`` /
``cached_compile_s`` (first call minus the steady call), ``median_ms`` (the cold process's
steady call). On CPU the ops run through the Triton interpreter, which compiles nothing: the
numbers there only check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .. import settings
from .ops import direction_callable
from .points import KernelPoint
from .provenance import detect_platform
from .rows import fail_row, finish_row, kernel_row

RESULT_TAG = "FSALAB_COMPILE_RESULT "


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _target(p: KernelPoint, repeats: int) -> dict:
    """Inside the child: inputs, the timed first call, then the steady calls (seconds)."""
    from . import ops
    from .inputs import make_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bound = ops.bind(p.op, p.impl, p.options)
    inputs = make_inputs(p, device, need_indices=bound.need_indices)
    settings.configure(value_checks=False)
    _sync(device)
    start = time.perf_counter()
    fn = direction_callable(bound, inputs, p.direction, p.seed)
    fn()
    _sync(device)
    first = time.perf_counter() - start
    steady = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        steady.append(time.perf_counter() - start)
    return {"first_call_s": first, "steady_s": statistics.median(steady), "samples_s": steady}


def _child(p: KernelPoint, repeats: int, cache_dir: str) -> dict:
    """One child process on Triton cache ``cache_dir``; its result, or RuntimeError. The child
    runs with this process's settings (dispatch, autotune)."""
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "FSALAB_DISPATCH_CACHE": ""}
    cmd = [sys.executable, "-m", "fsalab.bench.compile", "--target", json.dumps(dict(p)), "--repeats", str(repeats),
           *settings.as_arguments()]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)  # status read below
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"child exit {out.returncode}; no result. stderr: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def run_point(p: KernelPoint, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Cold and cached first calls of one point, each in its own process; always returns a row."""
    platform = platform or detect_platform()
    row = kernel_row(p, platform)
    repeats = exp.get("timing", {}).get("repeats", 3)
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="fsalab-triton-cache-") as cache:
            cold = _child(p, repeats, cache)
            cached = _child(p, repeats, cache)
        steady_ms = cold["steady_s"] * 1e3
        row.update(median_ms=steady_ms, p20_ms=steady_ms, p80_ms=steady_ms, mean_ms=steady_ms, min_ms=steady_ms,
                   n_samples=len(cold["samples_s"]), samples_ms=[s * 1e3 for s in cold["samples_s"]],
                   first_call_s=cold["first_call_s"], compile_s=cold["first_call_s"] - cold["steady_s"],
                   cached_first_call_s=cached["first_call_s"],
                   cached_compile_s=cached["first_call_s"] - cached["steady_s"],
                   timing={"method": "first_call", "repeats": repeats, "device": device.type},
                   check={"status": "skipped"}, status="ok")
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        fail_row(row, exc)
    return finish_row(row, started)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="internal: the process whose first call is timed")
    ap.add_argument("--target", required=True, help="the point as JSON")
    ap.add_argument("--repeats", type=int, default=3, help="steady (cached) calls timed after the first")
    settings.add_arguments(ap)
    args = ap.parse_args()
    settings.apply_arguments(args)
    print(RESULT_TAG + json.dumps(_target(KernelPoint(**json.loads(args.target)), args.repeats)), flush=True)
