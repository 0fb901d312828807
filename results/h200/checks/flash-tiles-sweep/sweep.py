"""Where the compression and window branches spend their fwd+bwd at 64K, and whether other tiles
of ops/flash.py's kernels do better than the autotuned ones.

1. Per-branch kernel device times (torch.profiler, 5 calls after warm-up) of the versus runner's
   branch callables (compression = compress_kv + compressed attention, selection, selected,
   window, gate), fwd+bwd, whole NSA attention `auto`, 64K, (64, 16), 4 KV heads, d = 128, bf16,
   g = 1 and 4.
2. Tile sweep: flash.py's _fwd_kernel, _dq_kernel and _dkdv_kernel, each forced to one config at
   a time (the others autotuned), on the compressed mask (stride 16, offset 31) and the window
   (w = 512) at 64K g = 1 / 4; the kernel's device time per call (profiler, 5 calls).
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/flash-tiles-sweep/sweep.py out.json
"""
import json, sys, time
import torch
import triton
from torch.profiler import ProfilerActivity, profile
from fsalab.bench import ops, versus
from fsalab.bench.inputs import compressed_branch, make_inputs
from fsalab.ops import flash

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
out = {"branches": {}, "sweep": {}}
t0 = time.time()


def kernel_ms(fn, calls=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = {}
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0) / (calls * 1e3)
        if ms > 0:
            table[e.key[:80]] = [round(ms, 4), e.count // calls]
    return table


def point(g):
    return {"N": int(__import__("os").environ.get("SWEEP_N", 65536)), "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": 64, "topk": 16, "dtype": "bfloat16",
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}


# 1. branches
for g in (1, 4):
    p = point(g)
    inputs = make_inputs(p, dev, need_indices=True)
    x = inputs.with_leaves(tuple(inputs.tensors))
    q = inputs.tensors["q"]
    do = torch.randn(q.shape, device=dev, dtype=torch.float32).to(q.dtype)
    parts = {"auto": ops.nsa_parts("auto", None)}
    fns = versus._branch_callables(parts, x, x.tensors, do, "fwd+bwd")
    for name, fn in fns.items():
        table = kernel_ms(fn)
        out["branches"][f"g{g}:{name}"] = table
        tot = sum(v[0] for v in table.values())
        print(f"\ng={g} {name}: {tot:.3f} ms of kernels", flush=True)
        for k, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:8]:
            print(f"  {ms:8.3f} x{n:<2d} {k}")
    del x, inputs, fns
    torch.cuda.empty_cache()
print(f"[branches done {time.time() - t0:.0f}s]", flush=True)

# 2. sweep
C = flash._cfg
CANDIDATES = {
    "_fwd_kernel": [C(128, 64, 8, 3), C(64, 64, 4, 3), C(128, 128, 8, 2), C(128, 64, 8, 4), C(128, 64, 8, 2),
                    C(128, 32, 8, 3), C(64, 128, 4, 3), C(128, 128, 8, 3)],
    "_dq_kernel": [C(128, 64, 8, 3), C(64, 64, 4, 3), C(128, 32, 8, 3), C(128, 64, 8, 4), C(128, 64, 8, 2),
                   C(64, 128, 8, 3), C(128, 128, 8, 2), C(64, 64, 8, 3)],
    "_dkdv_kernel": [C(32, 128, 8, 3), C(64, 64, 8, 3), C(32, 64, 4, 3), C(64, 128, 8, 2), C(64, 128, 8, 3),
                     C(32, 128, 8, 4), C(32, 128, 8, 2), C(16, 128, 8, 3), C(64, 64, 4, 3), C(64, 64, 8, 4),
                     C(128, 64, 8, 2), C(64, 128, 4, 2)],
}
kernels = {n: getattr(flash, n) for n in CANDIDATES}
orig = {n: list(k.configs) for n, k in kernels.items()}
for g in (1, 4):
    p = point(g)
    inputs = make_inputs(p, dev, need_indices=False)
    t, cu, cfg = inputs.tensors, inputs.cu_seqlens, inputs.cfg
    with torch.no_grad():
        _, _, k_cmp, v_cmp, cu_cmp = compressed_branch(flash_mod := ops.nsa_parts("auto", None).compression, t, cu, cfg)
    q = t["q"]
    do = torch.randn(q.shape, device=dev, dtype=torch.float32).to(q.dtype)
    scale = q.shape[2] ** -0.5
    masks = {"compressed": (k_cmp, v_cmp, cu_cmp, 16, 31, flash.NO_WINDOW, True),
             "window": (t["k"], t["v"], cu, 1, 0, 512, False)}
    for mask, (k, v, cuk, stride, offset, window, pad) in masks.items():
        o, lse = flash._forward(q, k, v, cu, cuk, stride, offset, window, scale)
        fwd = lambda: flash._forward(q, k, v, cu, cuk, stride, offset, window, scale)
        bwd = lambda: flash._backward(do, None, q, k, v, o, lse, cu, cuk, stride, offset, window, scale, pad)
        for name, cands in CANDIDATES.items():
            fn = fwd if name == "_fwd_kernel" else bwd
            res = []
            for c in cands:
                kern = kernels[name]
                kern.configs = [c]
                kern.cache.clear()
                label = f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}w{c.num_warps}s{c.num_stages}"
                try:
                    tab = kernel_ms(fn)
                    ms = sum(v[0] for k_, v in tab.items() if k_.startswith(name))
                except Exception as exc:  # noqa: BLE001
                    ms = None
                    label += f" ({type(exc).__name__})"
                res.append([label, ms])
            kern.configs = orig[name]
            kern.cache.clear()
            out["sweep"][f"g{g}:{mask}:{name}"] = res
            best = min((r for r in res if r[1]), key=lambda r: r[1])
            print(f"g={g} {mask:10s} {name:13s} " + "  ".join(f"{l}:{m:.3f}" if m else f"{l}:-" for l, m in res)
                  + f"  | best {best[0]} {best[1]:.3f} vs cur-first {res[0][1]}", flush=True)
    del inputs, t, k_cmp, v_cmp
    torch.cuda.empty_cache()
print(f"[sweep done {time.time() - t0:.0f}s]", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
