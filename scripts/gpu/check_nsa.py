"""GPU check of NSA's query-outer selected-attention kernel (ops/selection/nsa.py).

1. Correctness in bf16 and fp16 at 8K-32K tokens against the fp32 reference (chunked; backward
   at 8K, where the reference's autograd graph fits in memory): max errors vs bounds
   (2 x PyTorch's own error in the dtype + the dtype floor, as in the tests).
2. Timing at 64K tokens, h_kv=4, d=128, (B, T)=(64, 16), g in {1, 4, 8, 16}, bf16, block_idx
   from reference.select_blocks on random inputs, triton.testing.do_bench medians: fwd and bwd
   through autograd (index build included), then the backward split: index build, dk/dv plan
   (torch glue), dq kernel (+ delta), dk/dv kernels (main + merge of split segments), and
   "other" = bwd - the parts (autograd, allocations). At g = 1 and 16 each kernel is also timed
   with its prefetch ablation (prefetch=False, the tuned config), whose outputs must match. Rates: useful TFLOP/s from the
   exact count of causal keys (fwd 4 * g * d per key, bwd 2.5x that), dq's K/V gather rate
   (4 * d bytes per key), dk/dv's TFLOP/s (8 * g * d per key) and q/do gather rate
   (g * (4 * d + 8) bytes per CSR entry). Byte/FLOP model and predictions: docs/perf-log-nsa.md.

Exits non-zero when a comparison fails. Runs in about 2.5 minutes on an H200, most of it Triton
compilation and autotuning; FSALAB_AUTOTUNE=0 skips autotuning (fixed configs). Writes
$OUT/check_nsa.json when OUT is set. Usage: python scripts/gpu/check_nsa.py [--skip-timing]
[--no-ablation]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
import triton

from fsalab.config import NSAConfig
from fsalab.ops import reference
from fsalab.ops.selection import nsa
from fsalab.ops.selection.index import build_selection_index, token_starts
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
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def time_case(g, rows, ablation, n=65536, h_kv=4, d=128, seed=0) -> dict:
    """Median ms of fwd, bwd and the backward's parts at one g; appended to rows and returned."""
    cfg = NSAConfig(block_size=64, topk=16)
    bs, scale = cfg.block_size, 1.0 / math.sqrt(d)
    q, k, v, cu, block_idx = random_inputs([n], g * h_kv, h_kv, d, torch.bfloat16, cfg, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    r = {"g": g}
    r["fwd"] = bench(lambda: selected_attention_nsa(q, k, v, block_idx, cu, bs))
    o, lse = selected_attention_nsa(q, k, v, block_idx, cu, bs)
    do = torch.randn_like(o)
    r["bwd"] = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))

    qd, kd, vd, od = (t.detach() for t in (q, k, v, o))
    r["index"] = bench(lambda: build_selection_index(block_idx, cu, bs))
    index = build_selection_index(block_idx, cu, bs)
    r["plan"] = bench(lambda: nsa._dkdv_plan(index, g))
    plan = nsa._dkdv_plan(index, g)
    tok_start = token_starts(cu, n)

    def fwd(pf):
        return nsa._forward(qd, kd, vd, block_idx, cu, bs, scale, prefetch=pf)[:2]

    def dq(pf):
        return nsa._bwd_dq(qd, kd, vd, od, lse, do, None, block_idx, tok_start, bs, scale, prefetch=pf)

    delta = dq(True)[1]

    def dkdv(pf):
        return nsa._bwd_dkdv(qd, kd, vd, do, lse, delta, index.token_ids, index.row_ptr, plan, bs, scale, prefetch=pf)

    for name, fn in (("fwd_k", fwd), ("dq", dq), ("dkdv", dkdv)):
        r[name] = bench(functools.partial(fn, True))
        if ablation:
            r[name + "_nopf"] = bench(functools.partial(fn, False))
            r[name + "_nopf_diff"] = max_diff(fn(True), fn(False))
    r["other"] = r["bwd"] - r["index"] - r["plan"] - r["dq"] - r["dkdv"]

    keys = causal_keys(block_idx, cu, bs)
    entries = int(index.row_ptr[-1])
    r["fwd_tflops"] = 4.0 * g * d * keys / r["fwd"] * 1e-9
    r["bwd_tflops"] = 2.5 * 4.0 * g * d * keys / r["bwd"] * 1e-9
    r["dq_kv_tbps"] = 4.0 * d * keys / r["dq"] * 1e-9
    r["dkdv_tflops"] = 8.0 * g * d * keys / r["dkdv"] * 1e-9
    r["dkdv_tbps"] = entries * g * (4.0 * d + 8) / r["dkdv"] * 1e-9
    r["max_extra"], r["extra_segments"] = plan["max_extra"], int(plan["extra_ptr"][-1])
    rows.append(r)
    return r


def print_timing(timing, ablation) -> None:
    cols = [("g", "g", 3), ("fwd", "fwd", 7), ("bwd", "bwd", 7), ("index", "index", 6), ("plan", "plan", 5),
            ("dq", "dq", 7), ("dkdv", "dk/dv", 7), ("other", "other", 6), ("fwd_k", "fwd krn", 7)]  # fmt: skip
    if ablation:
        cols += [("fwd_k_nopf", "fwd -pf", 7), ("dq_nopf", "dq -pf", 7), ("dkdv_nopf", "dk/dv -pf", 9)]
    print(" ".join(f"{title:>{w}s}" for _, title, w in cols))
    for r in timing:
        print(" ".join(f"{r[key]:{w}d}" if key == "g" else f"{r[key]:{w}.3f}" if key in r else f"{'-':>{w}s}"
                       for key, _, w in cols))  # fmt: skip
    print("(fwd, bwd: through autograd, bwd incl. index build; -pf: the kernel with prefetch=False)")
    print(f"\n{'g':>3s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'dq K/V TB/s':>12s} {'dk/dv TF/s':>11s}"
          f" {'dk/dv q/do TB/s':>16s} {'extra segments/slots':>21s}")  # fmt: skip
    for r in timing:
        print(f"{r['g']:3d} {r['fwd_tflops']:9.1f} {r['bwd_tflops']:9.1f} {r['dq_kv_tbps']:12.2f} {r['dkdv_tflops']:11.1f}"
              f" {r['dkdv_tbps']:16.2f} {r['extra_segments']:>15d}/{r['max_extra']:<5d}")  # fmt: skip
    if ablation:
        diffs = {name: max(r.get(name + "_nopf_diff", 0.0) for r in timing) for name in ("fwd_k", "dq", "dkdv")}
        print("prefetch=False vs True, max |output difference| (fails above 1e-2): "
              + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--no-ablation", action="store_true", help="skip the prefetch=False kernel timings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_nsa: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.time()

    default = NSAConfig()  # l=32, s=16, B=64, T=16
    # Shape keys (d, g, block size, dtype) shared with the timing below where possible: every new
    # key compiles and autotunes all configs of three kernels.
    cases = [
        # name, lengths, g, h_kv, d, dtype, cfg, backward
        ("bf16 8K g4 d128 fwd+bwd", [8192], 4, 2, 128, torch.bfloat16, default, True),
        ("fp16 8K varlen g5 d96 fwd+bwd", [1, 700, 3000, 4491], 5, 2, 96, torch.float16, default, True),
        ("bf16 8K 50 short+1 long g16 fwd+bwd", [5] * 40 + [100] * 10 + [7000], 16, 2, 128, torch.bfloat16, default,
         True),
        ("bf16 32K varlen g8 d128 fwd", [20000, 12768], 8, 4, 128, torch.bfloat16, default, False),
        ("bf16 32K g1 d128 fwd", [32768], 1, 4, 128, torch.bfloat16, default, False),
        ("bf16 32K g16 d128 fwd", [32768], 16, 4, 128, torch.bfloat16, default, False),
    ]
    rows: list = []
    ok = True
    for i, case in enumerate(cases):
        ok &= check_case(*case, seed=1000 + i, rows=rows)
    print(f"\ncorrectness ({time.time() - start:.0f} s)")
    print(f"{'case':38s} {'tensor':6s} {'max err':>10s} {'torch err':>10s}  verdict")
    for name, tensor, err, native_err, verdict in rows:
        print(f"{name:38s} {tensor:6s} {err:10.3e} {native_err:10.3e}  {verdict}")

    record: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "correctness": [dict(zip(("case", "tensor", "max_err", "torch_err", "verdict"), r)) for r in rows]}
    if not args.skip_timing:
        timing: list = []
        ablation = not args.no_ablation
        for g in (1, 4, 8, 16):
            time_case(g, timing, ablation and g in (1, 16))  # the ablation at the extremes only: compile time
            torch.cuda.empty_cache()  # the case's tensors died with its frame
        print("\nautotuned configs (key: d, g, block_size, dtypes...):")
        for kernel in (nsa._fwd_kernel, nsa._bwd_dq_kernel, nsa._bwd_dkdv_kernel):
            if isinstance(kernel, triton.runtime.Autotuner):  # FSALAB_AUTOTUNE=0: the fixed configs
                for key, config in kernel.cache.items():
                    print(f"  {kernel.fn.__name__:24s} {key[:3]} {config}")
                    record.setdefault("configs", []).append([kernel.fn.__name__, list(key[:3]), str(config)])
        # Last, so that run_checks.sh's tail shows it.
        print(f"\ntiming: N=64K, h_kv=4, d=128, (B,T)=(64,16), bf16, median ms ({time.time() - start:.0f} s)")
        print_timing(timing, ablation)
        print("public NSA Triton kernel (fla-org), H100, 64 q / 4 KV heads (g=16): ~24.5 ms fwd, ~33.8 ms bwd")
        record["timing"] = timing
        if ablation:  # same arithmetic, so a difference means a broken variant
            ok &= all(r.get(f"{name}_nopf_diff", 0.0) <= 1e-2 for r in timing for name in ("fwd_k", "dq", "dkdv"))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_nsa.json"), "w") as f:
            json.dump(record, f, indent=1)
    print(f"\ntotal {time.time() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
