"""A/B of select_blocks' merge: tl.sort + tl.sort (the code of BASE) vs tl.topk + tl.bitonic_merge
(the working tree). The BASE version of ops/block_select.py is written next to it as a module
(_block_select_base.py, deleted at the end) so both run in one process on the same inputs;
do_bench medians, rounds forward then reversed; selections compared exactly.
Usage on the H200 (repo root): PYTHONPATH=src python ab_select_merge.py BASE|BASE_FILE out.json
(BASE_FILE: `git show BASE:src/fsalab/ops/block_select.py` saved where the checkout has no .git)"""
import json, os, subprocess, sys
import torch, triton

base_rev, out_path = sys.argv[1], sys.argv[2]
src = open(base_rev).read() if os.path.exists(base_rev) else subprocess.run(
    ["git", "show", f"{base_rev}:src/fsalab/ops/block_select.py"], check=True, capture_output=True, text=True).stdout
path = os.path.join("src", "fsalab", "ops", "_block_select_base.py")
open(path, "w").write(src)
try:
    from fsalab.bench.inputs import make_inputs
    from fsalab.ops import _block_select_base as base, block_select as new, compression
    out = []
    for N, g, B, T in [(65536, 1, 64, 16), (65536, 4, 64, 16), (65536, 5, 64, 16), (65536, 8, 64, 16),
                       (65536, 4, 128, 8), (16384, 4, 64, 16), (131072, 4, 64, 16)]:
        p = {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
             "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
        x = make_inputs(p, torch.device("cuda"), need_indices=False)
        t, cfg = x.tensors, x.cfg
        k_cmp, v_cmp, cu_cmp = compression.compress_kv(t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], x.cu_seqlens, cfg)
        _, lse = compression.compressed_attention(t["q"], k_cmp, v_cmp, x.cu_seqlens, cu_cmp, cfg)
        args = (t["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, cfg)
        fns = {"sort+sort (base)": lambda: base.select_blocks(*args), "topk+bitonic_merge": lambda: new.select_blocks(*args)}
        same = torch.equal(fns["sort+sort (base)"](), fns["topk+bitonic_merge"]())
        samples = {}
        for order in (list(fns), list(fns)[::-1]):
            for name in order:
                samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=100, rep=400, return_mode="all"))
        ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "same": same, "ms": ms, "samples": samples})
        json.dump(out, open(out_path, "w"), indent=1)
        b = ms["sort+sort (base)"]
        print(f"N{N} g{g} ({B},{T}): " + "  ".join(f"{n} {v:.3f} ms ({v / b:.2f})" for n, v in ms.items())
              + f"  same selection: {same}", flush=True)
finally:
    os.remove(path)
