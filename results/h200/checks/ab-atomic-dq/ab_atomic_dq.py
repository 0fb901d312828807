"""A/B of the flash backward's dq path: A = deterministic (dq kernel + dk/dv kernel, 7 products),
B = atomic (dq added with fp32 atomics inside the dk/dv kernel, 5 products, + memset and a
scale/cast pass). Compressed mask (l = 32, s = 16) and window (w = 512), bf16, h_kv = 4, d = 128,
one sequence. Times flash._backward alone (do_bench median, L2 flushed), rounds A B B A; errors of
each against the fp32 backward. Runs against the code of 3331100 (the atomic path, the
last argument of flash._backward, was removed after this measurement)."""
import json, math, sys
import torch, triton
from fsalab.ops import flash

dev = torch.device("cuda")
POINTS = [(65536, 4), (65536, 1), (65536, 5), (65536, 8), (32768, 4), (131072, 4), (16384, 4)]
out = []

def inputs(N, g, mask):
    gen = torch.Generator(device=dev).manual_seed(N + g)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
    h_kv, d = 4, 128
    q = rnd(N, h_kv * g, d)
    cu = torch.tensor([0, N], dtype=torch.int32, device=dev)
    if mask == "compressed":
        rows, n_cmp = N // 16, (N - 32) // 16 + 1
        k, v = rnd(rows, h_kv, d), rnd(rows, h_kv, d)
        cu_k = torch.tensor([0, n_cmp], dtype=torch.int32, device=dev)
        params = (16, 31, flash.NO_WINDOW)
        pad = True
    else:
        k, v = rnd(N, h_kv, d), rnd(N, h_kv, d)
        cu_k = cu
        params = (1, 0, 512)
        pad = False
    return q, k, v, cu, cu_k, params, pad

for N, g in POINTS:
    for mask in ("compressed", "window"):
        q, k, v, cu, cu_k, (ks, ko, w), pad = inputs(N, g, mask)
        scale = 1 / math.sqrt(q.shape[-1])
        o, lse = flash._forward(q, k, v, cu, cu_k, ks, ko, w, scale)
        do = torch.randn_like(q)
        run = lambda det, x=(q, k, v, o, lse, do): flash._backward(x[5], None, x[0], x[1], x[2], x[3], x[4], cu, cu_k, ks, ko, w, scale, pad, det)
        row = {"N": N, "g": g, "mask": mask, "err": {}, "ms": {}, "samples": {}}
        if N <= 65536:
            f32 = tuple(t.float() for t in (q, k, v, o, do))
            truth = flash._backward(f32[4], None, *f32[:4], lse, cu, cu_k, ks, ko, w, scale, pad, True)
            for name, det in (("A_det", True), ("B_atomic", False)):
                got = run(det)
                row["err"][name] = {n: ((a.float() - t).abs().max() / t.abs().max()).item() for n, a, t in zip(("dq", "dk", "dv"), got, truth)}
                row["err"][name]["nan"] = sum(int(torch.isnan(a).sum()) for a in got)
            del truth, f32
        for name in ("A_det", "B_atomic", "B_atomic", "A_det"):
            det = name == "A_det"
            ms = triton.testing.do_bench(lambda: run(det), warmup=100, rep=400, return_mode="all")
            row["samples"].setdefault(name, []).extend(ms)
        for name in ("A_det", "B_atomic"):
            s = sorted(row["samples"][name]); row["ms"][name] = s[len(s) // 2]
        out.append(row)
        a, b = row["ms"]["A_det"], row["ms"]["B_atomic"]
        print(f"N{N} g{g} {mask}: A {a:.3f} ms  B {b:.3f} ms  B/A {b/a:.3f}  err {row['err']}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
        del q, k, v, o, lse, do
        torch.cuda.empty_cache()
print("| point | mask | A det ms | B atomic ms | B / A |")
for r in out:
    a, b = r["ms"]["A_det"], r["ms"]["B_atomic"]
    print(f"| N{r['N']} g{r['g']} | {r['mask']} | {a:.3f} | {b:.3f} | {b/a:.3f} |")
