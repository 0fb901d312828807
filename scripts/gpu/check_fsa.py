"""GPU check of FSA's KV-block-outer selected attention (ops/selection/fsa*.py), both variants.

1. Correctness in bf16 and fp16 against the fp32 reference (chunked): forward + backward at 8K
   tokens (where the reference's autograd graph fits in memory), forward at 32K and 64K;
   h_kv = 4, d = 128, g in {1, 4, 5, 8}, block_idx from NSA's compression path on random
   inputs. Bound: 2 x PyTorch's own error in the dtype + the dtype floor, as in the tests.
   ``fsa`` and ``fsa_paper`` (default switches) everywhere; the paper's ablation switches on
   one 8K case. Then a host-sync check: fwd + bwd of both under
   torch.cuda.set_sync_debug_mode("error").
2. Timing (triton.testing.do_bench medians, bf16, h_kv = 4, d = 128): N in {8K, 16K, 32K, 64K},
   g in {1, 2, 4, 8, 16}, (B, T) in {(64, 16), (128, 8)}; fsa, fsa_paper and nsa (when
   importable), fwd and bwd (through autograd; index build included in fwd, as every call
   pays it; NSA with its default configs unless --nsa-autotune), useful TFLOP/s from the exact count of causally attended keys (fwd 4 d per key
   and query head, bwd 2.5x), and extra memory (peak allocated minus what was allocated before,
   outputs excluded: the buffers). The paper's ablation (Fig. 9: without inner loop, without
   early return, neither) at g in {1, 4}. Points run most important first (the targets: 64K g=1
   and g=8 at (64, 16), 8K g=1) and stop once --budget seconds have passed, so the script stays
   under 6 minutes; skipped points are listed.

Targets (H200, 4 KV heads, d = 128, bf16): 64K g=1 (64,16): fsa fwd <= 2.5 ms, bwd <= 5 ms;
64K g=8: fwd <= 6 ms, bwd <= 12 ms; 8K g=1: fwd <= 0.4 ms.

Exits non-zero when a comparison fails. Writes $OUT/check_fsa.json when OUT is set.
Usage: python scripts/gpu/check_fsa.py [--skip-timing] [--budget SECONDS] [--nsa-autotune]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import triton

if "--nsa-autotune" not in sys.argv:  # read at import: every kernel's fixed config (check_nsa.py tunes)
    os.environ.setdefault("FSALAB_AUTOTUNE", "0")

from fsalab.bench.inputs import attended_keys, make_inputs
from fsalab.ops import reference
from fsalab.ops.selection.fsa import (
    selected_attention_fsa,
    selected_attention_fsa_paper,
)
from fsalab.testing import assert_close, max_error

try:
    from fsalab.ops.selection.nsa import selected_attention_nsa
except ImportError:  # the NSA kernel is optional here
    selected_attention_nsa = None

DEVICE = torch.device("cuda")
SWITCHES = {  # name -> (inner_loop, early_return)
    "fsa_paper": (True, True),
    "fsa_paper_no_inner_loop": (False, True),
    "fsa_paper_no_early_return": (True, False),
    "fsa_paper_neither": (False, False),
}


def impl(name: str):
    if name == "fsa":
        return selected_attention_fsa
    if name == "nsa":
        return selected_attention_nsa
    inner_loop, early_return = SWITCHES[name]
    return functools.partial(selected_attention_fsa_paper, inner_loop=inner_loop, early_return=early_return)


def point(n, g, block_size=64, topk=16, dtype="bfloat16", batch=1, h_kv=4, d=128, seed=0) -> dict:
    return {"N": n, "g": g, "h_kv": h_kv, "d": d, "batch": batch, "block_size": block_size, "topk": topk,
            "dtype": dtype, "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2,
            "window_size": 512, "seed": seed}  # fmt: skip


def run(fn, q, k, v, block_idx, cu, block_size, do, backward):
    """(o, lse[, dq, dk, dv]) for loss sum(o * do)."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        o, lse = fn(*leaves, block_idx, cu, block_size)
        out = [o.detach(), lse.detach()]
        if backward:
            out += list(torch.autograd.grad(o, leaves, do.to(o.dtype)))
    return out


def check_case(name, p, impls, backward, rows) -> bool:
    inp = make_inputs(p, DEVICE)
    q, k, v = (inp.tensors[n] for n in ("q", "k", "v"))
    bs, cu, block_idx = p["block_size"], inp.cu_seqlens, inp.block_idx
    dtype = q.dtype
    do = torch.randn_like(q)
    expected = run(reference.selected_attention, q.float(), k.float(), v.float(), block_idx, cu, bs, do, backward)
    with reference.native_precision():
        native = run(reference.selected_attention, q, k, v, block_idx, cu, bs, do, backward)
    ok = True
    for impl_name in impls:
        actual = run(impl(impl_name), q, k, v, block_idx, cu, bs, do, backward)
        for i, tensor in enumerate(("o", "lse", "dq", "dk", "dv")[: len(actual)]):
            try:
                assert_close(actual[i], expected[i], native[i], dtype=dtype, name=tensor)
                verdict = "ok"
            except AssertionError as exc:
                verdict, ok = f"FAIL: {exc}", False
            rows.append((name, impl_name, tensor, max_error(actual[i], expected[i]), max_error(native[i], expected[i]), verdict))
        del actual
    del q, k, v, expected, native, inp
    torch.cuda.empty_cache()
    return ok


def check_no_sync(rows) -> bool:
    """fwd + bwd under set_sync_debug_mode("error"): any host synchronisation raises."""
    inp = make_inputs(point(4096, 4), DEVICE)
    q, k, v = (inp.tensors[n].detach().requires_grad_() for n in ("q", "k", "v"))
    ok = True
    for name in ("fsa", "fsa_paper", "fsa_paper_neither"):
        impl(name)(q, k, v, inp.block_idx, inp.cu_seqlens, 64)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, _ = impl(name)(q, k, v, inp.block_idx, inp.cu_seqlens, 64)
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
            verdict = "ok"
        except RuntimeError as exc:
            verdict, ok = f"FAIL: {exc}", False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows.append(("no host sync 4K g4", name, "fwd+bwd", 0.0, 0.0, verdict))
    return ok


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def extra_gib(fn, keep_bytes: int) -> float:
    """Peak allocated during fn minus allocated before, minus keep_bytes (its outputs), in GiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - before - keep_bytes) / 2**30


def time_point(p, impls) -> dict:
    inp = make_inputs(p, DEVICE)
    q, k, v = (inp.tensors[n].detach().requires_grad_() for n in ("q", "k", "v"))
    bs, cu, block_idx = p["block_size"], inp.cu_seqlens, inp.block_idx
    keys = attended_keys(inp)["selected"]  # summed over tokens and query heads
    rec = {"N": p["N"], "g": p["g"], "B": bs, "T": p["topk"], "mean_selected_blocks": inp.info["mean_selected_blocks"]}
    out_bytes = q.numel() * q.element_size() + q.shape[0] * q.shape[1] * 4  # o + lse
    grad_bytes = q.element_size() * (q.numel() + 2 * k.numel())  # dq + dk + dv
    for name in impls:
        try:
            fwd = functools.partial(impl(name), q, k, v, block_idx, cu, bs)
            rec[f"{name}_fwd_ms"] = bench(fwd)
            rec[f"{name}_fwd_extra_gib"] = extra_gib(fwd, out_bytes)
            o, _ = fwd()
            bwd = functools.partial(torch.autograd.grad, o, (q, k, v), torch.randn_like(o), retain_graph=True)
            rec[f"{name}_bwd_ms"] = bench(bwd)
            rec[f"{name}_bwd_extra_gib"] = extra_gib(bwd, grad_bytes)
            rec[f"{name}_fwd_tflops"] = 4.0 * p["d"] * keys / rec[f"{name}_fwd_ms"] * 1e-9
            rec[f"{name}_bwd_tflops"] = 2.5 * 4.0 * p["d"] * keys / rec[f"{name}_bwd_ms"] * 1e-9
            del o, fwd, bwd
        except Exception as exc:  # noqa: BLE001 - report the failing case and go on
            rec[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.empty_cache()
    del q, k, v, inp
    torch.cuda.empty_cache()
    return rec


def timing_plan(have_nsa: bool) -> list[tuple[dict, list[str]]]:
    """(point, impls), most important first."""
    main = ["fsa", "fsa_paper"] + (["nsa"] if have_nsa else [])
    ablation = list(SWITCHES)[1:]
    first = [(65536, 1, 64, 16), (65536, 8, 64, 16), (8192, 1, 64, 16), (65536, 4, 64, 16), (65536, 1, 128, 8),
             (65536, 4, 128, 8)]  # fmt: skip
    rest = [(n, g, b, t) for (b, t) in ((64, 16), (128, 8)) for n in (65536, 32768, 16384, 8192) for g in (1, 2, 4, 8, 16)]
    order = first + [x for x in rest if x not in first]
    plan = []
    for n, g, b, t in order:
        extra = ablation if g in (1, 4) and n in (65536, 16384) else []
        plan.append((point(n, g, b, t), main + extra))
    return plan


def print_timing(timing, impls) -> None:
    print(f"{'N':>6s} {'g':>2s} {'B,T':>6s} " + " ".join(f"{n[:18]:>18s}" for n in impls))
    print(f"{'':17s}" + " ".join(f"{'fwd/bwd ms':>18s}" for _ in impls))
    for r in timing:
        cells = []
        for n in impls:
            if f"{n}_fwd_ms" in r and f"{n}_bwd_ms" in r:
                cells.append(f"{r[f'{n}_fwd_ms']:8.3f}/{r[f'{n}_bwd_ms']:<9.3f}")
            else:
                cells.append(f"{'error' if f'{n}_error' in r else '-':>18s}")
        print(f"{r['N'] // 1024:5d}K {r['g']:2d} {r['B']:3d},{r['T']:<2d} " + " ".join(cells))
    print("\nuseful TFLOP/s fwd/bwd and extra GiB fwd/bwd (buffers: peak minus inputs and outputs)")
    for r in timing:
        cells = []
        for n in impls:
            if f"{n}_bwd_tflops" in r:
                cells.append(f"{n}: {r[f'{n}_fwd_tflops']:.0f}/{r[f'{n}_bwd_tflops']:.0f} TF/s "
                             f"{r[f'{n}_fwd_extra_gib']:.2f}/{r[f'{n}_bwd_extra_gib']:.2f} GiB")  # fmt: skip
        print(f"{r['N'] // 1024:5d}K g={r['g']:<2d} ({r['B']},{r['T']}): " + "; ".join(cells))
    errors = [(r["N"], r["g"], r["B"], n, r[f"{n}_error"]) for r in timing for n in impls if f"{n}_error" in r]
    for e in errors:
        print("error:", *e)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--budget", type=float, default=320.0, help="seconds after which no new timing point starts")
    parser.add_argument("--nsa-autotune", action="store_true", help="autotune the NSA kernel (minutes of compiling)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_fsa: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.time()

    both = ["fsa", "fsa_paper"]
    cases = [  # name, point, impls, backward
        ("bf16 8K g1 fwd+bwd", point(8192, 1, dtype="bfloat16"), both + list(SWITCHES)[1:], True),
        ("fp16 8K g4 fwd+bwd", point(8192, 4, dtype="float16"), both, True),
        ("bf16 8K g5 fwd+bwd", point(8192, 5, dtype="bfloat16"), both, True),
        ("fp16 8K g8 (128,8) fwd+bwd", point(8192, 8, 128, 8, dtype="float16"), both, True),
        ("bf16 2x4K g4 fwd+bwd", point(4096, 4, dtype="bfloat16", batch=2), both, True),
        ("fp16 32K g1 fwd", point(32768, 1, dtype="float16"), both, False),
        ("bf16 32K g8 fwd", point(32768, 8, dtype="bfloat16"), both, False),
        ("bf16 64K g4 fwd", point(65536, 4, dtype="bfloat16"), both, False),
        ("fp16 64K g5 fwd", point(65536, 5, dtype="float16"), both, False),
    ]
    rows: list = []
    ok = True
    for name, p, impls, backward in cases:
        ok &= check_case(name, p, impls, backward, rows)
    ok &= check_no_sync(rows)
    print(f"\ncorrectness ({time.time() - start:.0f} s)")
    print(f"{'case':28s} {'impl':26s} {'tensor':7s} {'max err':>10s} {'torch err':>10s}  verdict")
    for name, impl_name, tensor, err, native_err, verdict in rows:
        print(f"{name:28s} {impl_name:26s} {tensor:7s} {err:10.3e} {native_err:10.3e}  {verdict}")
    record: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "correctness": [dict(zip(("case", "impl", "tensor", "max_err", "torch_err", "verdict"), r))
                                    for r in rows]}  # fmt: skip

    if not args.skip_timing:
        timing, skipped = [], []
        plan = timing_plan(selected_attention_nsa is not None)
        for p, impls in plan:
            if time.time() - start > args.budget:
                skipped.append((p["N"], p["g"], p["block_size"], p["topk"]))
                continue
            timing.append(time_point(p, impls))
        all_impls = ["fsa", "fsa_paper"] + (["nsa"] if selected_attention_nsa is not None else []) + list(SWITCHES)[1:]
        print(f"\ntiming: h_kv=4, d=128, bf16, median ms ({time.time() - start:.0f} s)")
        print_timing(timing, all_impls)
        if skipped:
            print(f"skipped (time budget {args.budget:.0f} s): {skipped}")
        targets = {(65536, 1, 64): (2.5, 5.0), (65536, 8, 64): (6.0, 12.0), (8192, 1, 64): (0.4, None)}
        for r in timing:
            goal = targets.get((r["N"], r["g"], r["B"]))
            if goal and "fsa_fwd_ms" in r:
                bwd = f", bwd {r['fsa_bwd_ms']:.3f} ms (target {goal[1]})" if goal[1] else ""
                print(f"target {r['N'] // 1024}K g={r['g']} (64,16): fsa fwd {r['fsa_fwd_ms']:.3f} ms (target {goal[0]}){bwd}")
        record["timing"], record["skipped"] = timing, skipped
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_fsa.json"), "w") as f:
            json.dump(record, f, indent=1)
    print(f"\ntotal {time.time() - start:.0f} s; correctness {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
