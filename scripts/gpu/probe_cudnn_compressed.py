"""Probe: compressed attention as cuDNN causal GQA attention over query groups.

Query t (local position) sees compressed key j iff t >= j*s + l - 1. Queries from l - 1 on, cut
into groups of s consecutive tokens (group a = (t - (l - 1)) // s), see exactly keys j <= a: a
top-left causal mask between A = ceil((n - l + 1) / s) query groups and the n_cmp = A compressed
keys. The s tokens x g heads of a group sharing a KV head become s*g query heads of one GQA
group, so the whole branch is one dense causal attention [1, h_kv*s*g, A, d] x [1, h_kv, A, d].

Checks o and lse against fsalab's Triton compressed attention (bf16) and times both, forward
and forward+backward, at 64K for g in 1, 4, 5, 8.

    python scripts/gpu/probe_cudnn_compressed.py --json $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench

from fsalab.config import NSAConfig
from fsalab.ops.compression import compressed_attention
from fsalab.testing import cu_seqlens_of
from fsalab.varlen import compressed_cu_seqlens

DEV = torch.device("cuda")


def grouped_cudnn(q, k_cmp, v_cmp, cfg, scale):
    """o [n, h, d], lse [n, h] (natural log) of one sequence through cuDNN."""
    n, h, d = q.shape
    h_kv = k_cmp.shape[1]
    g, l, s = h // h_kv, cfg.kernel_size, cfg.kernel_stride
    n_cmp = k_cmp.shape[0]
    m = n - (l - 1)
    a = n_cmp
    qg = q.new_zeros((a * s, h, d))
    qg[:m] = q[l - 1:]
    qg = qg.view(a, s, h_kv, g, d).permute(2, 1, 3, 0, 4).reshape(1, h_kv * s * g, a, d)
    kg = k_cmp.permute(1, 0, 2).unsqueeze(0)
    vg = v_cmp.permute(1, 0, 2).unsqueeze(0)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(qg, kg, vg, None, True, 0.0, True, False, scale=scale)
    og, lse = out[0], out[1]
    o = og.reshape(h_kv, s, g, a, d).permute(3, 1, 0, 2, 4).reshape(a * s, h, d)
    lse = lse.reshape(h_kv, s, g, a).permute(3, 1, 0, 2).reshape(a * s, h)
    full_o = q.new_zeros((n, h, d))
    full_o[l - 1:] = o[:m]
    full_lse = torch.full((n, h), float("-inf"), device=q.device)
    full_lse[l - 1:] = lse[:m].float()
    return full_o, full_lse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    cfg = NSAConfig()
    res = {}
    gen = torch.Generator(device=DEV).manual_seed(7)
    for n, g in ((4096 + 37, 4), (65536, 1), (65536, 4), (65536, 5), (65536, 8)):
        h_kv, d = 4, 128
        h = h_kv * g
        cu = cu_seqlens_of([n], DEV)
        cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
        n_cmp = (n - cfg.kernel_size) // cfg.kernel_stride + 1
        q = torch.randn(n, h, d, generator=gen, device=DEV).to(torch.bfloat16).requires_grad_()
        k = torch.zeros(n // cfg.kernel_stride, h_kv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        k[:n_cmp] = torch.randn(n_cmp, h_kv, d, generator=gen, device=DEV).to(torch.bfloat16)
        v[:n_cmp] = torch.randn(n_cmp, h_kv, d, generator=gen, device=DEV).to(torch.bfloat16)
        k.requires_grad_(), v.requires_grad_()
        scale = 1 / math.sqrt(d)
        key = f"N{n} g{g}"
        entry = {}
        try:
            o_t, lse_t = compressed_attention(q, k, v, cu, cu_cmp, cfg)
            o_c, lse_c = grouped_cudnn(q, k[:n_cmp], v[:n_cmp], cfg, scale)
            fin = torch.isfinite(lse_t)
            entry["o_max_abs_diff"] = float((o_t.float() - o_c.float()).abs().max())
            entry["o_rel"] = float((o_t.float() - o_c.float()).norm() / o_t.float().norm())
            entry["lse_finite_match"] = bool(torch.equal(fin, torch.isfinite(lse_c)))
            entry["lse_max_abs_diff"] = float((lse_t[fin] - lse_c[fin]).abs().max())
            do = torch.randn(o_t.shape, generator=gen, device=DEV).to(torch.bfloat16)
            gt = torch.autograd.grad(o_t, (q, k, v), do)
            gc = torch.autograd.grad(o_c, (q, k, v), do)
            entry["grad_rel"] = [float((a.float() - b.float()).norm() / a.float().norm().clamp(min=1e-30)) for a, b in zip(gt, gc)]
            with torch.no_grad():
                entry["triton_fwd_ms"] = do_bench(lambda: compressed_attention(q, k, v, cu, cu_cmp, cfg), warmup=25, rep=200, return_mode="median")
                entry["cudnn_fwd_ms"] = do_bench(lambda: grouped_cudnn(q, k[:n_cmp], v[:n_cmp], cfg, scale), warmup=25, rep=200, return_mode="median")

            def fb_t():
                return torch.autograd.grad(compressed_attention(q, k, v, cu, cu_cmp, cfg)[0], (q, k, v), do)

            def fb_c():
                return torch.autograd.grad(grouped_cudnn(q, k[:n_cmp], v[:n_cmp], cfg, scale)[0], (q, k, v), do)

            entry["triton_fwdbwd_ms"] = do_bench(fb_t, warmup=25, rep=200, return_mode="median")
            entry["cudnn_fwdbwd_ms"] = do_bench(fb_c, warmup=25, rep=200, return_mode="median")
            flops = 4 * d * h * sum(max(0, (t - cfg.kernel_size) // cfg.kernel_stride + 1) for t in range(0, n, 64)) * 64
            entry["useful_tflops_fwd"] = {"triton": flops / entry["triton_fwd_ms"] / 1e9, "cudnn": flops / entry["cudnn_fwd_ms"] / 1e9}
        except Exception as exc:  # noqa: BLE001 - the probe reports what failed
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        res[key] = entry
        print(key, entry, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
