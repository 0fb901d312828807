"""Count the device kernels one selected-attention call launches, on CPU (no GPU needed).

A short call is launch-bound when the host needs longer to enqueue its kernels than the GPU
needs to run them (docs/performance.md, "Whole NSA attention": tens of microseconds of host time
a launch), so the number of launches is what this script tracks. It runs
the call through the Triton interpreter (TRITON_INTERPRET=1, set here) under
``fsalab.testing.LaunchCounter``, which counts

- Triton launches: every ``kernel[grid](...)`` (``InterpretedFunction.run``), one per launch;
- aten ops that would launch a CUDA kernel: every op seen by a TorchDispatchMode, except views
  and allocations (``NO_KERNEL_OPS``) and except the ops the interpreter itself performs while
  it runs a kernel (copies of the arguments to and from its host buffers).

An aten op counts once even where CUDA runs several kernels for it (torch.sort: a radix sort
of a few passes), so the numbers are a lower bound of what torch.profiler reports on a GPU.
tests/test_launch_count.py keeps the counts from growing back.

The default shape mirrors the H200 profile point (one sequence, g = 1, h_kv = 4, topk blocks)
at interpreter size: N = 256 tokens, d = 32, block 16, topk 8, fp16 (the counts do not
depend on the sizes, except NSA's merge launch, which only runs when a CSR row is split). Directions: ``fwd`` is
the call under no_grad; ``bwd`` is ``torch.autograd.grad`` of a graph built beforehand (what
the benchmark's bwd timing runs). Input-value checks are off (``fsalab.settings``' value_checks),
as when the benchmark times kernels.

    PYTHONPATH=src python scripts/count_launches.py [--impls fsa,fsa_paper,nsa] [--lengths 256] [--ops]
    PYTHONPATH=src python scripts/count_launches.py --op nsa_attention --impls fsa,nsa --lengths 512 --block-size 32 --topk 4
    PYTHONPATH=src python scripts/count_launches.py --op module --impls fsa,nsa --value-checks

``--op module`` counts a forward of a small NativeSparseAttention module as a model's layer runs
it (``fsalab.testing.nsa_module_forward``; the shape options do not apply); ``--value-checks``
counts with the input-value checks on (the users' default), repeated calls on the same inputs.
``--ops`` prints the counted ops of every call; ``--json PATH`` writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from fsalab import settings
from fsalab.bench.kernel import nsa_attention_calls
from fsalab.testing import LaunchCounter, nsa_module_forward


def make_call(impl: str, lengths: list[int], h_kv: int, g: int, d: int, block_size: int, topk: int):
    """(fwd, bwd) zero-argument callables for impl on a random batch with a valid block_idx."""
    from fsalab.ops.selected import selected_attention
    from fsalab.testing import cu_seqlens_of

    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    cu = cu_seqlens_of(lengths)
    q = torch.randn(total, h_kv * g, d, generator=gen, dtype=torch.float32).half()
    k = torch.randn(total, h_kv, d, generator=gen, dtype=torch.float32).half()
    v = torch.randn(total, h_kv, d, generator=gen, dtype=torch.float32).half()
    block_idx = _block_idx(cu, h_kv, topk, block_size, gen)

    def fwd():
        with torch.no_grad():
            return selected_attention(q, k, v, block_idx, cu, block_size, impl=impl)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, _ = selected_attention(*leaves, block_idx, cu, block_size, impl=impl)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float32).half()

    def bwd():
        return torch.autograd.grad(o, leaves, do, retain_graph=True)

    return fwd, bwd


def _block_idx(cu: torch.Tensor, h_kv: int, topk: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [total, h_kv, topk]: the sink block, the own block and random causal blocks between,
    ascending, -1 padded (like NSA's selection with init and local blocks)."""
    rows = []
    for b in range(cu.numel() - 1):
        for pos in range(int(cu[b + 1] - cu[b])):
            own = pos // block_size
            for _ in range(h_kv):
                middle = torch.randperm(max(own - 1, 0), generator=gen)[: max(topk - 2, 0)] + 1
                chosen = sorted({0, own, *middle.tolist()})[:topk]
                rows.append(chosen + [-1] * (topk - len(chosen)))
    return torch.tensor(rows, dtype=torch.int32).view(-1, h_kv, topk)


def count(fn) -> dict[str, int]:
    fn()  # first call outside the count: one-time work (kernel rewriting, caches)
    with LaunchCounter() as counter:
        fn()
    return dict(counter.counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="fsa,fsa_paper,nsa")
    ap.add_argument("--op", choices=("selected", "nsa_attention", "module"), default="selected",
                    help="the selected-attention call, whole NSA attention (one sequence of the first length), "
                         "or a small module's forward")
    ap.add_argument("--value-checks", action="store_true", help="input-value checks on (the users' default)")
    ap.add_argument("--lengths", default="256", help="comma-separated sequence lengths")
    ap.add_argument("--h-kv", type=int, default=4)
    ap.add_argument("--g", type=int, default=1)
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ops", action="store_true", help="print the counted ops of every call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    settings.configure(value_checks=args.value_checks)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for impl in args.impls.split(","):
        if args.op == "selected":
            calls = zip(("fwd", "bwd"), make_call(impl, lengths, args.h_kv, args.g, args.d, args.block_size, args.topk))
        elif args.op == "nsa_attention":
            calls = zip(("fwd", "bwd"), nsa_attention_calls(impl, lengths[0], args.h_kv, args.g, args.d,
                                                            args.block_size, args.topk))
        else:
            calls = [("fwd", nsa_module_forward(impl))]
        for direction, fn in calls:
            c = count(fn)
            triton_n = sum(n for name, n in c.items() if name.startswith("triton:"))
            aten_n = sum(c.values()) - triton_n
            rows.append({"impl": impl, "direction": direction, "aten": aten_n, "triton": triton_n,
                         "total": aten_n + triton_n, "ops": dict(sorted(c.items()))})  # fmt: skip
    print(f"{'impl':10s} {'dir':4s} {'aten':>5s} {'triton':>6s} {'total':>6s}")
    for r in rows:
        print(f"{r['impl']:10s} {r['direction']:4s} {r['aten']:5d} {r['triton']:6d} {r['total']:6d}")
        if args.ops:
            print("    " + ", ".join(f"{name} x{n}" for name, n in r["ops"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
