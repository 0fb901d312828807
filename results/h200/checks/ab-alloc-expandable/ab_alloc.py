"""generate() under the default CUDA allocator and under expandable segments, one process each.

PYTORCH_CUDA_ALLOC_CONF is read once, when CUDA starts, so each setting needs its own process;
run the script twice per setting, alternating (default, expandable, default, expandable), so
drift touches both. Each run measures the generate experiment's points given on the command
line with the runner itself (fsalab.bench.decode.run_point: warm-up request, then 3 alternating
timed requests) and writes one JSON line per point.

    PYTORCH_CUDA_ALLOC_CONF=<setting> PYTHONPATH=src python ab_alloc.py OUT.jsonl POINT_ID...
"""

import json
import os
import sys

import torch

from fsalab.bench import decode, grid


def main(out: str, ids: list[str]) -> None:
    exp = grid.load_experiment("generate")
    device = torch.device("cuda")
    with open(out, "a") as f:
        for pid in ids:
            row = decode.run_point(grid.find_point(exp, pid), exp, device)
            keep = {k: row.get(k) for k in ("point", "status", "message", "median_ms", "samples_ms", "prefill_ms",
                                              "prefill_samples_ms", "mean_step_ms", "tokens_per_s", "peak_mem_gib")}
            keep["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
            keep["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            f.write(json.dumps(keep) + "\n")
            print(keep["alloc_conf"], pid, keep["status"], keep["tokens_per_s"], keep["mean_step_ms"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
