"""compress_kv's dpe kernel: the tree's (rows summed elementwise into a [min(64, 8192/d), d] tile,
one cross-row reduction after the loop) against the kernel of 87e44cf (a cross-row reduction in
every step of the loop, 64 rows per step), same inputs, one process.

dpe[h, x] = sum_n w_k[h, x, n] * sum_r dk_cmp[r, h, n]; at 64K tokens, stride 16: 4096 rows,
4 KV heads, l = 32. Outputs compared (fp32 sums of the same rows in another order: equal to
~1e-6 relative), then each kernel timed alone (do_bench median, L2 flushed).
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/ab-dpe-tile/ab_dpe.py out.json
"""
import json
import sys

import torch
import triton
import triton.language as tl

from fsalab.ops._triton import cdiv, next_pow2
from fsalab.ops.compress_kv import _compress_dpe_kernel


@triton.jit
def _dpe_per_step_reduction(
    dkc_ptr, wk_ptr, dpe_ptr, tab_ptr, rows, s_gt, s_gh, s_wh, s_wx, s_ph,
    HEAD_DIM: tl.constexpr, LX: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
):
    """The dpe kernel as of 87e44cf (the A side): a [D_PAD] sum updated by a reduction per step."""
    h = tl.program_id(0)
    nn = tl.arange(0, D_PAD)
    n_ok = nn < HEAD_DIM
    dsum = tl.zeros([D_PAD], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        valid = tl.load(tab_ptr + r, mask=r < rows, other=-1) >= 0
        g = tl.load(dkc_ptr + r.to(tl.int64)[:, None] * s_gt + h * s_gh + nn[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0)
        dsum += tl.sum(g.to(tl.float32), axis=0)
    xx = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    x_ok = xx < LX
    w = tl.load(wk_ptr + h * s_wh + xx[:, None] * s_wx + nn[None, :], mask=x_ok[:, None] & n_ok[None, :], other=0.0)
    dpe = tl.sum(w.to(tl.float32) * dsum[None, :], axis=1)
    tl.store(dpe_ptr + h * s_ph + xx, dpe.to(dpe_ptr.dtype.element_ty), mask=x_ok)


def launch(kernel, dkc, w_k, dpe, tab, block_r):
    h_kv, lx, d = w_k.shape
    kernel[(h_kv, cdiv(lx, 64))](dkc, w_k, dpe, tab, dkc.shape[0], dkc.stride(0), dkc.stride(1), w_k.stride(0),
                                 w_k.stride(1), dpe.stride(0), HEAD_DIM=d, LX=lx, D_PAD=next_pow2(max(d, 16)),
                                 BLOCK_R=block_r, BLOCK_X=64)


dev = torch.device("cuda")
res = {}
for n_tok, d in ((65536, 128), (131072, 128), (65536, 64), (65536, 256)):
    torch.manual_seed(0)
    rows, h_kv, l = n_tok // 16, 4, 32
    dkc = torch.randn(rows, h_kv, d, device=dev, dtype=torch.bfloat16)
    w_k = (torch.randn(h_kv, l * d, d, device=dev) * d ** -0.5).to(torch.bfloat16)
    tab = torch.zeros(3, rows, dtype=torch.int32, device=dev)
    pe_a = torch.empty(h_kv, l, d, device=dev, dtype=torch.bfloat16)
    pe_b = torch.empty_like(pe_a)
    d_pad = next_pow2(max(d, 16))
    old = lambda: launch(_dpe_per_step_reduction, dkc, w_k, pe_a, tab, 64)
    new = lambda: launch(_compress_dpe_kernel, dkc, w_k, pe_b, tab, min(64, 8192 // d_pad))
    old(), new()
    torch.cuda.synchronize()
    ref = (w_k.float() @ dkc.float().sum(0)[..., None]).squeeze(-1).view(h_kv, l, d)
    err = lambda p: ((p.float() - ref).abs().max() / ref.abs().max()).item()
    ms = {name: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
          for name, fn in (("old", old), ("new", new), ("old2", old), ("new2", new))}
    tag = f"N{n_tok}-d{d}"
    res[tag] = {"rel_err_old": err(pe_a), "rel_err_new": err(pe_b), **{f"{k}_ms": v for k, v in ms.items()}}
    print(tag, json.dumps({k: round(v, 5) for k, v in res[tag].items()}), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
print("\npoint          old ms   new ms   new/old")
for tag, r in res.items():
    o, n = (r["old_ms"] + r["old2_ms"]) / 2, (r["new_ms"] + r["new2_ms"]) / 2
    print(f"{tag:14s} {o:7.4f} {n:7.4f} {n / o:7.3f}")
