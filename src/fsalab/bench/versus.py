"""Side-by-side runner: whole NSA attention against full attention, interleaved in one process.

A *group* is the set of an experiment's points that differ only in op and impl (same N, g,
(block_size, topk), direction, dtype, seed...): in ``experiments/versus.yaml`` the whole NSA
attention (``nsa_attention`` with auto, fsa, nsa) and cuDNN full attention (``full_attention``,
sdpa_cudnn), the *baseline* (the group's ``full_attention`` point). Per group the runner

1. builds the inputs once (``inputs.make_inputs``; the gradient leaves and the upstream
   gradient are shared by every callable),
2. checks each contender once against the reference (``check.check``, as the kernel runner),
3. times the contenders and the branches of each NSA impl, interleaved (``timing.interleaved``:
   round-robin, one call of each per round, L2 flushed before every call): compression
   (compress_kv + compressed_attention), selection (select_blocks, forward only), selected
   (per selected impl, on the group's block indices), window, gate (the fused gated sum on
   precomputed branch outputs); fwd+bwd callables run forward and backward,
4. records each contender into a CUDA graph, one at a time, times its replays and frees it
   (``timing.capture_graph``; on CPU ``graph_status`` says "unsupported: no CUDA"),

and writes one row per point (``results/<platform>/<experiment>/<point>.json``): the kernel
runner's columns, samples and provenance, plus ``graph_*`` (replayed), ``split_ms`` (branch
medians), ``cudnn_median_ms`` (the baseline's median, whatever its impl; ``baseline_impl``
names it), ``ratio_to_cudnn`` = baseline median / this median (eager) and
``graph_ratio_to_cudnn`` (replayed against replayed). A failing contender or branch becomes an
error/unsupported row or a ``split_status`` message; the other rows still land.

A point filter selects groups: a group runs whole when any of its point ids matches, since a
ratio needs the baseline beside the contender.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import settings
from . import flops, grid, ops
from .check import check
from .inputs import attended_keys, compressed_branch, input_key, make_inputs
from .points import KernelPoint
from .provenance import detect_platform, provenance
from .rows import check_writable, fail_row, kernel_row, result_path, write_row
from .timing import Rounds, Timing, capture_graph, interleaved, peak_memory

BRANCHES = ("compression", "selection", "selected", "window", "gate")
BASELINE_OP = "full_attention"
_ROUND_KEYS = ("rounds", "min_rounds", "rep_ms", "budget_ms", "max_rounds")


def group_key(p: KernelPoint) -> tuple:
    """Points with equal keys form one group (they differ only in op, impl and options)."""
    return input_key(p) + (p.direction,)


def group_label(p: KernelPoint) -> str:
    return f"{p.direction} N={p.N} g={p.g} B={p.block_size} T={p.topk} {p.dtype}"


def groups_of(points: list[KernelPoint], selected: list[KernelPoint] | None = None) -> list[list[KernelPoint]]:
    """``points`` grouped by ``group_key`` (grid order inside a group), the groups that hold a
    point of ``selected`` (all when None), smallest N first."""
    by_key: dict[tuple, list[KernelPoint]] = {}
    for p in points:
        by_key.setdefault(group_key(p), []).append(p)
    wanted = None if selected is None else {group_key(p) for p in selected}
    out = [g for k, g in by_key.items() if wanted is None or k in wanted]
    return sorted(out, key=lambda g: (g[0].N, g[0].g, g[0].block_size, g[0].direction))


def _directional(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], do: torch.Tensor | None,
                 direction: str) -> Callable[[], object]:
    """A zero-argument callable of ``forward`` for ``direction``: under no_grad for fwd, else the
    forward and ``torch.autograd.grad`` of its output against ``do`` into ``leaves``."""
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return forward()

        return fwd
    if direction != "fwd+bwd":
        raise ops.Unsupported(f"the versus runner times fwd and fwd+bwd, got {direction!r}")
    return lambda: torch.autograd.grad(forward(), leaves, do, allow_unused=True)


def _branch_callables(parts: dict[str, ops.NSAParts], x, leaves: dict[str, torch.Tensor], do, direction: str):
    """``{"<branch>:<source>": callable}`` for every distinct branch of the NSA impls' parts.

    Selection and gate run on branch outputs computed here once (no grad); selected attention on
    the block indices this selection picks, as the whole op would.
    """
    t, cu, cfg = x.tensors, x.cu_seqlens, x.cfg
    fns: dict[str, Callable[[], object]] = {}

    def leaf_list(names):
        return [leaves[n] for n in names] if direction != "fwd" else []

    first = next(iter(parts.values()))
    mod = first.compression
    with torch.no_grad():
        o_cmp, lse_cmp, k_cmp, _, cu_cmp = compressed_branch(mod, t, cu, cfg)
        block_idx = mod.select_blocks(t["q"], k_cmp, lse_cmp, cu, cu_cmp, cfg).to(torch.int32)
        o_slc = first.selected(t["q"], t["k"], t["v"], block_idx, cu, cfg.block_size).to(o_cmp.dtype)
        o_win = first.window(t["q"], t["k"], t["v"], cu, cfg.window_size).to(o_cmp.dtype)
    outs = {"o_cmp": o_cmp, "o_slc": o_slc, "o_win": o_win}
    if direction != "fwd":
        outs = {n: o.detach().clone().requires_grad_(True) for n, o in outs.items()}
    gate_leaves = {**outs, "gate": leaves.get("gate", t["gate"])}
    for impl, pt in parts.items():
        src = pt.sources
        m = pt.compression

        def compression(m=m):
            return compressed_branch(m, t, cu, cfg)[0]

        def selection(m=m):
            with torch.no_grad():
                return m.select_blocks(t["q"], k_cmp, lse_cmp, cu, cu_cmp, cfg)

        fns[f"compression:{src['compression']}"] = _directional(
            compression, leaf_list(("q", "k", "v", "w_k", "w_v", "pe")), do, direction)
        fns[f"selection:{src['compression']}"] = selection
        fns[f"selected:{impl}"] = _directional(
            lambda s=pt.selected: s(t["q"], t["k"], t["v"], block_idx, cu, cfg.block_size), leaf_list(("q", "k", "v")), do,
            direction)
        fns[f"window:{src['window']}"] = _directional(
            lambda w=pt.window: w(t["q"], t["k"], t["v"], cu, cfg.window_size), leaf_list(("q", "k", "v")), do, direction)
        fns[f"gate:{src['gate']}"] = _directional(
            lambda s=pt.gated_sum: s(outs["o_cmp"], outs["o_slc"], outs["o_win"], gate_leaves["gate"]),
            [gate_leaves[n] for n in ("o_cmp", "o_slc", "o_win", "gate")] if direction != "fwd" else [], do,
            direction)
    return fns


def _split_key(branch: str, impl: str, sources: dict) -> str:
    return f"{branch}:{impl}" if branch == "selected" else f"{branch}:{sources['compression' if branch == 'selection' else branch]}"


def _rounds(timing_cfg: dict) -> Rounds:
    return Rounds(**{k: timing_cfg[k] for k in _ROUND_KEYS if k in timing_cfg})


def _time_graph(fn: Callable[[], object], device: torch.device, method: str, rounds: Rounds) -> tuple[str, Timing | None]:
    """(graph_status, replay Timing) of ``fn`` recorded into a CUDA graph; the graph is freed."""
    cap = capture_graph(fn, device)
    if not cap.ok:
        return cap.status, None
    try:
        t = interleaved({"graph": cap.replay}, device, method, rounds)["graph"]
    finally:
        cap.free()
        torch.cuda.empty_cache()
    if isinstance(t, BaseException):
        return f"error: replay failed: {type(t).__name__}: {t}"[:2000], None
    return "ok", t


def _tflops(flops: float | None, ms: float | None) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if flops and ms else None


def run_group(points: list[KernelPoint], exp: dict, device: torch.device, platform: str | None = None) -> list[dict]:
    """Measure one group (points sharing ``group_key``); one row per point, in order. Never
    raises for the ops: every failure lands in its row."""
    platform = platform or detect_platform()
    timing_cfg, check_cfg = exp.get("timing", {}), exp.get("check", {})
    method, rounds, warmup = timing_cfg.get("method", "auto"), _rounds(timing_cfg), timing_cfg.get("warmup", 1)
    started = time.time()
    rows = {p.id: kernel_row(p, platform) for p in points}
    p0 = points[0]
    try:
        _measure_group(points, rows, device, method, rounds, warmup, timing_cfg, check_cfg)
    except Exception as exc:  # noqa: BLE001 - inputs or shared setup failed: every row says so
        for row in rows.values():
            if row["status"] is None:
                fail_row(row, exc)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    elapsed, prov = round(time.time() - started, 3), provenance(platform)
    for row in rows.values():
        row.update(elapsed_s=elapsed, provenance=prov, group=group_label(p0))
    return [rows[p.id] for p in points]


def _measure_group(points, rows, device, method, rounds, warmup, timing_cfg, check_cfg) -> None:
    p0 = points[0]
    direction = p0.direction
    inputs = make_inputs(p0, device, need_indices=True)
    keys = attended_keys(inputs)
    rows_cmp = p0.batch * inputs.cfg.num_compressed(p0.N)
    # One set of leaves (every input tensor) and one upstream gradient for every callable.
    x = inputs.with_leaves(tuple(inputs.tensors)) if direction != "fwd" else inputs
    do = None
    if direction != "fwd":
        gen = torch.Generator(device=device).manual_seed(p0.seed + 2)
        q = inputs.tensors["q"]
        do = torch.randn(q.shape, generator=gen, device=device, dtype=torch.float32).to(q.dtype)
    contenders: dict[str, Callable[[], object]] = {}
    parts: dict[str, ops.NSAParts] = {}
    for p in points:
        row = rows[p.id]
        try:
            bound = ops.bind(p.op, p.impl, p.options)
            row["sources"], row["inputs"] = bound.sources, inputs.info
            fwd_flops = flops.useful_flops(p.op, keys, p.d, inputs.cfg, p.h_kv, rows_cmp)
            row["useful_flops"] = fwd_flops * flops.DIRECTION_FLOP_FACTOR[direction]
            if check_cfg.get("enabled", True):
                row["check"] = check(bound, inputs, direction, check_cfg.get("max_tokens", 4096),
                                     check_cfg.get("factor", 2.0), p.seed)
            else:
                row["check"] = {"status": "skipped"}
            leaves = [x.tensors[n] for n in bound.grad_args] if direction != "fwd" else []
            contenders[p.id] = _directional(lambda b=bound: b.fn(x)[0], leaves, do, direction)
            if p.op == "nsa_attention":
                parts[p.impl] = ops.nsa_parts(p.impl, p.options)
        except Exception as exc:  # noqa: BLE001 - this contender's row records it; the others go on
            fail_row(row, exc)
    branches: dict[str, Callable[[], object]] = {}
    split_error = None
    if parts and timing_cfg.get("split", True):
        try:
            branches = _branch_callables(parts, x, x.tensors, do, direction)
        except Exception as exc:  # noqa: BLE001
            split_error = f"{type(exc).__name__}: {exc}"[:2000]
    with settings.override(value_checks=False):
        timed = interleaved({**contenders, **{f"split:{k}": f for k, f in branches.items()}}, device, method,
                            rounds, warmup)
        for pid, fn in contenders.items():
            row, t = rows[pid], timed[pid]
            if isinstance(t, BaseException):
                fail_row(row, t)
                continue
            row.update(t.summary())
            row["samples_ms"] = t.samples_ms
            row["timing"] = {"method": t.method, **t.settings}
            row["useful_tflops"] = _tflops(row["useful_flops"], row["median_ms"])
            try:
                row.update(peak_memory(fn, device) if timing_cfg.get("memory", True) else {})
            except Exception as exc:  # noqa: BLE001 - e.g. an OOM of the extra call: the row says so
                fail_row(row, exc)
                continue
            if row["check"]["status"] == "fail":
                row["status"], row["message"] = "error", "correctness check failed: " + row["check"].get("message", "")
            else:
                row["status"] = "ok"
        for pid, fn in contenders.items():  # one graph at a time: its pool is freed before the next
            row = rows[pid]
            if row["median_ms"] is None:
                continue
            if not timing_cfg.get("graphs", True):
                row["graph_status"] = "skipped"
                continue
            row["graph_status"], g = _time_graph(fn, device, method, rounds)
            if g is not None:
                s = g.summary()
                row.update(graph_median_ms=s["median_ms"], graph_p20_ms=s["p20_ms"], graph_p80_ms=s["p80_ms"],
                           graph_n_samples=s["n_samples"], graph_samples_ms=g.samples_ms,
                           graph_useful_tflops=_tflops(row["useful_flops"], s["median_ms"]))
    if timing_cfg.get("split", True):
        _fill_split(points, rows, parts, timed, split_error)
    _fill_ratios(points, rows)


def _fill_split(points, rows, parts, timed, split_error) -> None:
    for p in points:
        row = rows[p.id]
        if p.impl not in parts or p.op != "nsa_attention":
            continue
        split, problems = {}, [split_error] if split_error else []
        for branch in BRANCHES:
            t = timed.get(f"split:{_split_key(branch, p.impl, parts[p.impl].sources)}")
            if isinstance(t, Timing):
                split[branch] = t.summary()["median_ms"]
            else:
                split[branch] = None
                if isinstance(t, BaseException):
                    problems.append(f"{branch}: {type(t).__name__}: {t}"[:500])
        row["split_ms"] = split
        row["split_status"] = "; ".join(problems) if problems else "ok"


def _fill_ratios(points, rows) -> None:
    base = next((p for p in points if p.op == BASELINE_OP), None)
    if base is None:
        return
    b = rows[base.id]
    eager = b["median_ms"] if b["status"] == "ok" else None
    graph = b.get("graph_median_ms") if b["status"] == "ok" else None
    for p in points:
        row = rows[p.id]
        row["baseline_impl"] = base.impl
        row["cudnn_median_ms"], row["cudnn_graph_median_ms"] = eager, graph
        mine, mine_graph = row.get("median_ms"), row.get("graph_median_ms")
        row["ratio_to_cudnn"] = eager / mine if eager and mine else None
        row["graph_ratio_to_cudnn"] = graph / mine_graph if graph and mine_graph else None


def run_point(p: KernelPoint, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """One point's row: its whole group is measured (the ratio needs the baseline beside it)."""
    group = groups_of(grid.expand(exp), [p])[0]
    rows = run_group(group, exp, device, platform)
    return rows[[q.id for q in group].index(p.id)]


def _weight(group: list[KernelPoint]) -> float:
    """Rough cost of a group for the ETA: full attention's N² work dominates the large points."""
    p = group[0]
    return (p.N / 8192) ** 2 * p.g * (3.5 if p.direction != "fwd" else 1.0) + 1.0


def run_points(
    points: list[KernelPoint], exp: dict, device: torch.device, results_dir: str | Path, platform: str | None = None,
    skip_existing: bool = False, stream=sys.stderr, force: bool = False,
) -> list[Path]:
    """Run the groups holding ``points`` (siblings from the experiment's grid join them), one
    file per point, printing progress per group (index, ratios, ETA). A group whose files this
    machine may not write (``kernel.check_writable``; ``force`` overrides) is refused before it
    is measured."""
    platform = platform or detect_platform()
    groups = groups_of(grid.expand(exp), points)
    total_w, done_w, t0 = sum(map(_weight, groups)), 0.0, time.time()
    written = []
    for i, group in enumerate(groups, 1):
        label = group_label(group[0])
        paths = [result_path(results_dir, platform, p.experiment, p.id) for p in group]
        done_w += _weight(group)
        if skip_existing and all(path.exists() for path in paths):
            print(f"[{i}/{len(groups)}] {label}: exists, skipped", file=stream, flush=True)
            continue
        for path in paths:
            check_writable(path, platform, force)
        rows = run_group(group, exp, device, platform)
        written += [write_row(row, path, force) for row, path in zip(rows, paths)]
        eta = (time.time() - t0) / done_w * (total_w - done_w)
        parts = [_summary(row) for row in rows]
        print(f"[{i}/{len(groups)}] {label}: " + "; ".join(parts) + f" ({rows[0]['elapsed_s']:.0f} s, "
              f"eta {eta:.0f} s)", file=stream, flush=True)
    return written


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['impl']} {row['status']} {row['message'][:80]}"
    ratio = f" x{row['ratio_to_cudnn']:.2f}" if row.get("ratio_to_cudnn") else ""
    graph = f", graph {row['graph_median_ms']:.3f} ms" if row.get("graph_median_ms") is not None else ""
    return f"{row['impl']} {row['median_ms']:.3f} ms{ratio}{graph}"
