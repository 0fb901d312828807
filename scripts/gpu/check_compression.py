"""GPU check of ops/compression.py: compress_kv and select_blocks.

1. Correctness in bf16 and fp16 against ops/reference.py at 8K and 32K tokens (packed varlen):
   compress_kv forward and all five gradients within 2x PyTorch's own error in that dtype, and a
   second backward bitwise equal to the first;
   select_blocks a valid top-T under fp32 reference scores everywhere and equal to
   reference.select_blocks on every row without a near-tie at the top-T boundary.
2. Timing (triton.testing.do_bench, median) of compress_kv fwd/bwd (and of the torch
   formulation, reference.compress_kv in bf16, for comparison) and of select_blocks at
   8K–256K tokens, h_kv=4, d=128, g in {1, 4, 16}, (B, T) in {(64, 16), (128, 8)}, bf16, plus the
   peak memory select_blocks adds at 256K. Timing inputs are random; lse_cmp is the expected
   log-normaliser log(n_visible) + |q|^2 scale^2 / 2 of random keys, not a real compressed
   attention (the selection cost does not depend on it).

Exit status 1 on any correctness failure. Timing points reached after --budget seconds (210 by
default, compilation included) are reported as skipped, so a run stays under 4 minutes.

    python scripts/gpu/check_compression.py [--json results.json] [--budget 210]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
from triton.testing import do_bench

from fsalab.config import NSAConfig
from fsalab.ops import reference
from fsalab.ops.compression import compress_kv, select_blocks
from fsalab.testing import assert_close, check_selection, cu_seqlens_of
from fsalab.varlen import compressed_cu_seqlens, local_positions

DEV = torch.device("cuda")
H_KV, D = 4, 128
PAIRS = [(64, 16), (128, 8)]


def compress_params(lengths, h_kv, d, cfg, dtype, gen, grad):
    total, l = sum(lengths), cfg.kernel_size

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype).requires_grad_(grad)

    w_scale = (l * d) ** -0.5
    return [rnd(total, h_kv, d), rnd(total, h_kv, d), rnd(h_kv, l * d, d, scale=w_scale),
            rnd(h_kv, l * d, d, scale=w_scale), rnd(h_kv, l, d, scale=0.5)], cu_seqlens_of(lengths, DEV)


def compare_compress_forward(params, cu, cfg):
    """compress_kv's (k_cmp, v_cmp) against the fp32 reference; returns (outputs, reference outputs)."""
    outs = compress_kv(*params, cu, cfg)[:2]
    ref = reference.compress_kv(*params, cu, cfg)[:2]
    with reference.native_precision():
        nat = reference.compress_kv(*params, cu, cfg)[:2]
    for name, a, b, c in zip(("k_cmp", "v_cmp"), outs, ref, nat):
        assert_close(a, b, c, name=name)
    return outs, ref


def check_compress(lengths, dtype, gen):
    cfg = NSAConfig()
    params, cu = compress_params(lengths, H_KV, D, cfg, dtype, gen, grad=True)
    outs, ref = compare_compress_forward(params, cu, cfg)
    upstream = [torch.randn(o.shape, generator=gen, device=DEV) for o in outs]

    def grads(o):
        return torch.autograd.grad(o, params, [u.to(x.dtype) for x, u in zip(o, upstream)])

    got, want = grads(outs), grads(ref)
    with reference.native_precision():
        native = grads(reference.compress_kv(*params, cu, cfg)[:2])
    for name, a, b, c in zip(("dk", "dv", "dw_k", "dw_v", "dpe"), got, want, native):
        assert_close(a, b, c, dtype=dtype, name=name)
    again = grads(compress_kv(*params, cu, cfg)[:2])
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "backward is not bitwise deterministic"
    return "ok (fwd, 5 grads, bitwise-deterministic backward)"


def check_select(lengths, g, cfg, dtype, gen):
    cu = cu_seqlens_of(lengths, DEV)
    total = sum(lengths)
    q = torch.randn(total, H_KV * g, D, generator=gen, device=DEV).to(dtype)
    k_cmp = torch.randn(total // cfg.kernel_stride, H_KV, D, generator=gen, device=DEV).to(dtype)
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = reference.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    got = select_blocks(q, k_cmp, lse.float(), cu, cu_cmp, cfg)
    expected = reference.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = reference.block_scores(q, k_cmp, lse, cu, cu_cmp, cfg)
    near = check_selection(got, expected, scores, cu, cfg)
    exact = int((got == expected).all(-1).sum())
    return f"ok ({exact}/{total * H_KV} rows identical, {near} near-tie rows)"


def check_select_long(n, g, cfg, gen):
    """select_blocks on one sequence of n tokens against the fp32 reference, rows checked in slices
    (the dense [n, h_kv, n / B] score table is built once; sorting it whole would not fit)."""
    cu = cu_seqlens_of([n], DEV)
    q = torch.randn(n, H_KV * g, D, generator=gen, device=DEV).to(torch.bfloat16)
    k_cmp = torch.randn(n // cfg.kernel_stride, H_KV, D, generator=gen, device=DEV).to(torch.bfloat16)
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = reference.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    got = select_blocks(q, k_cmp, lse.float(), cu, cu_cmp, cfg)
    expected = reference.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = reference.block_scores(q, k_cmp, lse, cu, cu_cmp, cfg)
    del q, k_cmp, lse
    near, rows = 0, 8192
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        near += check_selection(got[lo:hi], expected[lo:hi], scores[lo:hi], cu, cfg,
                                positions=torch.arange(lo, hi, device=DEV))
    exact = int((got == expected).all(-1).sum())
    return f"ok ({exact}/{n * H_KV} rows identical, {near} near-tie rows)"


def long_correctness(sizes, gen) -> list[str]:
    """Compression + top-k at long context: compress_kv forward and select_blocks for g in {1, 4, 16}."""
    cases = []
    for n in sizes:
        cases.append((f"compress_kv fwd N={n} bf16", lambda n=n: check_compress_fwd(n, gen)))
        for g, (bs, topk) in ((1, (64, 16)), (16, (64, 16)), (4, (128, 8))):
            cases.append((f"select_blocks N={n} g={g} ({bs},{topk}) bf16",
                          lambda n=n, g=g, bs=bs, topk=topk: check_select_long(n, g, NSAConfig(block_size=bs, topk=topk), gen)))
    return run_cases(cases)


def run_cases(cases) -> list[str]:
    """Run (name, fn) checks, print each verdict and time; returns the names that failed."""
    failures = []
    for name, fn in cases:
        t = time.time()
        try:
            print(f"[check] {name}: {fn()} [{time.time() - t:.0f} s]", flush=True)
        except Exception as exc:  # noqa: BLE001 - report the failing case and go on
            failures.append(name)
            print(f"[FAIL] {name}: {exc}", flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
    return failures


def check_compress_fwd(n, gen):
    cfg = NSAConfig()
    params, cu = compress_params([n], H_KV, D, cfg, torch.bfloat16, gen, grad=False)
    compare_compress_forward(params, cu, cfg)
    return "ok (k_cmp, v_cmp)"


def correctness(gen) -> list[str]:
    cases = []
    for n, lengths in ((8192, [5000, 31, 1, 2900, 260]), (32768, [32768])):
        for dtype in (torch.bfloat16, torch.float16) if n == 8192 else (torch.bfloat16,):
            cases.append((f"compress_kv N={n} {dtype}", lambda lengths=lengths, dtype=dtype: check_compress(lengths, dtype, gen)))
        for g in (1, 5, 16):
            cases.append((f"select_blocks N={n} g={g} (64,16) bf16",
                          lambda lengths=lengths, g=g: check_select(lengths, g, NSAConfig(), torch.bfloat16, gen)))
    lengths = [5000, 31, 1, 2900, 260]
    cases.append(("select_blocks N=8192 g=4 (128,8) bf16",
                  lambda: check_select(lengths, 4, NSAConfig(block_size=128, topk=8), torch.bfloat16, gen)))
    cases.append(("select_blocks N=8192 g=4 (64,16) fp16", lambda: check_select(lengths, 4, NSAConfig(), torch.float16, gen)))
    return run_cases(cases)


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def synthetic_lse(q, cu, cfg, scale):
    """log(n_visible) + |q|^2 scale^2 / 2: the log-normaliser of random N(0, 1) keys; -inf if none visible."""
    pos = local_positions(cu, q.shape[0])
    n_vis = torch.where(pos >= cfg.kernel_size - 1, (pos - cfg.kernel_size + 1) // cfg.kernel_stride + 1, 0)
    lse = torch.log(n_vis.float())[:, None] + q.float().pow(2).sum(-1) * (scale**2 / 2)
    return torch.where(n_vis[:, None] > 0, lse, torch.full_like(lse, float("-inf")))


def timing(sizes, deadline, gen) -> list[dict]:
    rows = []

    def record(**row):
        rows.append({"h_kv": H_KV, "d": D, "dtype": "bfloat16", **row})
        ms = row.get("median_ms")
        extra = f", peak +{row['peak_mem_gib']:.3f} GiB" if "peak_mem_gib" in row else ""
        print(f"[time] {row['op']:<13} {row['impl']:<6} {row['direction']:<3} N={row['N']:<6} g={row.get('g', '-'):<2} "
              f"B,T={row.get('block_size', '-')},{row.get('topk', '-')}: " + (f"{ms:.3f} ms" if ms is not None else row["status"]) + extra,
              flush=True)

    cfg = NSAConfig()

    def select_args(n, g, pcfg):
        cu = cu_seqlens_of([n], DEV)
        q = torch.randn(n, H_KV * g, D, generator=gen, device=DEV).to(torch.bfloat16)
        k_cmp = torch.randn(n // pcfg.kernel_stride, H_KV, D, generator=gen, device=DEV).to(torch.bfloat16)
        cu_cmp = compressed_cu_seqlens(cu, pcfg.kernel_size, pcfg.kernel_stride)
        return q, k_cmp, synthetic_lse(q, cu, pcfg, 1.0 / math.sqrt(D)), cu, cu_cmp, pcfg

    # Peak memory first (it must not be lost to the time budget): what select_blocks adds on top of its inputs.
    n = sizes[-1]
    for g in (1, 16):
        args = select_args(n, g, cfg)
        select_blocks(*args)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        select_blocks(*args)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        record(op="select_blocks", impl="triton", direction="fwd", N=n, g=g, block_size=cfg.block_size, topk=cfg.topk,
               median_ms=None, peak_mem_gib=peak, status="peak memory only")
        del args
        torch.cuda.empty_cache()

    for n in sizes:
        if time.time() > deadline:
            record(op="compress_kv", impl="triton", direction="fwd", N=n, status="skipped (time budget)")
            continue
        params, cu = compress_params([n], H_KV, D, cfg, torch.bfloat16, gen, grad=True)
        plain = [p.detach() for p in params]
        for impl, fn in (("triton", compress_kv), ("torch", reference.compress_kv)):
            native = reference.native_precision if impl == "torch" else contextlib.nullcontext

            def fwd(fn=fn, native=native, plain=plain, cu=cu):
                with native():
                    return fn(*plain, cu, cfg)

            record(op="compress_kv", impl=impl, direction="fwd", N=n, median_ms=bench(fwd), status="ok")
            with native():
                outs = fn(*params, cu, cfg)[:2]
            ups = [torch.randn_like(o) for o in outs]
            record(op="compress_kv", impl=impl, direction="bwd", N=n, status="ok",
                   median_ms=bench(lambda outs=outs, ups=ups, params=params: torch.autograd.grad(outs, params, ups,
                                                                                          retain_graph=True)))
            del outs, ups
        del params, plain
        torch.cuda.empty_cache()

    for n in sizes:
        for g in (1, 4, 16):
            for bs, topk in PAIRS:
                point = {"op": "select_blocks", "impl": "triton", "direction": "fwd", "N": n, "g": g, "block_size": bs,
                         "topk": topk}
                if time.time() > deadline:
                    record(**point, status="skipped (time budget)")
                    continue
                args = select_args(n, g, NSAConfig(block_size=bs, topk=topk))
                record(**point, median_ms=bench(lambda args=args: select_blocks(*args)), status="ok")
                del args
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write timing rows here")
    parser.add_argument("--budget", type=float, default=210.0, help="seconds for the whole run; later timing points are skipped")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072, 262144])
    parser.add_argument("--long", type=int, nargs="*", default=None,
                        help="only the long-context correctness checks, at these lengths (e.g. 131072 262144)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references in true fp32
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    t0 = time.time()
    if args.long is not None:
        failures = long_correctness(args.long or [131072, 262144], gen)
        print("FAILED: " + ", ".join(failures) if failures else "all long-context checks passed", flush=True)
        return 1 if failures else 0
    failures = correctness(gen)
    print(f"[check] correctness phase: {time.time() - t0:.1f} s, {len(failures)} failure(s)", flush=True)
    t1 = time.time()
    rows = timing(args.sizes, t0 + args.budget, gen)
    print(f"[time] timing phase: {time.time() - t1:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"failures": failures, "lse": "synthetic (see docstring)", "rows": rows}, indent=1))
    if failures:
        print("FAILED: " + ", ".join(failures), flush=True)
        return 1
    print("all correctness checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
