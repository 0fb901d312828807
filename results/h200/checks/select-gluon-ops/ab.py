"""A/B of the two selection kernels of ``ops.block_select.select_blocks`` (``kernel="triton"`` and
``kernel="gluon"``, ops/block_select_gluon.py) at 64K tokens, 4 KV heads, d = 128, bf16, one
sequence, for g = 1, 2, 4, 5, 8 at (64, 16) and g = 1, 4 at (128, 8): rows whose selections differ
(near-ties only: the heads' fp32 sum runs in another order at g > 1), and both timed
(do_bench medians of rounds in both orders). It decides ``block_select_gluon.PREFERRED_MAX_G``.
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/select-gluon-ops/ab.py out.json"""
import json
import sys

import torch
import triton

from fsalab.bench.inputs import compressed_branch, make_inputs
from fsalab.ops import block_select, compression

dev = torch.device("cuda")
rows = []
print(f"{'g':>2} {'(B,T)':>8} {'triton ms':>10} {'gluon ms':>9} {'ratio':>6} {'rows differ':>12}", flush=True)
for g, B, T in ((1, 64, 16), (2, 64, 16), (4, 64, 16), (5, 64, 16), (8, 64, 16), (1, 128, 8), (4, 128, 8)):
    p = {"N": 65536, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, dev, need_indices=False)
    _, lse, k_cmp, _, cu_cmp = compressed_branch(compression, x.tensors, x.cu_seqlens, x.cfg)
    args = (x.tensors["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, x.cfg)
    fns = {k: (lambda k=k: block_select.select_blocks(*args, kernel=k)) for k in ("triton", "gluon")}
    a, b = fns["triton"](), fns["gluon"]()
    differ = int((a != b).any(-1).sum())
    samples = {}
    for order in (list(fns), list(fns)[::-1]):
        for name in order:
            samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="all"))
    ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
    rows.append({"g": g, "B": B, "T": T, "N": 65536, "rows": a.shape[0] * a.shape[1], "rows_differ": differ, "ms": ms,
                 "samples": samples})
    print(f"{g:>2} {f'({B},{T})':>8} {ms['triton']:>10.3f} {ms['gluon']:>9.3f} {ms['gluon'] / ms['triton']:>6.3f} "
          f"{differ:>12}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
