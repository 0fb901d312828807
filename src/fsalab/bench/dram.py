"""Measured DRAM traffic of one selected-attention call, beside the theory model (Nsight Compute).

``run_point`` re-launches this module under ``ncu --clock-control none`` with the point as
``--target``: the target process builds the inputs, runs the op once untimed (compile, autotune),
then once between ``cudaProfilerStart`` and ``cudaProfilerStop`` (ncu runs with
``--profile-from-start off``), the only kernels ncu profiles. The profiler range is process-wide,
so it also holds the kernels autograd's own thread launches for the backward, which an NVTX
push/pop range (per thread) misses. The CSV ncu
prints is summed per kernel: ``dram__bytes_read.sum``, ``dram__bytes_write.sum`` and
``gpu__time_duration.sum``. The row carries the DESIGN columns (``median_ms`` = summed kernel
time under the profiler, one sample, timing method ``ncu``), ``dram_bytes`` (read + write), the
per-kernel list, and the theory model's bytes for the same kernel(s) (``model_bytes``).

Without a CUDA device or without ``ncu`` on PATH (or in $CUDA_HOME/bin) the row is
``unsupported``. Points use op ``selected``, direction ``fwd`` (beside the model, which covers
the forward) or ``bwd`` (measured bytes only; the forward runs outside the profiled range).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import settings, theory
from .points import KernelPoint
from .provenance import detect_platform
from .rows import fail_row, finish_row, kernel_row

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
# Nsight Compute versions spell units either way ("nsecond" / "ns", "Kbyte" / "KB").
_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
          "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def find_ncu() -> str | None:
    """Path of Nsight Compute's CLI, or None."""
    found = shutil.which("ncu")
    if found:
        return found
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ncu"
    return str(cuda) if cuda.is_file() else None


def parse_ncu_csv(text: str) -> list[dict]:
    """Per-kernel metrics from ``ncu --csv`` output: [{"kernel", "read_bytes", "write_bytes",
    "time_ms"}] in launch order. Lines before the CSV header (program output, ==PROF== notes)
    are skipped; units (byte/Kbyte/..., nsecond/usecond/...) are converted."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if rec.get("Metric Name") not in METRICS:
            continue
        k = kernels.setdefault(rec["ID"], {"kernel": rec.get("Kernel Name", ""), "read_bytes": 0.0,
                                           "write_bytes": 0.0, "time_ms": 0.0})
        unit = rec.get("Metric Unit", "").strip().lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown Nsight Compute unit {rec.get('Metric Unit')!r} for {rec['Metric Name']}")
        value = float(rec["Metric Value"].replace(",", "")) * _UNITS[unit]
        field = {"dram__bytes_read.sum": "read_bytes", "dram__bytes_write.sum": "write_bytes",
                 "gpu__time_duration.sum": "time_ms"}[rec["Metric Name"]]
        k[field] += value
    return list(kernels.values())


def model_bytes(p: KernelPoint) -> dict[str, float]:
    """The theory models' memory traffic for the impl of point ``p`` (bytes)."""
    if p.direction != "fwd":
        return {}  # the models describe the forward kernels only
    s = theory.Shape(N=p.N * p.batch, h_kv=p.h_kv, g=p.g, d=p.d, block_size=p.block_size,
                     topk=p.topk, bytes_per_elem=2 if p.dtype != "float32" else 4)
    if p.impl == "nsa":
        return {m: theory.nsa_selected(s, m).memory_bytes for m in theory.MODELS}
    if p.impl == "fsa":
        return {"fsalab": theory.fsalab_fsa_total(s).memory_bytes}
    return {m: theory.fsa_paper_total(s, m).memory_bytes for m in ("paper", "causal")}


def _target(p: KernelPoint) -> None:
    """Inside ncu: one untimed call, then one call in the profiled NVTX range."""
    from . import ops
    from .inputs import make_inputs

    device = torch.device("cuda")
    bound = ops.bind(p.op, p.impl, p.options)
    inputs = make_inputs(p, device, need_indices=bound.need_indices)
    settings.configure(value_checks=False)
    # The direction's work alone: for bwd the forward runs (once) outside the profiled range.
    fn = ops.direction_callable(bound, inputs, p.direction, p.seed)
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def run_point(p: KernelPoint, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Profile one point under ncu; always returns a row."""
    platform = platform or detect_platform()
    row = kernel_row(p, platform)
    started = time.time()
    try:
        ncu = find_ncu()
        if device.type != "cuda" or ncu is None:
            raise NotImplementedError("DRAM traffic needs a CUDA device and Nsight Compute (ncu)")
        cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv",
               "--profile-from-start", "off", "--target-processes", "all",
               sys.executable, "-m", "fsalab.bench.dram", "--target", json.dumps(dict(p)), *settings.as_arguments()]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)  # status read below
        kernels = parse_ncu_csv(out.stdout)
        if out.returncode != 0 or not kernels:
            raise RuntimeError(f"ncu exit {out.returncode}; no kernel metrics. stderr: {out.stderr[-2000:]}")
        read = sum(k["read_bytes"] for k in kernels)
        write = sum(k["write_bytes"] for k in kernels)
        total_ms = sum(k["time_ms"] for k in kernels)
        row.update(median_ms=total_ms, p20_ms=total_ms, p80_ms=total_ms, mean_ms=total_ms, min_ms=total_ms,
                   n_samples=1, samples_ms=[total_ms], dram_read_bytes=read, dram_write_bytes=write,
                   dram_bytes=read + write, kernels=kernels, model_bytes=model_bytes(p),
                   timing={"method": "ncu", "clock_control": "none", "metrics": list(METRICS)},
                   check={"status": "skipped"}, status="ok")
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        fail_row(row, exc)
    return finish_row(row, started)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="internal: the process ncu profiles")
    ap.add_argument("--target", required=True, help="the point as JSON")
    settings.add_arguments(ap)
    args = ap.parse_args()
    settings.apply_arguments(args)
    _target(KernelPoint(**json.loads(args.target)))
