"""Per-kernel device time (torch.profiler, 5 calls after warm-up) of whole NSA attention (auto)
fwd and fwd+bwd at 64K, (64, 16), 4 KV heads, d = 128, bf16, g = 1, 4 and 5: where g = 5's extra
time goes (its selected branch costs 1.6x g = 4's for 1.25x the heads), what the compression
branch's 13.5 ms of fwd+bwd at g = 4 consist of, and the selection's share at g = 1.
Usage on the H200 (repo root):
  PYTHONPATH=src python results/h200/checks/profile-nsa-attention-g1-g4-g5/prof_nsa_attention.py out.json"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from fsalab.bench import ops
from fsalab.bench.inputs import make_inputs

out = {}
dev = torch.device("cuda")
for g in (1, 4, 5):
    p = {"N": 65536, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": 64, "topk": 16, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    bound = ops.bind("nsa_attention", "auto")
    x = make_inputs(p, dev, need_indices=bound.need_indices)
    for direction in ("fwd", "fwd+bwd"):
        fn = ops.direction_callable(bound, x, direction, 0)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        table = {}
        for e in prof.key_averages():
            ms = getattr(e, "self_device_time_total", 0) / 5e3
            if ms > 0:
                table[e.key] = [ms, e.count // 5]
        out[f"g{g}-{direction}"] = table
        total = sum(v[0] for v in table.values())
        print(f"\ng={g} {direction}: {total:.2f} ms of kernels per call")
        for k, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"  {ms:8.3f} ms x{n:<3d} {k[:90]}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
