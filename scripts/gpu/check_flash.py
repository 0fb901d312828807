"""GPU check of the generic FlashAttention kernels (ops/flash.py) and the ops built on them:
sliding-window attention (ops/window.py), compressed attention (ops/compression.py) and the
full-attention baselines (ops/full.py).

0. Compile warm-up: one subprocess per kernel variant (WARM_SPECS) fills Triton's on-disk cache
   in parallel, so the main run mostly loads compiled kernels (--no-warm: compile serially).
1. Correctness in bf16 and fp16 at 8K and 32K tokens against the fp32 reference (chunked; the
   backward where the reference's autograd graph fits in memory): max errors vs bounds
   (2 x PyTorch's own error in the dtype + the dtype floor, as in the tests), for the default
   deterministic backward and for deterministic=False (dq by fp32 atomics, "triton_atomic"),
   plus bitwise determinism of two default backward passes (window; compressed with chunked
   dk/dv partials).
2. Timing, bf16, h_kv=4, d=128, g in {1, 4, 16}, N in {8K, 32K, 64K} (one sequence): window
   (w=512), compressed attention (l=32, s=16), full causal attention; impls triton,
   triton_atomic (full: up to 32K), sdpa_cudnn (full), flash_attn when installed; fwd and bwd
   medians from triton.testing.do_bench, bwd/fwd time ratio, useful TFLOP/s from the exact
   count of visible (query, key) pairs (fwd 4 * h * d per pair, bwd 2.5x that).
3. Backward breakdown (torch.profiler, GPU time per kernel: row statistics, dq, dk/dv, the rest)
   at a few points, and the configs the autotuner picked. The timing table is printed last.

Exits non-zero when a comparison fails. Aims at < 3 minutes on an H200, most of it Triton
compilation and autotuning. Writes $OUT/check_flash.json when OUT is set.
Usage: python scripts/gpu/check_flash.py [--skip-correctness] [--skip-timing] [--no-warm]
Predictions and results: docs/perf-log-flash.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from fsalab.config import NSAConfig
from fsalab.ops import flash, reference
from fsalab.ops.compression import compressed_attention
from fsalab.ops.full import full_attention
from fsalab.ops.window import flash_attn_varlen, window_attention
from fsalab.testing import assert_close, cu_seqlens_of, max_error
from fsalab.varlen import compressed_capacity, compressed_cu_seqlens

DEVICE = torch.device("cuda")
CFG = NSAConfig()  # l=32, s=16
W = 512


def inputs(lengths, h, h_kv, d, dtype, seed, mode):
    """q [total, h, d]; k/v raw ([total, h_kv, d]) or compressed (reference layout); cu, cu_k."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lengths)
    cu = cu_seqlens_of(lengths, DEVICE)
    q = torch.randn(total, h, d, device=DEVICE, generator=gen).to(dtype)
    if mode != "compressed":
        k = torch.randn(total, h_kv, d, device=DEVICE, generator=gen).to(dtype)
        v = torch.randn(total, h_kv, d, device=DEVICE, generator=gen).to(dtype)
        return q, k, v, cu, None
    cu_cmp = compressed_cu_seqlens(cu, CFG.kernel_size, CFG.kernel_stride)
    rows = compressed_capacity(total, CFG.kernel_stride)
    valid = (torch.arange(rows, device=DEVICE) < cu_cmp[-1])[:, None, None]
    k = (torch.randn(rows, h_kv, d, device=DEVICE, generator=gen) * valid).to(dtype)
    v = (torch.randn(rows, h_kv, d, device=DEVICE, generator=gen) * valid).to(dtype)
    return q, k, v, cu, cu_cmp


def op_of(mode, impl, cu, cu_k):
    """(q, k, v) -> (o, lse or None) for a mode (window | compressed | full) and impl
    ("triton_atomic": fsalab's kernels with deterministic=False, dq by fp32 atomics)."""
    if impl == "triton_atomic":
        window = flash.NO_WINDOW if mode == "full" else W
        if mode == "compressed":
            return lambda q, k, v: flash.flash_attention(
                q, k, v, cu, cu_k, mask="compressed", kernel_size=CFG.kernel_size, kernel_stride=CFG.kernel_stride,
                deterministic=False)
        return lambda q, k, v: flash.flash_attention(q, k, v, cu, window_size=window, deterministic=False)
    if impl == "reference":
        if mode == "window":
            return lambda q, k, v: reference.window_attention(q, k, v, cu, W)
        if mode == "compressed":
            return lambda q, k, v: reference.compressed_attention(q, k, v, cu, cu_k, CFG)
        return lambda q, k, v: reference.window_attention(q, k, v, cu, q.shape[0])
    if mode == "window":
        return lambda q, k, v: window_attention(q, k, v, cu, W, backend=impl)
    if mode == "compressed":
        return lambda q, k, v: compressed_attention(q, k, v, cu, cu_k, CFG)
    return lambda q, k, v: (full_attention(q, k, v, cu, impl=impl), None)


def run(fn, q, k, v, do, backward) -> dict:
    """{o, lse (when fn gives one), dq, dk, dv (with backward)} for the loss sum(o * do)."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        o, lse = fn(*leaves)
        out = {"o": o.detach()} | ({"lse": lse.detach()} if lse is not None else {})
        if backward:
            grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
            out |= {n: g if g is not None else torch.zeros_like(t) for n, g, t in zip(("dq", "dk", "dv"), grads, leaves)}
    return out


def check_case(name, mode, impl, lengths, g, h_kv, d, dtype, backward, seed, rows) -> bool:
    q, k, v, cu, cu_k = inputs(lengths, g * h_kv, h_kv, d, dtype, seed, mode)
    do = torch.randn_like(q)
    actual = run(op_of(mode, impl, cu, cu_k), q, k, v, do, backward)
    ref = op_of(mode, "reference", cu, cu_k)
    expected = run(ref, q.float(), k.float(), v.float(), do, backward)
    with reference.native_precision():
        native = run(ref, q, k, v, do, backward)
    ok = True
    for tensor, a in actual.items():  # full_attention gives no lse
        e, n = expected[tensor], native[tensor]
        try:
            assert_close(a, e, n, dtype=dtype, name=tensor)
            verdict = "ok"
        except AssertionError as exc:
            verdict, ok = f"FAIL: {exc}", False
        rows.append((name, tensor, max_error(a, e), max_error(n, e), verdict))
    del q, k, v, actual, expected, native
    torch.cuda.empty_cache()
    return ok


def check_determinism(name, mode, lengths, g, h_kv, seed, rows) -> bool:
    """Two backward passes give bitwise-equal dq, dk, dv (no atomics; fixed-order chunk sums)."""
    q, k, v, cu, cu_k = inputs(lengths, g * h_kv, h_kv, 128, torch.bfloat16, seed, mode)
    do = torch.randn_like(q)
    fn = op_of(mode, "triton", cu, cu_k)
    first, second = (run(fn, q, k, v, do, True) for _ in range(2))
    ok = True
    for tensor in ("dq", "dk", "dv"):
        same = torch.equal(first[tensor], second[tensor])
        ok &= same
        rows.append((name, tensor, max_error(second[tensor], first[tensor]), 0.0, "ok" if same else "FAIL: not bitwise equal"))
    return ok


def pairs(mode, n) -> int:
    """Visible (query, key) pairs of one sequence of n tokens."""
    if mode == "window":
        return n * (n + 1) // 2 if n <= W else W * (W + 1) // 2 + (n - W) * W
    if mode == "full":
        return n * (n + 1) // 2
    n_cmp = CFG.num_compressed(n)
    return sum(n - (j * CFG.kernel_stride + CFG.kernel_size - 1) for j in range(n_cmp))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def time_case(mode, impl, n, g, rows, h_kv=4, d=128):
    q, k, v, cu, cu_k = inputs([n], g * h_kv, h_kv, d, torch.bfloat16, 0, mode)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = op_of(mode, impl, cu, cu_k)
    flops = 4.0 * pairs(mode, n) * g * h_kv * d
    try:
        fwd = bench(lambda q=q, k=k, v=v: fn(q, k, v))
        o = fn(q, k, v)[0]
        do = torch.randn_like(o)
        bwd = bench(lambda q=q, k=k, v=v, o=o, do=do: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        rows.append({"op": mode, "impl": impl, "N": n, "g": g, "fwd_ms": fwd, "bwd_ms": bwd,
                     "fwd_tflops": flops / fwd * 1e-9, "bwd_tflops": 2.5 * flops / bwd * 1e-9})
    except (RuntimeError, ValueError) as exc:
        rows.append({"op": mode, "impl": impl, "N": n, "g": g, "error": str(exc).splitlines()[0][:60]})
    del q, k, v
    torch.cuda.empty_cache()


def breakdown(mode, impl, n, g, rows, h_kv=4, d=128, reps=3):
    """GPU milliseconds per backward kernel (torch.profiler), averaged over reps backward passes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    q, k, v, cu, cu_k = inputs([n], g * h_kv, h_kv, d, torch.bfloat16, 0, mode)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = op_of(mode, impl, cu, cu_k)(q, k, v)[0]
    do = torch.randn_like(o)
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # compiled and tuned before profiling
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
    parts = {"stats": 0.0, "dq": 0.0, "dkdv": 0.0, "other": 0.0}
    names = {"_stats_kernel": "stats", "_dq_kernel": "dq", "_dkdv_kernel": "dkdv"}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:  # kernels, memsets, copies; not the CPU ops around them
            continue
        us = getattr(evt, "device_time_total", None)
        us = us if us is not None else getattr(evt, "cuda_time_total", 0.0)
        part = next((p for kname, p in names.items() if kname in evt.key), "other")
        parts[part] += us / 1000 / reps
    rows.append((mode, impl, n, g, parts))
    del q, k, v, o, do
    torch.cuda.empty_cache()


def autotune_picks() -> list[str]:
    """'kernel key -> config' for every autotuned flash kernel (key: D_PAD, key_stride, window,
    size_class, FUSE_DQ for dk/dv, then the argument dtypes)."""
    out = []
    for name in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel"):
        kernel = getattr(flash, name)
        for key, cfg in getattr(kernel, "cache", {}).items():
            values = [str(x) for x in key if not str(x).startswith("torch.")]
            dtypes = sorted({str(x).replace("torch.", "") for x in key if str(x).startswith("torch.")})
            out.append(f"{name:13s} key={','.join(values):32s} {'/'.join(dtypes):22s} -> BLOCK_M={cfg.kwargs['BLOCK_M']}"
                       f" BLOCK_N={cfg.kwargs['BLOCK_N']} warps={cfg.num_warps} stages={cfg.num_stages}")
    return out


CASES = [
    # name, mode, impl, lengths, g, h_kv, d, dtype, backward
    # fp16 cases share d=96 and bf16 cases d=128 (plus one d=256), so few kernels get compiled.
    ("window bf16 8K varlen g4", "window", "triton", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
    ("window fp16 8K varlen g5 d96", "window", "triton", [1, 700, 3000, 4491], 5, 2, 96, torch.float16, True),
    ("window bf16 32K g16", "window", "triton", [32768], 16, 1, 128, torch.bfloat16, True),
    ("window fp16 32K varlen g5 d96", "window", "triton", [20000, 12768], 5, 2, 96, torch.float16, False),
    ("window bf16 8K g1 d256", "window", "triton", [8192], 1, 2, 256, torch.bfloat16, True),
    ("compressed bf16 8K varlen g4", "compressed", "triton", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
    ("compressed fp16 8K varlen g5 d96", "compressed", "triton", [1, 700, 3000, 4491], 5, 2, 96, torch.float16, True),
    ("compressed bf16 32K g16", "compressed", "triton", [32768], 16, 1, 128, torch.bfloat16, True),
    ("compressed fp16 32K varlen g5 d96", "compressed", "triton", [20000, 12768], 5, 2, 96, torch.float16, False),
    ("window atomic-dq bf16 8K varlen g4", "window", "triton_atomic", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16,
     True),
    ("compressed atomic-dq bf16 32K g16", "compressed", "triton_atomic", [32768], 16, 1, 128, torch.bfloat16, True),
    ("full triton bf16 8K varlen g4", "full", "triton", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
    ("full triton fp16 8K varlen g5 d96", "full", "triton", [1, 700, 3000, 4491], 5, 2, 96, torch.float16, True),
    ("full triton bf16 32K g4", "full", "triton", [32768], 4, 1, 128, torch.bfloat16, False),
    ("full triton fp16 32K g5 d96", "full", "triton", [32768], 5, 1, 96, torch.float16, False),
    ("full sdpa_flash bf16 8K varlen g4", "full", "sdpa_flash", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
    ("full sdpa_cudnn bf16 8K g4", "full", "sdpa_cudnn", [8192], 4, 2, 128, torch.bfloat16, True),
]
FA_CASES = [
    ("window flash_attn bf16 8K varlen g4", "window", "flash_attn", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
    ("full flash_attn bf16 8K varlen g4", "full", "flash_attn", [1, 700, 3000, 4491], 4, 2, 128, torch.bfloat16, True),
]


def correctness(has_fa: bool) -> tuple[bool, list]:
    rows: list = []
    ok = True
    for i, case in enumerate(CASES + (FA_CASES if has_fa else [])):
        try:
            ok &= check_case(*case, seed=1000 + i, rows=rows)
        except Exception as exc:  # noqa: BLE001 - report the failing case and go on
            rows.append((case[0], "-", float("nan"), float("nan"), f"FAIL: {type(exc).__name__}: {exc}"))
            ok = False
    for name, mode, lengths, g, h_kv in (("determinism window 8K varlen g4", "window", [1, 700, 3000, 4491], 4, 2),
                                         ("determinism compressed 32K g16", "compressed", [32768], 16, 1)):
        try:
            ok &= check_determinism(name, mode, lengths, g, h_kv, 7, rows)
        except Exception as exc:  # noqa: BLE001 - report the failing case and go on
            rows.append((name, "-", float("nan"), float("nan"), f"FAIL: {type(exc).__name__}: {exc}"))
            ok = False
    return ok, rows


# (mode, impl, dtype, d) of every kernel variant the run compiles: warm_cache compiles them in
# parallel processes first (Triton's on-disk cache then serves the main process). 8K varlen
# batches take both dk/dv output variants (bf16 direct for the window, fp32 chunk partials for
# the compressed and causal masks).
WARM_SPECS = [(mode, impl, dtype, d)
              for mode in ("window", "compressed", "full")
              for impl, dtype, d in (("triton", "bfloat16", 128), ("triton", "float16", 96),
                                     ("triton_atomic", "bfloat16", 128))] + [("window", "triton", "bfloat16", 256)]


def warm(spec: str) -> None:
    """Forward and backward of one 8K varlen batch for a WARM_SPECS entry ("mode,impl,dtype,d")."""
    mode, impl, dtype, d = spec.split(",")
    q, k, v, cu, cu_k = inputs([1, 700, 3000, 4491], 8, 2, int(d), getattr(torch, dtype), 0, mode)
    run(op_of(mode, impl, cu, cu_k), q, k, v, torch.randn_like(q), True)
    torch.cuda.synchronize()


def warm_cache(timeout_s: float = 150.0) -> str:
    """Compile every kernel variant in parallel subprocesses (one per WARM_SPECS entry)."""
    import subprocess

    start = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", ",".join(map(str, spec))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for spec in WARM_SPECS]
    failed = []
    for spec, proc in zip(WARM_SPECS, procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, timeout_s - (time.time() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed.append(f"{spec}: timeout")
            continue
        if proc.returncode:
            failed.append(f"{spec}: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    note = f"compile warm-up: {len(WARM_SPECS)} processes, {time.time() - start:.0f} s"
    return note + "".join(f"\n  warm-up failed (the main run compiles it): {f}" for f in failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--no-warm", action="store_true", help="compile in the main process only")
    parser.add_argument("--warm", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_flash: needs a CUDA device", file=sys.stderr)
        return 2
    if args.warm:
        warm(args.warm)
        return 0
    has_fa = flash_attn_varlen() is not None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, flash-attn {has_fa}")
    start = time.time()
    if not args.no_warm:
        print(warm_cache(), flush=True)
    ok, rows = (True, []) if args.skip_correctness else correctness(has_fa)
    if rows:
        print(f"\ncorrectness ({time.time() - start:.0f} s)")
        print(f"{'case':38s} {'tensor':6s} {'max err':>10s} {'torch err':>10s}  verdict")
        for name, tensor, err, native_err, verdict in rows:
            print(f"{name:38s} {tensor:6s} {err:10.3e} {native_err:10.3e}  {verdict}", flush=True)

    timing: list = []
    if not args.skip_timing:
        impls = {
            "window": ["triton", "triton_atomic"] + (["flash_attn"] if has_fa else []),
            "compressed": ["triton", "triton_atomic"],
            "full": ["triton", "triton_atomic", "sdpa_cudnn"] + (["flash_attn"] if has_fa else []),
        }
        for mode, names in impls.items():
            for n in (8192, 32768, 65536):
                for g in (1, 4, 16):
                    for impl in names:
                        if impl == "triton_atomic" and mode == "full" and n > 32768:
                            continue  # the slowest points; 8K and 32K show the trend
                        time_case(mode, impl, n, g, timing)
        parts: list = []
        for mode, impl, n, g in (("window", "triton", 65536, 4), ("window", "triton", 8192, 16),
                                 ("window", "triton_atomic", 65536, 4), ("compressed", "triton", 65536, 1),
                                 ("compressed", "triton", 65536, 16), ("compressed", "triton_atomic", 65536, 16),
                                 ("full", "triton", 32768, 4)):
            try:
                breakdown(mode, impl, n, g, parts)
            except Exception as exc:  # noqa: BLE001 - report the failing case and go on
                print(f"breakdown {mode} {impl} {n} g{g} failed: {type(exc).__name__}: {exc}")
        print("\nbackward breakdown: GPU ms per kernel (torch.profiler), bf16, h_kv=4, d=128")
        print(f"{'op':10s} {'impl':13s} {'N':>6s} {'g':>3s} {'stats':>8s} {'dq':>8s} {'dkdv':>8s} {'other':>8s}"
              f" {'sum':>8s}")
        for mode, impl, n, g, p in parts:
            print(f"{mode:10s} {impl:13s} {n:6d} {g:3d} {p['stats']:8.3f} {p['dq']:8.3f} {p['dkdv']:8.3f}"
                  f" {p['other']:8.3f} {sum(p.values()):8.3f}")
        print("\nautotuner picks")
        for line in autotune_picks():
            print(line)
        print(f"\ntiming: bf16, h_kv=4, d=128, one sequence, median ms ({time.time() - start:.0f} s)")
        print(f"{'op':10s} {'impl':13s} {'N':>6s} {'g':>3s} {'fwd ms':>9s} {'bwd ms':>9s} {'bwd/fwd':>7s}"
              f" {'fwd TF/s':>8s} {'bwd TF/s':>8s}")
        for r in timing:
            head = f"{r['op']:10s} {r['impl']:13s} {r['N']:6d} {r['g']:3d}"
            if "error" in r:
                print(f"{head} unsupported: {r['error']}")
            else:
                print(f"{head} {r['fwd_ms']:9.3f} {r['bwd_ms']:9.3f} {r['bwd_ms'] / r['fwd_ms']:7.2f}"
                      f" {r['fwd_tflops']:8.1f} {r['bwd_tflops']:8.1f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_flash.json"), "w") as f:
            json.dump({"correct": ok, "correctness": [list(r) for r in rows], "timing": timing}, f, indent=1)
    for name, tensor, _, _, verdict in rows:  # failures again, next to the verdict
        if verdict != "ok":
            print(f"{name} {tensor}: {verdict}")
    print(f"\ntotal {time.time() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
