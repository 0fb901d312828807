"""A/B of FSA's forward and backward with the tree's kernels against variants that mask only the
tiles of a row's first entries (tokens inside the block, before its last key): the
``_dkdv_kernel`` fsa_bwd_causal.py generates from the tree's fsa_bwd.py (fused dK/dV + dq
partials) and the ``_partial_kernel`` partials_causal.py generates from fsa_partials.py (forward).
Both on the same inputs (block indices from the compression path) in one process, timed side by
side by ``fsalab.bench.timing.interleaved`` (round-robin, synced, L2 flushed, medians); outputs
and gradients compared with the tree's.

Prediction, static (the variants' modules written with `python fsa_bwd_causal.py OUT.py` /
`python partials_causal.py OUT.py`, then `python scripts/sass_loop_count.py --kernel fsa_dkdv
--source OUT.py --loops 2 --config G,128,8` / `--kernel fsa_partial ... --config G,128,4`;
instructions per thread and tile):
- dK/dV plain loop against the tree's only loop: g = 1 864 / 1138, g = 4 883 / 1178 (0.75x),
  g = 5 934 / 1228, g = 8 892 / 1169; masked loop ~1140; spills 48 B (tree 4 B at g = 4, no
  reload in the loop), 248 B at g = 5 (tree 152 B; 27 reloads in the plain loop, as the tree's).
  A row of 64K at (64, 16) holds ~1024 entries, of which the first <= 63 need the mask (2 of
  ~32 tiles at g = 4), so ~0.76x of the loop's instructions. The dK/dV kernel runs one
  255-register CTA per SM and is partly MMA-bound: expected 0.85-0.95x of its 11.6 ms in the
  32.7 ms fwd+bwd at 64K g = 4, 0.6-1.7 ms.
- forward partial plain loop: g = 1 1456 / 1818, g = 4 1551 / 1905 (0.81x), g = 5's 64-row
  tile 831 / 1097, g = 8 1518 / 1863; but 188 B spilled against 12 at g = 4 (both ranges' code
  in one kernel): about 0.9x of its 3.5 ms at 64K g = 4 if the spills stay out of the loop.
Under the interpreter the variants' outputs and gradients are bit-identical to the tree's (g = 1,
4, 5; (64, ·) and (128, ·); packed batches; rows split over programs).

Ran at 3e5a55c (causal.log, causal.json; 64K unless stated): forward variant 1.04x at g = 1, 1.05x
at g = 4, 0.99x at g = 5, 1.04x at g = 8, 1.04x at g = 4 (128, 8), 1.02x at 16K, 1.06x at 128K;
backward variant 1.02x, 1.01x, 0.93x, 1.05x, 1.02x, 1.02x, 1.02x. The prediction failed: fewer
instructions in the plain loop did not make either kernel faster, so neither is issue-bound
there; the variants were not landed. The generators edit that commit's fsa_bwd.py and
fsa_partials.py: run this at 3e5a55c.

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
from fsalab.bench.timing import Rounds, interleaved
from fsalab.ops.selection import fsa


def _sibling(generator, name):
    """The generator's variant of its tree module, imported as a sibling of it (its relative
    imports work); the file is removed at exit."""
    path = os.path.join(os.path.dirname(fsa.__file__), f"{name}.py")
    generator.write_variant(generator.TREE, path)
    atexit.register(os.remove, path)
    return importlib.import_module(f"fsalab.ops.selection.{name}")


dkdv_variant = _sibling(fsa_bwd_causal, "_fsa_bwd_causal")
partials_variant = _sibling(partials_causal, "_fsa_partials_causal")


@contextlib.contextmanager
def variant():
    tree = fsa._dkdv_kernel, fsa._partial_kernel
    fsa._dkdv_kernel, fsa._partial_kernel = dkdv_variant._dkdv_kernel, partials_variant._partial_kernel
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


def forward(pb, use_variant):
    with variant() if use_variant else contextlib.nullcontext():
        return fsa._forward_fast(pb)


def backward(pb, o, lse, do, use_variant):
    with variant() if use_variant else contextlib.nullcontext():
        return fsa._backward_fast(pb, o, lse, do, None)


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
    dev = torch.device("cuda")
    out = []
    for N, g, B, T in [(65536, 4, 64, 16), (65536, 1, 64, 16), (65536, 5, 64, 16), (65536, 8, 64, 16),
                       (65536, 4, 128, 8), (16384, 4, 64, 16), (131072, 4, 64, 16)]:
        pb, o, lse, do = problem(N, g, B, T, "bfloat16", dev)
        check = compare(pb, o, lse, do)
        timed = interleaved({"fwd tree": lambda: forward(pb, False), "fwd variant": lambda: forward(pb, True),
                             "bwd tree": lambda: backward(pb, o, lse, do, False),
                             "bwd variant": lambda: backward(pb, o, lse, do, True)},
                            dev, rounds=Rounds(rounds=30, rep_ms=300.0), warmup=3)
        ms = {n: t.summary()["median_ms"] for n, t in timed.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "ms": ms, "check": check,
                    "samples": {n: t.samples_ms for n, t in timed.items()}})
        print(f"N{N} g{g} ({B},{T}): forward tree {ms['fwd tree']:.3f} ms, variant {ms['fwd variant']:.3f} "
              f"({ms['fwd variant'] / ms['fwd tree']:.2f}); backward tree {ms['bwd tree']:.3f} ms, variant "
              f"{ms['bwd variant']:.3f} ({ms['bwd variant'] / ms['bwd tree']:.2f}); {check}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
