"""Latency and peak-memory measurement.

Methods (``method=`` / the ``timing.method`` key of an experiment):

- ``do_bench`` (GPU default): ``triton.testing.do_bench`` with ``return_mode="all"``: one untimed
  call (compiles and autotunes), ``warmup_ms`` of warm-up, then ``rep_ms`` worth of calls, each
  after an L2 flush, each timed by a pair of CUDA events. All samples are kept.
- ``cuda_events``: the same protocol with a fixed number of warm-up and timed calls
  (``warmup``, ``repeats``), for when a run must have an exact sample count.
- ``wallclock`` (CPU / Triton-interpreter default): ``time.perf_counter`` around each call
  (synchronising first on GPU), ``warmup`` untimed calls then ``repeats`` timed ones.

The summary statistics are the median and the 20th/80th percentiles of the samples, in ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

METHODS = ("auto", "do_bench", "cuda_events", "wallclock")


@dataclass
class Timing:
    """Samples of one measurement, in milliseconds, and how they were taken."""

    samples_ms: list[float]
    method: str
    settings: dict = field(default_factory=dict)

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile q in [0, 1] of the samples."""
        xs = sorted(self.samples_ms)
        if len(xs) == 1:
            return xs[0]
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def summary(self) -> dict:
        """median_ms, p20_ms, p80_ms, mean_ms, min_ms, n_samples."""
        return {
            "median_ms": statistics.median(self.samples_ms),
            "p20_ms": self.quantile(0.2),
            "p80_ms": self.quantile(0.8),
            "mean_ms": statistics.fmean(self.samples_ms),
            "min_ms": min(self.samples_ms),
            "n_samples": len(self.samples_ms),
        }


def resolve_method(method: str, device: torch.device) -> str:
    """``auto`` -> ``do_bench`` on CUDA, ``wallclock`` elsewhere."""
    if method not in METHODS:
        raise ValueError(f"timing method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "do_bench" if device.type == "cuda" else "wallclock"
    if method in ("do_bench", "cuda_events") and device.type != "cuda":
        raise ValueError(f"timing method {method!r} needs a CUDA device")
    return method


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    # 256 MiB: larger than the L2 of any current GPU (H200: 60 MiB, B200: 126 MiB).
    return torch.empty(256 * 2**20, dtype=torch.int8, device=device)


def _cuda_events(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    flush = _l2_flush_buffer(device)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _wallclock(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def measure(
    fn: Callable[[], object],
    device: torch.device,
    method: str = "auto",
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    warmup: int = 1,
    repeats: int = 3,
) -> Timing:
    """Time ``fn`` (which must launch the whole measured work) and keep every sample.

    ``warmup_ms``/``rep_ms`` drive ``do_bench``; ``warmup``/``repeats`` drive the other methods.
    The first call (Triton compile, autotune) is always outside the samples.
    """
    method = resolve_method(method, device)
    if method == "do_bench":
        import triton.testing  # imported late: TRITON_INTERPRET must be settled first

        samples = list(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
        settings = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "l2_flush": True}
    elif method == "cuda_events":
        fn()  # compile / autotune outside the warm-up count
        samples = _cuda_events(fn, device, warmup, repeats)
        settings = {"warmup": warmup, "repeats": repeats, "l2_flush": True}
    else:
        fn()
        samples = _wallclock(fn, device, warmup, repeats)
        settings = {"warmup": warmup, "repeats": repeats, "l2_flush": False}
    return Timing([float(x) for x in samples], method, settings)


def peak_memory(fn: Callable[[], object], device: torch.device) -> dict:
    """Peak memory of one call of ``fn`` on CUDA, in GiB.

    ``peak_mem_gib``: peak allocated during the call minus what was allocated before it (the op's
    own outputs, workspaces and buffers). ``peak_total_gib``: absolute peak, inputs included.
    None on CPU, where the caching allocator's statistics do not exist.
    """
    if device.type != "cuda":
        return {"peak_mem_gib": None, "peak_total_gib": None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return {"peak_mem_gib": (peak - base) / 2**30, "peak_total_gib": peak / 2**30}
