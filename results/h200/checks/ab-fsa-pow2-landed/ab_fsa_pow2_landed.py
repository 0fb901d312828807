"""A/B of FSA's power-of-two head parts as landed (forward chunks ``fsa_plan.pow2_chunks``,
backward ``fsa_bwd._dkdv_kernel`` walking the group's parts in turn) against the library before
them (the three modules given as a directory, e.g. from 3e5a55c), and of the backward's tile loop
written as a count of tiles (``for mt in range(cdiv(end - c0, TOKP))``, generated from the tree)
against the tree's ``for t0 in range(c0, end, TOKP)``. One process, same inputs (block indices
from the compression path), timed side by side by ``fsalab.bench.timing.interleaved``.

Prediction. Forward: the A/B of the prepared variant (results/h200/checks/ab-fsa-pow2-heads/):
g = 3, 5, 6, 7 at 0.85-0.88x, unchanged at powers of two. Backward: g = 5 at ~0.80x as there;
at powers of two the tree's loop counts 2.5 % more instructions per tile than before at g = 4
(`python scripts/sass_loop_count.py --kernel fsa_dkdv`: 1207 against 1178 per thread and tile,
6 % at g = 1: 1209 against 1138) and the tile-count form 1184 and 1139, so at most ~1.02x for the
tree and ~1.00x for the tile-count form at g = 1, 4, 8; at g = 5 the tile-count form spills 88 B
with 4 + 3 reloads per tile against 48 B and 1 + 1, so >= the tree's time there.

Ran at 188fb1d (landed.log, landed.json): forward g = 5 0.86x, g = 3, 6, 7 0.88x, 0.97x at g = 5
(128, 8), 0.99-1.00x at powers of two; backward, stepping by tokens: g = 5 0.81x (0.82x at
(128, 8)), g = 3, 6, 7 0.87-0.91x, but g = 1 1.06x, g = 4 1.01x (1.04x at (128, 8)); counting
tiles: 1.00-1.01x at powers of two, g = 5 0.85x (0.89x at (128, 8)), g = 6, 7 0.86x, 0.87x. The
kernel since takes the tile count where the part is the whole group and steps by tokens where
the group has a rest, so LOOP_TREE no longer matches the tree: run this at 188fb1d.

Usage on the H200 (repo root; BASE holds fsa.py, fsa_bwd.py, fsa_plan.py of the baseline):
  mkdir -p BASE && for f in fsa fsa_bwd fsa_plan; do git show 3e5a55c:src/fsalab/ops/selection/$f.py > BASE/$f.py; done
  PYTHONPATH=src python results/h200/checks/ab-fsa-pow2-landed/ab_fsa_pow2_landed.py BASE out.json
"""
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch

from fsalab.bench.inputs import make_inputs
from fsalab.bench.timing import Rounds, interleaved
from fsalab.ops.selection import fsa

PKG = "fsalab.ops.selection"
TREE = pathlib.Path(fsa.__file__).parent
LOOP_TREE = "    for t0 in range(c0, end, TOKP):\n        valid, pos, tok, qp, qmask, lp = _gather_rows(\n            token_ids, p_row, t0, ii, end,"
LOOP_COUNT = ("    for mt in range(tl.cdiv(end - c0, TOKP)):\n        valid, pos, tok, qp, qmask, lp = _gather_rows(\n"
              "            token_ids, p_row, c0 + mt * TOKP, ii, end,")


def sibling(name: str, text: str, tmp: str):
    """Source text as module fsalab.ops.selection.<name> (its relative imports resolve there)."""
    path = pathlib.Path(tmp) / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"{PKG}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def variants(base_dir: pathlib.Path, tmp: str):
    """{name: fsa module}: the baseline's three modules, and the tree's fsa with the tile-count loop."""
    sibling("_base_fsa_plan", (base_dir / "fsa_plan.py").read_text(), tmp)
    sibling("_base_fsa_bwd", (base_dir / "fsa_bwd.py").read_text(), tmp)
    base = (base_dir / "fsa.py").read_text().replace("from . import fsa_plan as plan", "from . import _base_fsa_plan as plan")
    base = sibling("_base_fsa", base.replace("from .fsa_bwd import", "from ._base_fsa_bwd import"), tmp)
    bwd = (TREE / "fsa_bwd.py").read_text()
    assert bwd.count(LOOP_TREE) == 1, "the tree's tile loop changed: update LOOP_TREE"
    sibling("_count_fsa_bwd", bwd.replace(LOOP_TREE, LOOP_COUNT), tmp)
    count = sibling("_count_fsa", (TREE / "fsa.py").read_text().replace("from .fsa_bwd import", "from ._count_fsa_bwd import"), tmp)
    return {"base": base, "tree": fsa, "count": count}


def problem(N, g, B, T, device):
    p = {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, device)
    t = x.tensors
    pb = fsa._prepare(t["q"], t["k"], t["v"], x.block_idx, x.cu_seqlens, B, None)
    do = torch.randn(pb.q.shape, device=device, generator=torch.Generator(device).manual_seed(1)).to(pb.q.dtype)
    return pb, do


def rel(a, b):
    return float((a.float() - b.float()).norm() / a.float().norm().clamp(min=1e-30))


def main():
    mods = variants(pathlib.Path(sys.argv[1]), tempfile.mkdtemp())
    dev = torch.device("cuda")
    out = []
    for N, g, B, T in [(65536, 4, 64, 16), (65536, 5, 64, 16), (65536, 1, 64, 16), (65536, 8, 64, 16),
                       (65536, 3, 64, 16), (65536, 6, 64, 16), (65536, 7, 64, 16), (65536, 5, 128, 8),
                       (65536, 4, 128, 8), (16384, 4, 64, 16), (16384, 5, 64, 16)]:
        pb, do = problem(N, g, B, T, dev)
        o, lse = mods["base"]._forward_fast(pb)
        grads = {n: m._backward_fast(pb, o, lse, do, None) for n, m in mods.items()}
        o_tree, lse_tree = fsa._forward_fast(pb)
        check = {"rel_o_tree": rel(o, o_tree), "nan_o_tree": bool(o_tree.isnan().any()),
                 "max_lse_diff_tree": float((lse - lse_tree).abs().max())}
        for n in ("tree", "count"):
            for name, a, b in zip(("dq", "dk", "dv"), grads["base"], grads[n]):
                check[f"rel_{name}_{n}"] = rel(a, b)
                check[f"nan_{name}_{n}"] = bool(b.isnan().any())
        fns = {"fwd base": lambda: mods["base"]._forward_fast(pb), "fwd tree": lambda: fsa._forward_fast(pb)}
        fns.update({f"bwd {n}": (lambda m=m: m._backward_fast(pb, o, lse, do, None)) for n, m in mods.items()})
        timed = interleaved(fns, dev, rounds=Rounds(rounds=30, rep_ms=300.0), warmup=3)
        ms = {n: t.summary()["median_ms"] for n, t in timed.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "ms": ms, "check": check,
                    "samples": {n: t.samples_ms for n, t in timed.items()}})
        print(f"N{N} g{g} ({B},{T}): fwd base {ms['fwd base']:.3f} tree {ms['fwd tree']:.3f} "
              f"({ms['fwd tree'] / ms['fwd base']:.3f}); bwd base {ms['bwd base']:.3f} tree {ms['bwd tree']:.3f} "
              f"({ms['bwd tree'] / ms['bwd base']:.3f}) count {ms['bwd count']:.3f} "
              f"({ms['bwd count'] / ms['bwd base']:.3f}); {check}", flush=True)
        json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
