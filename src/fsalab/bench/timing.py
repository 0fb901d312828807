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

``interleaved`` times several callables side by side (round-robin, one call of each per round),
so that clock drift, thermal state and neighbours hit all of them alike; ``capture_graph``
records a callable into a CUDA graph whose replay is timed like any other callable.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wallclock(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
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


def timed_steps(fn: Callable[[], object], device: torch.device, timing: dict) -> Timing:
    """``measure`` with a fixed sample count, as the end-to-end runners time a step: CUDA events
    on GPU, wall clock elsewhere (``timing``: an experiment's ``timing`` block; ``method``
    auto/do_bench mean that choice; ``warmup`` default 2, ``repeats`` default 5)."""
    method = timing.get("method", "auto")
    if method in ("auto", "do_bench"):
        method = "cuda_events" if device.type == "cuda" else "wallclock"
    return measure(fn, device, method, warmup=timing.get("warmup", 2), repeats=timing.get("repeats", 5))


def timed_steps_with_peak(fn: Callable[[], object], device: torch.device, timing: dict) -> tuple[Timing, float | None]:
    """(``timed_steps`` of fn, peak GiB allocated while it ran: None off CUDA), the peak counted
    from a synchronised, reset start so the numbers cover the timed calls only."""
    if device.type != "cuda":
        return timed_steps(fn, device, timing), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t = timed_steps(fn, device, timing)
    return t, torch.cuda.max_memory_allocated(device) / 2**30


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


@dataclass
class Rounds:
    """When ``interleaved`` stops sampling a callable (all times in ms of its own samples).

    Each callable is sampled in every round until it has ``rounds`` samples and ``rep_ms`` of
    sampled time (at most ``max_rounds``), or, when it is slow, as soon as its samples reach
    ``budget_ms`` and number at least ``min_rounds``.
    """

    rounds: int = 10
    min_rounds: int = 3
    rep_ms: float = 100.0
    budget_ms: float = 3000.0
    max_rounds: int = 100

    def active(self, n: int, total_ms: float) -> bool:
        """Whether a callable with ``n`` samples summing to ``total_ms`` takes part in the next round."""
        if n < self.min_rounds:
            return True
        if n >= self.max_rounds or total_ms >= self.budget_ms:
            return False
        return n < self.rounds or total_ms < self.rep_ms


def interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, method: str = "auto", rounds: Rounds | None = None,
    warmup: int = 1,
) -> dict[str, Timing | BaseException]:
    """Time every callable of ``fns`` in round-robin rounds; one Timing (or the exception it
    raised) per name.

    Every callable is called ``warmup`` times untimed first (compile, autotune, ``auto`` dispatch
    profiling). Then each round calls every still-active callable once, in ``fns`` order rotated
    by one place a round (round r starts at the r-th), so no callable always runs right after the
    same one (what a callable leaves behind, in the clocks or the caches, can slow the next). With
    ``cuda_events`` (``auto`` on CUDA; ``do_bench`` is taken to mean it) from an idle device
    (synced), after zeroing a 256 MiB buffer (L2 flush), between two CUDA events read at the
    round's end. The sync before each call matters where a call is host-bound: without it, a
    call launched while the previous one still runs hides its launch time behind that call's
    kernels, so every callable but the round's first was timed faster than it runs alone;
    with ``wallclock``, by ``time.perf_counter`` around the call, syncing before and after. A
    callable that raises drops out with its exception; the others go on.
    """
    rounds = rounds or Rounds()
    method = resolve_method(method, device)
    cuda = method != "wallclock"
    results: dict[str, Timing | BaseException] = {}
    samples: dict[str, list[float]] = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            samples[name] = []
        except Exception as exc:  # noqa: BLE001 - a failing callable must not stop the others
            results[name] = exc
    flush = _l2_flush_buffer(device) if cuda else None
    for round_index in itertools.count():
        active = [n for n in samples if n not in results and rounds.active(len(samples[n]), sum(samples[n]))]
        if not active:
            break
        shift = round_index % len(active)
        active = active[shift:] + active[:shift]
        events = {}
        for name in active:
            try:
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize(device)
                    flush.zero_()
                    start.record()
                    fns[name]()
                    end.record()
                    events[name] = (start, end)
                else:
                    _sync(device)
                    t0 = time.perf_counter()
                    fns[name]()
                    _sync(device)
                    samples[name].append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001
                results[name] = exc
        if cuda:
            torch.cuda.synchronize(device)
            for name, (start, end) in events.items():
                samples[name].append(float(start.elapsed_time(end)))
    settings = {"interleaved": list(fns), "rotated": True, "warmup": warmup, "l2_flush": cuda,
                "synced_before_each_call": True, "rounds": rounds.rounds, "min_rounds": rounds.min_rounds,
                "rep_ms": rounds.rep_ms, "budget_ms": rounds.budget_ms, "max_rounds": rounds.max_rounds}
    for name, xs in samples.items():
        if name not in results:
            results[name] = Timing(xs, "cuda_events" if cuda else "wallclock", settings)
    return results


@dataclass
class CapturedGraph:
    """A callable recorded into a CUDA graph.

    status: ``ok``, ``unsupported: <why>`` (no CUDA) or ``error: <exception>`` (capture failed:
    e.g. a host sync or an allocation the graph cannot hold). ``replay`` re-launches the
    recorded work on the same memory; ``outputs`` are the captured call's return value (static
    tensors the replays overwrite). ``free()`` drops the graph and its memory pool.
    """

    status: str
    replay: Callable[[], None] | None = None
    outputs: Any = None
    graph: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def free(self) -> None:
        self.replay = self.outputs = self.graph = None


def capture_graph(fn: Callable[[], object], device: torch.device, warmup: int = 2) -> CapturedGraph:
    """Record ``fn`` into a ``torch.cuda.CUDAGraph``; never raises for ``fn``'s own failures.

    ``fn`` must be replayable: fixed shapes, inputs that stay at their addresses (the graph
    reads them in place), no host sync. It is first called ``warmup`` times on a side stream,
    so Triton compilation and autotuning, ``auto`` dispatch profiling, cuDNN plan building and
    the caching allocator's growth happen outside the capture (as PyTorch's CUDA-graph docs
    require); a backward through ``torch.autograd.grad`` inside ``fn`` is captured too.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return CapturedGraph("unsupported: no CUDA")
    graph = None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn()
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a failed capture is a result, not a crash
        del graph
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - the error is reported below either way
            pass
        torch.cuda.empty_cache()
        return CapturedGraph(f"error: {type(exc).__name__}: {exc}"[:2000])
    return CapturedGraph("ok", graph.replay, outputs, graph)
