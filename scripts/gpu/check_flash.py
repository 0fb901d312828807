"""GPU check of the generic FlashAttention kernels (ops/flash.py) and the ops built on them:
sliding-window attention (ops/window.py), compressed attention (ops/compression.py) and the
full-attention baselines (ops/full.py).

1. Correctness in bf16 and fp16 at 8K and 32K tokens against the fp32 reference (chunked; the
   backward where the reference's autograd graph fits in memory): max errors vs bounds
   (2 x PyTorch's own error in the dtype + the dtype floor, as in the tests). Also checks that
   window_size=512 means the same thing for flash-attn (when installed) and the reference.
2. Timing, bf16, h_kv=4, d=128, g in {1, 4, 16}, N in 8K-64K (one sequence):
   window (w=512; triton vs flash_attn), compressed attention (l=32, s=16), full causal
   attention (sdpa_flash, sdpa_cudnn, flash_attn, triton); fwd and bwd medians from
   triton.testing.do_bench, with useful TFLOP/s from the exact count of visible (query, key)
   pairs (fwd 4 * h * d per pair, bwd 2.5x that).

Exits non-zero when a comparison fails. Runs in about 3-4 minutes on an H200 (a good part is
Triton compilation and autotuning). Usage: python scripts/gpu/check_flash.py [--skip-timing]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton

from fsalab.config import NSAConfig
from fsalab.ops import reference
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
    """(q, k, v) -> (o, lse or None) for a mode (window | compressed | full) and impl."""
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
        fwd = bench(lambda: fn(q, k, v))
        o = fn(q, k, v)[0]
        do = torch.randn_like(o)
        bwd = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        tflops = (f"{flops / fwd * 1e-9:8.1f}", f"{2.5 * flops / bwd * 1e-9:8.1f}")
        rows.append((mode, impl, n, g, f"{fwd:9.3f}", f"{bwd:9.3f}", *tflops))
    except (RuntimeError, ValueError) as exc:
        rows.append((mode, impl, n, g, "-", "-", "-", f"unsupported: {str(exc).splitlines()[0][:60]}"))
    del q, k, v
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_flash: needs a CUDA device", file=sys.stderr)
        return 2
    has_fa = flash_attn_varlen() is not None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, flash-attn {has_fa}")
    start = time.time()
    bf16, fp16 = torch.bfloat16, torch.float16
    varlen_8k = [1, 700, 3000, 4491]
    # fp16 cases share d=96 and bf16 cases d=128 (plus one d=256), so few kernels get compiled.
    cases = [
        # name, mode, impl, lengths, g, h_kv, d, dtype, backward
        ("window bf16 8K varlen g4", "window", "triton", varlen_8k, 4, 2, 128, bf16, True),
        ("window fp16 8K varlen g5 d96", "window", "triton", varlen_8k, 5, 2, 96, fp16, True),
        ("window bf16 32K g16", "window", "triton", [32768], 16, 1, 128, bf16, True),
        ("window fp16 32K varlen g5 d96", "window", "triton", [20000, 12768], 5, 2, 96, fp16, False),
        ("window bf16 8K g1 d256", "window", "triton", [8192], 1, 2, 256, bf16, True),
        ("compressed bf16 8K varlen g4", "compressed", "triton", varlen_8k, 4, 2, 128, bf16, True),
        ("compressed fp16 8K varlen g5 d96", "compressed", "triton", varlen_8k, 5, 2, 96, fp16, True),
        ("compressed bf16 32K g16", "compressed", "triton", [32768], 16, 1, 128, bf16, True),
        ("compressed fp16 32K varlen g5 d96", "compressed", "triton", [20000, 12768], 5, 2, 96, fp16, False),
        ("full triton bf16 8K varlen g4", "full", "triton", varlen_8k, 4, 2, 128, bf16, True),
        ("full triton fp16 8K varlen g5 d96", "full", "triton", varlen_8k, 5, 2, 96, fp16, True),
        ("full triton bf16 32K g4", "full", "triton", [32768], 4, 1, 128, bf16, False),
        ("full triton fp16 32K g5 d96", "full", "triton", [32768], 5, 1, 96, fp16, False),
        ("full sdpa_flash bf16 8K varlen g4", "full", "sdpa_flash", varlen_8k, 4, 2, 128, bf16, True),
        ("full sdpa_cudnn bf16 8K g4", "full", "sdpa_cudnn", [8192], 4, 2, 128, bf16, True),
    ]
    if has_fa:
        cases += [
            ("window flash_attn bf16 8K varlen g4", "window", "flash_attn", varlen_8k, 4, 2, 128, bf16, True),
            ("full flash_attn bf16 8K varlen g4", "full", "flash_attn", varlen_8k, 4, 2, 128, bf16, True),
        ]
    rows: list = []
    ok = True
    for i, case in enumerate(cases):
        try:
            ok &= check_case(*case, seed=1000 + i, rows=rows)
        except Exception as exc:  # a crash is a failure of that case, reported with the rest
            rows.append((case[0], "-", float("nan"), float("nan"), f"FAIL: {type(exc).__name__}: {exc}"))
            ok = False
    print(f"\ncorrectness ({time.time() - start:.0f} s)")
    print(f"{'case':38s} {'tensor':6s} {'max err':>10s} {'torch err':>10s}  verdict")
    for name, tensor, err, native_err, verdict in rows:
        print(f"{name:38s} {tensor:6s} {err:10.3e} {native_err:10.3e}  {verdict}")

    if not args.skip_timing:
        timing: list = []
        impls = {
            "window": ["triton"] + (["flash_attn"] if has_fa else []),
            "compressed": ["triton"],
            "full": ["sdpa_flash", "sdpa_cudnn"] + (["flash_attn"] if has_fa else []) + ["triton"],
        }
        for mode, names in impls.items():
            for n in (8192, 16384, 32768, 65536):
                for g in (1, 4, 16):
                    for impl in names:
                        time_case(mode, impl, n, g, timing)
        print(f"\ntiming: bf16, h_kv=4, d=128, one sequence, median ms ({time.time() - start:.0f} s)")
        print(f"{'op':10s} {'impl':10s} {'N':>6s} {'g':>3s} {'fwd ms':>9s} {'bwd ms':>9s} {'fwd TF/s':>8s} {'bwd TF/s':>8s}")
        for mode, impl, n, g, fwd, bwd, ftf, btf in timing:
            print(f"{mode:10s} {impl:10s} {n:6d} {g:3d} {fwd:>9s} {bwd:>9s} {ftf:>8s} {btf:>8s}")
    print(f"\ntotal {time.time() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
