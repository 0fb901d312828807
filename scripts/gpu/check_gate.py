"""GPU check of ops/gate.py, the fused gated sum of NSA's three branch outputs.

1. Correctness in bf16 and fp16 against the fp32 reference (reference.gated_sum): the output and
   all four gradients within 2x PyTorch's own error in that dtype, at 8K tokens x 32 heads x d 128.
2. Timing (triton.testing.do_bench, median of its samples, which --json keeps) of the fused kernel against the torch
   formulation (reference.gated_sum in bf16), forward and forward+backward, at 8K and 64K tokens,
   h in {16, 32}, d = 128, bf16; achieved GB/s counts the bytes each direction must move at
   least (forward: three outputs read, one written; backward: do and three outputs read, three
   gradients written; gate logits and their gradients included), against the ~4.3 TB/s copy
   ceiling of the H200.

Exit status 1 on any correctness failure. Prints one table last.

    python scripts/gpu/check_gate.py [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from triton.testing import do_bench

from fsalab.ops import gate, reference
from fsalab.testing import assert_close

DEV = torch.device("cuda")
D = 128
COPY_CEILING_GBS = 4300.0


def inputs(total, h, dtype, gen, grad):
    outs = [torch.randn(total, h, D, generator=gen, device=DEV).to(dtype).requires_grad_(grad) for _ in range(3)]
    logits = torch.randn(total, h, 3, generator=gen, device=DEV).to(dtype).requires_grad_(grad)
    return [*outs, logits]


def check(dtype, gen) -> None:
    leaves = inputs(8192, 32, dtype, gen, grad=True)
    exact = [t.detach().float().requires_grad_() for t in leaves]
    o, ro = gate.gated_sum(*leaves), reference.gated_sum(*exact)
    no = reference.gated_sum(*leaves)
    assert_close(o, ro, no, dtype, name="o")
    do = torch.randn(o.shape, generator=gen, device=DEV)
    got = torch.autograd.grad(o, leaves, do.to(dtype))
    want = torch.autograd.grad(ro, exact, do)
    native = torch.autograd.grad(no, leaves, do.to(dtype))
    for name, a, b, c in zip(("do_cmp", "do_slc", "do_win", "dgate"), got, want, native):
        assert_close(a, b, c, dtype, name=name)


def min_bytes(total, h, direction) -> int:
    out, logits = total * h * D * 2, total * h * 3 * 2
    return 4 * out + logits if direction == "fwd" else 4 * out + logits + 7 * out + 2 * logits


def time_one(fn, leaves, direction) -> list[float]:
    """do_bench's samples (ms) of one call; warmup and rep are milliseconds."""
    if direction == "fwd":
        call = lambda: fn(*leaves)
    else:
        do = torch.randn(leaves[0].shape, device=DEV, dtype=leaves[0].dtype)
        call = lambda: torch.autograd.grad(fn(*leaves), leaves, do)
    return do_bench(call, warmup=25, rep=200, return_mode="all")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the timing rows here")
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEV).manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float16):
        try:
            check(dtype, gen)
            print(f"[check] gated_sum {dtype}: ok (o and 4 grads)", flush=True)
        except AssertionError as exc:
            failures += 1
            print(f"[FAIL] gated_sum {dtype}: {exc}", flush=True)
    rows = []
    for total in (8192, 65536):
        for h in (16, 32):
            leaves = inputs(total, h, torch.bfloat16, gen, grad=True)
            for direction in ("fwd", "fwd+bwd"):
                samples = {name: time_one(fn, leaves, direction)
                           for name, fn in (("fused", gate.gated_sum), ("torch", reference.gated_sum))}
                ms = {name: statistics.median(s) for name, s in samples.items()}
                gbs = min_bytes(total, h, direction) / (ms["fused"] * 1e-3) / 1e9
                rows.append({"N": total, "h": h, "direction": direction, "fused_ms": ms["fused"],
                             "torch_ms": ms["torch"], "speedup": ms["torch"] / ms["fused"], "fused_GBs": gbs,
                             "of_copy_ceiling": gbs / COPY_CEILING_GBS, "samples_ms": samples})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "failures": failures, "device": torch.cuda.get_device_name()}, fh, indent=1)
    print(f"{'N':>6} {'h':>3} {'dir':>8} {'fused ms':>9} {'torch ms':>9} {'x':>5} {'GB/s':>7} {'of ceil':>7}")
    for r in rows:
        print(f"{r['N']:>6} {r['h']:>3} {r['direction']:>8} {r['fused_ms']:>9.3f} {r['torch_ms']:>9.3f} "
              f"{r['speedup']:>5.2f} {r['fused_GBs']:>7.0f} {r['of_copy_ceiling']:>7.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
