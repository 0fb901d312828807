"""GPU check of NSA's query-outer selected-attention kernel (ops/selection/nsa.py).

1. Correctness in bf16 and fp16 at 8K-64K tokens against the fp32 reference (chunked; backward
   at 8K, where the reference's autograd graph fits in memory): max errors vs bounds
   (2 x PyTorch's own error in the dtype + the dtype floor, as in the tests).
2. Timing at 64K tokens, h_kv=4, d=128, (B, T)=(64, 16), g in {1, 4, 8, 16}, bf16, block_idx
   from reference.select_blocks on random inputs: fwd, bwd (index build included) and the index
   build alone, triton.testing.do_bench medians, with useful TFLOP/s from the exact count of
   causal keys (fwd 4 * g * d per key, bwd 2.5x that) and the 4*N*h*T*B*d approximation.

Exits non-zero when a comparison fails. Runs in about 3 minutes on an H200, most of it Triton
compilation and autotuning (5 shape keys x 4 kernels x 3-4 configs); FSALAB_AUTOTUNE=0 skips
autotuning (default configs). Usage: python scripts/gpu/check_nsa.py [--skip-timing]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import triton

from fsalab.config import NSAConfig
from fsalab.ops import reference
from fsalab.ops.selection import nsa
from fsalab.ops.selection.index import build_selection_index
from fsalab.ops.selection.nsa import selected_attention_nsa
from fsalab.testing import assert_close, cu_seqlens_of, max_error
from fsalab.varlen import local_positions

DEVICE = torch.device("cuda")


def random_inputs(lengths, h, h_kv, d, dtype, cfg, seed):
    """q, k, v N(0, 1) on the GPU, cu_seqlens, and block_idx from NSA's compression + top-k path."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, h, d, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(total, h_kv, d, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(total, h_kv, d, device=DEVICE, generator=gen).to(dtype)
    cu = cu_seqlens_of(lengths, DEVICE)
    l = cfg.kernel_size
    w_k = torch.randn(h_kv, l * d, d, device=DEVICE, generator=gen) / math.sqrt(l * d)
    w_v = torch.randn(h_kv, l * d, d, device=DEVICE, generator=gen) / math.sqrt(l * d)
    pe = torch.randn(h_kv, l, d, device=DEVICE, generator=gen) * 0.1
    with torch.no_grad():
        k_cmp, v_cmp, cu_cmp = reference.compress_kv(k.float(), v.float(), w_k, w_v, pe, cu, cfg)
        _, lse_cmp = reference.compressed_attention(q.float(), k_cmp, v_cmp, cu, cu_cmp, cfg)
        block_idx = reference.select_blocks(q.float(), k_cmp, lse_cmp, cu, cu_cmp, cfg)
    del k_cmp, v_cmp, lse_cmp
    return q, k, v, cu, block_idx


def run(q, k, v, block_idx, cu, block_size, do, impl, backward):
    """(o, lse[, dq, dk, dv]) of the kernel or the reference for loss sum(o * do)."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        if impl == "nsa":
            o, lse = selected_attention_nsa(*leaves, block_idx, cu, block_size)
        else:
            o, lse = reference.selected_attention(*leaves, block_idx, cu, block_size)
        out = [o.detach(), lse.detach()]
        if backward:
            out += list(torch.autograd.grad(o, leaves, do.to(o.dtype)))
    return out


def check_case(name, lengths, g, h_kv, d, dtype, cfg, backward, seed, rows) -> bool:
    q, k, v, cu, block_idx = random_inputs(lengths, g * h_kv, h_kv, d, dtype, cfg, seed)
    do = torch.randn_like(q)
    actual = run(q, k, v, block_idx, cu, cfg.block_size, do, "nsa", backward)
    expected = run(q.float(), k.float(), v.float(), block_idx, cu, cfg.block_size, do, "ref", backward)
    with reference.native_precision():
        native = run(q, k, v, block_idx, cu, cfg.block_size, do, "ref", backward)
    ok = True
    for i, tensor in enumerate(("o", "lse", "dq", "dk", "dv")[: len(actual)]):
        try:
            assert_close(actual[i], expected[i], native[i], dtype=dtype, name=tensor)
            verdict = "ok"
        except AssertionError as exc:
            verdict, ok = f"FAIL: {exc}", False
        rows.append((name, tensor, max_error(actual[i], expected[i]), max_error(native[i], expected[i]), verdict))
    del q, k, v, actual, expected, native
    torch.cuda.empty_cache()
    return ok


def causal_keys(block_idx, cu, block_size) -> int:
    """Keys actually attended, summed over tokens and KV heads (valid blocks, causal in the own block)."""
    pos = local_positions(cu, block_idx.shape[0])[:, None, None]
    blk = block_idx.long()
    keys = (pos - blk * block_size + 1).clamp(0, block_size)
    return int(torch.where(blk >= 0, keys, 0).sum())


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def time_case(g, rows, n=65536, h_kv=4, d=128, seed=0):
    cfg = NSAConfig(block_size=64, topk=16)
    q, k, v, cu, block_idx = random_inputs([n], g * h_kv, h_kv, d, torch.bfloat16, cfg, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fwd_ms = bench(lambda: selected_attention_nsa(q, k, v, block_idx, cu, cfg.block_size))
    o, _ = selected_attention_nsa(q, k, v, block_idx, cu, cfg.block_size)
    do = torch.randn_like(o)
    bwd_ms = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    index_ms = bench(lambda: build_selection_index(block_idx, cu, cfg.block_size))
    fwd_flops = 4.0 * g * d * causal_keys(block_idx, cu, cfg.block_size)
    approx_flops = 4.0 * n * g * h_kv * cfg.topk * cfg.block_size * d
    rows.append((g, fwd_ms, bwd_ms, index_ms, fwd_flops / fwd_ms * 1e-9, 2.5 * fwd_flops / bwd_ms * 1e-9,
                 approx_flops / fwd_ms * 1e-9))  # fmt: skip
    del q, k, v, o, do
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_nsa: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.time()

    default = NSAConfig()  # l=32, s=16, B=64, T=16
    # Shape keys (d, g, block size, dtype) shared with the timing below where possible: every new
    # key compiles and autotunes all configs of four kernels.
    cases = [
        # name, lengths, g, h_kv, d, dtype, cfg, backward
        ("bf16 8K g4 d128 fwd+bwd", [8192], 4, 2, 128, torch.bfloat16, default, True),
        ("fp16 8K varlen g5 d96 fwd+bwd", [1, 700, 3000, 4491], 5, 2, 96, torch.float16, default, True),
        ("bf16 8K 50 short+1 long g16 fwd+bwd", [5] * 40 + [100] * 10 + [7000], 16, 2, 128, torch.bfloat16, default,
         True),  # fmt: skip
        ("bf16 32K varlen g8 d128 fwd", [20000, 12768], 8, 4, 128, torch.bfloat16, default, False),
        ("bf16 64K g1 d128 fwd", [65536], 1, 4, 128, torch.bfloat16, default, False),
        ("bf16 64K g16 d128 fwd", [65536], 16, 4, 128, torch.bfloat16, default, False),
    ]
    rows: list = []
    ok = True
    for i, case in enumerate(cases):
        ok &= check_case(*case, seed=1000 + i, rows=rows)
    print(f"\ncorrectness ({time.time() - start:.0f} s)")
    print(f"{'case':38s} {'tensor':6s} {'max err':>10s} {'torch err':>10s}  verdict")
    for name, tensor, err, native_err, verdict in rows:
        print(f"{name:38s} {tensor:6s} {err:10.3e} {native_err:10.3e}  {verdict}")

    if not args.skip_timing:
        timing: list = []
        for g in (1, 4, 8, 16):
            time_case(g, timing)
        print(f"\ntiming: N=64K, h_kv=4, d=128, (B,T)=(64,16), bf16, median ms ({time.time() - start:.0f} s)")
        header = ("g", "fwd ms", "bwd ms", "index ms", "fwd TF/s", "bwd TF/s", "fwd TF/s (4NhTBd)")
        print(" ".join(f"{name:>{w}s}" for name, w in zip(header, (3, 8, 8, 9, 9, 9, 18))))
        for g, fwd, bwd, idx, ftf, btf, atf in timing:
            print(f"{g:3d} {fwd:8.3f} {bwd:8.3f} {idx:9.3f} {ftf:9.1f} {btf:9.1f} {atf:18.1f}")
        print("public NSA Triton kernel (fla-org), H100, 64 q / 4 KV heads (g=16): ~24.5 ms fwd, ~33.8 ms bwd")
        print("\nautotuned configs (key: d, g, block_size, dtypes...):")
        for kernel in (nsa._fwd_kernel, nsa._bwd_dq_kernel, nsa._bwd_dkdv_kernel, nsa._bwd_dkdv_extra_kernel):
            if isinstance(kernel, triton.runtime.Autotuner):  # not when FSALAB_AUTOTUNE=0
                for key, config in kernel.cache.items():
                    print(f"  {kernel.fn.__name__:24s} {key[:3]} {config}")
    print(f"\ntotal {time.time() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
