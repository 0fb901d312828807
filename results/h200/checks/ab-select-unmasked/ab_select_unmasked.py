"""A/B of select_blocks: the score loop with every mask in every chunk (block_select_916ed66.py,
the module of 916ed66) vs the tree's, whose chunks that a whole tile sees run without masks.
Same inputs in one process; do_bench medians (rounds forward then reversed), the autotuner's
config for each; selections must be identical (the same arithmetic). Then the selection checks
of tests/test_gpu_compression.py on the tree's kernel.
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/ab-select-unmasked/ab_select_unmasked.py out.json"""
import json, os, shutil, sys
import torch, triton

here = os.path.dirname(os.path.abspath(__file__))
before = os.path.join("src", "fsalab", "ops", "_block_select_before.py")
shutil.copy(os.path.join(here, "block_select_916ed66.py"), before)
try:
    from fsalab.bench.inputs import make_inputs
    from fsalab.ops import _block_select_before as old, block_select as new, compression
    out = []
    for N, g, B, T in [(65536, 1, 64, 16), (65536, 4, 64, 16), (65536, 5, 64, 16), (65536, 4, 128, 8),
                       (131072, 1, 64, 16), (16384, 4, 64, 16)]:
        p = {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
             "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
        x = make_inputs(p, torch.device("cuda"), need_indices=False)
        t, cfg = x.tensors, x.cfg
        k_cmp, v_cmp, cu_cmp = compression.compress_kv(t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], x.cu_seqlens, cfg)
        _, lse = compression.compressed_attention(t["q"], k_cmp, v_cmp, x.cu_seqlens, cu_cmp, cfg)
        args = (t["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, cfg)
        fns = {"masked (916ed66)": lambda: old.select_blocks(*args), "unmasked bulk": lambda: new.select_blocks(*args)}
        a, b = fns["masked (916ed66)"](), fns["unmasked bulk"]()
        differ = int((a != b).any(-1).sum())
        samples = {}
        for order in (list(fns), list(fns)[::-1]):
            for name in order:
                samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=100, rep=300, return_mode="all"))
        ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
        picked = {n: str(getattr(m._select_kernel, "best_config", None)) for n, m in (("before", old), ("after", new))}
        out.append({"N": N, "g": g, "B": B, "T": T, "rows": a.shape[0] * a.shape[1], "rows_differ": differ, "ms": ms,
                    "samples": samples, "configs": picked})
        base = ms["masked (916ed66)"]
        print(f"N{N} g{g} ({B},{T}): " + "  ".join(f"{n} {v:.3f} ms ({v / base:.3f})" for n, v in ms.items())
              + f"  rows differing: {differ} of {a.shape[0] * a.shape[1]}; configs {picked}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
finally:
    os.remove(before)
