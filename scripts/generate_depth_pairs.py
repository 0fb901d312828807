"""Full-depth estimates of the generate rows, recomputed from the samples each row keeps: the
medians' estimate and the range of the estimates of each back-to-back pair of samples, with the
runner's own ``bench.decode._full_depth``, as NSA / full-attention ratios of full-depth tokens/s
beside the slice's measured ratio. Rows measured before the runner recorded the range get it here.
``--peaks``: instead, each slice's measured peak memory and the whole model's estimated peak
(``full_depth_peak_gib``: the slice's peak plus the weights and K/V cache of the layers it left
out), by which experiments/generate.yaml picks the batch-8 points that run whole.

    PYTHONPATH=src python scripts/generate_depth_pairs.py [--platform h200] [--results-dir results] [--peaks]
"""

from __future__ import annotations

import argparse
import sys

from fsalab import results
from fsalab.bench import decode
from fsalab.bench.decode_points import NSA_IMPLS


def full_depth(row: dict) -> dict:
    """The row's full-depth columns from its stored samples (``row`` itself for a whole model)."""
    if "half_layers" not in row:
        return row
    samples = {row["half_layers"]: (row["half_samples_ms"], row["half_prefill_samples_ms"]),
               row["layers"]: (row["samples_ms"], row["prefill_samples_ms"])}
    depths = (row["half_layers"], row["layers"])
    return {**row, **decode._full_depth(row, row, samples, depths, row["full_depth_layers"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="h200")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--peaks", action="store_true", help="the slices' peaks and the whole models' estimated peaks")
    args = ap.parse_args(argv)
    rows = [full_depth(r) for r in results.load_rows(args.platform, "generate", args.results_dir)
            if r["status"] == "ok"]
    if args.peaks:
        print("| model | N | batch | impl | slice layers | slice peak GiB | whole-model peak GiB (estimate) |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted((r for r in rows if "full_depth_peak_gib" in r),
                        key=lambda r: (r["model"], r["N"], r["batch"], r["impl"])):
            print(f"| {r['model']} | {r['N'] // 1024}K | {r['batch']} | {r['impl']} | {r['layers']} | "
                  f"{r['peak_mem_gib']:.1f} | {r['full_depth_peak_gib']:.1f} |")
        return 0
    by_point = {(r["model"], r["N"], r["batch"], r["layers"], r["impl"] in NSA_IMPLS["generate"]): r
                for r in rows}
    print("| model | N | batch | layers | NSA / full, full depth | range over pairs | slice (measured) |")
    print("|---|---|---|---|---|---|---|")
    for (model, n, batch, layers, sparse), nsa in sorted(by_point.items()):
        full = by_point.get((model, n, batch, layers, False))
        if not sparse or full is None or "full_depth_tokens_per_s" not in nsa or "full_depth_tokens_per_s" not in full:
            continue
        ratio = nsa["full_depth_tokens_per_s"] / full["full_depth_tokens_per_s"]
        if "full_depth_tokens_per_s_low" in nsa and "full_depth_tokens_per_s_low" in full:
            spread = (f"{nsa['full_depth_tokens_per_s_low'] / full['full_depth_tokens_per_s_high']:.2f}–"
                      f"{nsa['full_depth_tokens_per_s_high'] / full['full_depth_tokens_per_s_low']:.2f}")
        else:
            spread = "measured"
        print(f"| {model} | {n // 1024}K | {batch} | {layers or 'all'} | {ratio:.2f} | {spread} | "
              f"{nsa['tokens_per_s'] / full['tokens_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
