"""A/B of FSA's forward and backward with the tree's kernels against variants that mask only the
tiles of a row's first entries (tokens inside the block, before its last key):
``fsa_bwd_causal._dkdv_kernel`` for the backward (fused dK/dV + dq partials) and the
``_partial_kernel`` of a module partials_causal.py generates from the tree's fsa_partials.py for
the forward. Both on the same inputs (block indices from the compression path) in one process;
do_bench medians, rounds forward then reversed; outputs and gradients compared with the tree's.

Prediction (sm_90a builds at 64K's constexprs, as scripts/sass_loop_count.py --kernel fsa_dkdv
makes them; 128 rows, 8 warps): the variant's plain loop takes 877 instructions per thread and
tile against the tree's 1178 at g = 4 (0.74x; g = 1 869 / 1138, g = 5 934 / 1228, g = 8 877 /
1169), its masked loop 1141; spills 40 B against 4 at g = 4, 288 against 152 at g = 5. A row of
64K at (64, 16) holds ~1024 entries, of which the first <= 63 need the mask (2 of ~32 tiles at
g = 4), so ~0.76x of the loop's instructions. Under the interpreter the variant's gradients are
bit-identical to the tree's (g = 1, 4, 5; (64, ·) and (128, ·); packed batches; rows split over
programs), and with the mask dropped everywhere they are not (a check that the check checks). The dK/dV kernel runs one 255-register
CTA per SM and is partly MMA-bound, so expected time 0.85-0.95x of the backward's dK/dV
(11.6 ms of the 32.7 ms fwd+bwd at 64K g = 4): 0.6-1.7 ms. Forward partial (the variant
module built as sass_loop_count --kernel fsa_partial does): plain loop 1551 against the tree's
1905 at g = 4 (0.81x; g = 1 1456 / 1818, g = 5's 64-row tile 831 / 1097, g = 8 1518 / 1863), but
188 B spilled against 12 at g = 4 (both ranges' code in one kernel): about 0.9x of its 3.5 ms at
64K g = 4 if the spills stay out of the loop. Prepared, not yet run.

Usage on the H200 (repo root):
  PYTHONPATH=src:results/h200/checks/ab-fsa-causal-tiles python results/h200/checks/ab-fsa-causal-tiles/ab_fsa_causal_tiles.py out.json
On CPU (interpreter; correctness only, tiny shapes):
  TRITON_INTERPRET=1 PYTHONPATH=src:results/h200/checks/ab-fsa-causal-tiles python results/h200/checks/ab-fsa-causal-tiles/ab_fsa_causal_tiles.py --cpu
"""
import atexit
import contextlib
import importlib
import json
import os
import sys

import torch

import fsa_bwd_causal
import partials_causal
from fsalab.bench.inputs import make_inputs
from fsalab.ops.selection import fsa

# The forward variant as a sibling module of the tree's (its relative imports work), removed at exit.
_PATH = os.path.join(os.path.dirname(fsa.__file__), "_fsa_partials_causal.py")
partials_causal.write_variant(partials_causal.TREE, _PATH)
atexit.register(os.remove, _PATH)
partials_variant = importlib.import_module("fsalab.ops.selection._fsa_partials_causal")


@contextlib.contextmanager
def variant():
    tree = fsa._dkdv_kernel, fsa._partial_kernel
    fsa._dkdv_kernel, fsa._partial_kernel = fsa_bwd_causal._dkdv_kernel, partials_variant._partial_kernel
    try:
        yield
    finally:
        fsa._dkdv_kernel, fsa._partial_kernel = tree


def problem(N, g, B, T, dtype, device, batch=1):
    cuda = device.type == "cuda"
    p = {"N": N, "g": g, "h_kv": 4 if cuda else 2, "d": 128 if cuda else 32, "batch": batch, "block_size": B,
         "topk": T, "dtype": dtype, "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2,
         "window_size": 512, "seed": 0}
    x = make_inputs(p, device)
    t = x.tensors
    pb = fsa._prepare(t["q"], t["k"], t["v"], x.block_idx, x.cu_seqlens, B, None)
    o, lse = fsa._forward_fast(pb)
    do = torch.randn(pb.q.shape, device=device, generator=torch.Generator(device).manual_seed(1)).to(pb.q.dtype)
    return pb, o, lse, do


def backward(pb, o, lse, do, use_variant):
    with variant() if use_variant else contextlib.nullcontext():
        return fsa._backward_fast(pb, o, lse, do, None)


def forward(pb, use_variant):
    with variant() if use_variant else contextlib.nullcontext():
        return fsa._forward_fast(pb)


def compare(pb, o, lse, do):
    fa, fb = forward(pb, False), forward(pb, True)
    out = {"equal_o": bool(torch.equal(fa[0], fb[0])), "equal_lse": bool(torch.equal(fa[1], fb[1])),
           "max_diff_o": float((fa[0].float() - fb[0].float()).abs().max())}
    a, b = backward(pb, o, lse, do, False), backward(pb, o, lse, do, True)
    for name, u, w in zip(("dq", "dk", "dv"), a, b):
        out[f"rel_diff_{name}"] = float((u.float() - w.float()).norm() / u.float().norm().clamp(min=1e-30))
        out[f"nan_{name}"] = bool(w.isnan().any())
    return out


def main():
    if sys.argv[1:] == ["--cpu"]:
        for N, g, B, batch in [(2304, 4, 64, 1), (700, 5, 64, 3), (1000, 1, 128, 2)]:
            pb, o, lse, do = problem(N, g, B, 4, "float16", torch.device("cpu"), batch)
            print(f"CPU N={N} g={g} B={B} batch={batch}:", compare(pb, o, lse, do), flush=True)
        return
    import triton
    dev = torch.device("cuda")
    out = []
    for N, g, B, T in [(65536, 4, 64, 16), (65536, 1, 64, 16), (65536, 5, 64, 16), (65536, 8, 64, 16),
                       (65536, 4, 128, 8), (16384, 4, 64, 16), (131072, 4, 64, 16)]:
        pb, o, lse, do = problem(N, g, B, T, "bfloat16", dev)
        check = compare(pb, o, lse, do)
        fns = {"fwd tree": lambda: forward(pb, False), "fwd variant": lambda: forward(pb, True),
               "bwd tree": lambda: backward(pb, o, lse, do, False), "bwd variant": lambda: backward(pb, o, lse, do, True)}
        samples = {}
        for order in (list(fns), list(fns)[::-1]):
            for name in order:
                samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=50, rep=300,
                                                                            return_mode="all"))
        ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "ms": ms, "check": check, "samples": samples})
        print(f"N{N} g{g} ({B},{T}): forward tree {ms['fwd tree']:.3f} ms, variant {ms['fwd variant']:.3f} "
              f"({ms['fwd variant'] / ms['fwd tree']:.2f}); backward tree {ms['bwd tree']:.3f} ms, variant "
              f"{ms['bwd variant']:.3f} ({ms['bwd variant'] / ms['bwd tree']:.2f}); {check}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
