"""A/B of the top-k merge inside ops/compression.py's select kernel, on the GPU.

Variants (compression.SELECT_MERGE, read at launch):
  insert  the running top-T list updated one insertion per row and step while any row of the
          tile has a candidate above its T-th best (a data-dependent loop);
  sort    branch-free: candidates sorted, met element-wise with the sorted run, sorted again;
  bitonic as sort, but the second sort replaced by a bitonic merge (log2 T stages, not ~log2² T);
  none    the run replaced by an element-wise max (a wrong selection): the score half alone, to
          split the kernel's time between scoring and ranking.
insert, sort and bitonic must select the same blocks (exactly: same scores, same tie rule). Also timed:
compressed attention's forward over the same keys (QK, softmax and PV), for scale.

Shapes: one sequence of N tokens, 4 KV heads, d 128, g in {1, 4, 5, 8}, NSA's (32, 16, 64, 16)
config, bf16. do_bench medians (samples kept in --json). Prints one table last.

    python scripts/gpu/ab_select_merge.py [--json ab.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch
from triton.testing import do_bench

from fsalab.config import NSAConfig
from fsalab.ops import compression
from fsalab.varlen import compressed_cu_seqlens

DEV = torch.device("cuda")
H_KV, D = 4, 128
CFG = NSAConfig()
VARIANTS = ("insert", "sort", "bitonic", "none")


def inputs(n, g, gen):
    q = torch.randn(n, H_KV * g, D, generator=gen, device=DEV).to(torch.bfloat16)
    k_cmp = torch.randn(n // CFG.kernel_stride, H_KV, D, generator=gen, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    cu_cmp = compressed_cu_seqlens(cu, CFG.kernel_size, CFG.kernel_stride)
    _, lse = compression.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, CFG)
    return q, k_cmp, lse, cu, cu_cmp


def score_flops(n, g) -> float:
    """QK FLOPs of the scores: query t sees (t - l + 1) // s + 1 compressed keys."""
    t = torch.arange(n, dtype=torch.float64)
    seen = torch.where(t >= CFG.kernel_size - 1, (t - CFG.kernel_size + 1) // CFG.kernel_stride + 1, 0)
    return float(seen.sum()) * H_KV * g * D * 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows (with do_bench samples) here")
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, failures = [], 0
    for n in (16384, 65536):
        for g in (1, 4, 5, 8):
            q, k_cmp, lse, cu, cu_cmp = inputs(n, g, gen)
            call = functools.partial(compression.select_blocks, q, k_cmp, lse, cu, cu_cmp, CFG)
            picked, samples = {}, {}
            for variant in VARIANTS:
                compression.SELECT_MERGE = variant
                picked[variant] = call()
                samples[variant] = do_bench(call, warmup=25, rep=200, return_mode="all")
            compression.SELECT_MERGE = "insert"
            same = True
            for variant in ("sort", "bitonic"):
                if not torch.equal(picked["insert"], picked[variant]):
                    same, failures = False, failures + 1
                    rows_differ = int((picked["insert"] != picked[variant]).any(-1).sum())
                    print(f"[FAIL] N {n} g {g}: {variant} differs from insert on {rows_differ} (token, head) rows", flush=True)
            cmp_fwd = functools.partial(compression.compressed_attention, q, k_cmp, k_cmp, cu, cu_cmp, CFG)
            samples["cmp_fwd"] = do_bench(cmp_fwd, warmup=25, rep=200, return_mode="all")
            ms = {k: statistics.median(s) for k, s in samples.items()}
            rows.append({"N": n, "g": g, "same_selection": same, "ms": ms, "samples_ms": samples,
                         "score_TFLOPs_none": score_flops(n, g) / (ms["none"] * 1e-3) / 1e12})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "failures": failures, "device": torch.cuda.get_device_name()}, fh, indent=1)
    print(f"{'N':>6} {'g':>2} {'insert':>7} {'sort':>7} {'bitonic':>7} {'none':>7} {'cmp fwd':>7} {'ins/bit':>7} {'none TF/s':>9} same")
    for r in rows:
        ms = r["ms"]
        print(f"{r['N']:>6} {r['g']:>2} {ms['insert']:>7.3f} {ms['sort']:>7.3f} {ms['bitonic']:>7.3f} {ms['none']:>7.3f} "
              f"{ms['cmp_fwd']:>7.3f} {ms['insert'] / ms['bitonic']:>7.2f} {r['score_TFLOPs_none']:>9.0f} {r['same_selection']}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
