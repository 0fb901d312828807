"""A/B of select_blocks' ranking keys: int64 (score bits << 32 | ~block, the tree's module) vs
int32 (select_key32.py: 5 exponent bits, 26 - KB mantissa bits, KB block bits), both on the same
inputs in one process; do_bench medians, rounds forward then reversed; the tile config each
kernel's autotuner took. Also: rows whose selection differs from the int64 kernel's, and the
selection checks of tests/test_gpu_compression.py (8K-128K against the reference) run on the
int32 kernel. Ran on the H200 with the code of 570fc02 (ab_key32.log / .json beside this file);
the int32 keys then landed in ops/block_select.py and ops/decode.py, so the generator's
substitutions match 570fc02's module only: to re-run, check that commit out.
Usage on the H200 (repo root, at 570fc02):
  PYTHONPATH=src:results/h200/checks/ab-select-key32 python results/h200/checks/ab-select-key32/ab_select_key32.py out.json"""
import json, os, sys
import torch, triton
import select_key32

path = os.path.join("src", "fsalab", "ops", "_block_select_key32.py")
select_key32.write_variant(os.path.join("src", "fsalab", "ops", "block_select.py"), path)
try:
    from fsalab.bench.inputs import make_inputs
    from fsalab.ops import _block_select_key32 as k32, block_select as k64, compression
    out = []
    for N, g, B, T in [(65536, 1, 64, 16), (65536, 4, 64, 16), (65536, 5, 64, 16), (65536, 8, 64, 16),
                       (65536, 4, 128, 8), (16384, 4, 64, 16), (131072, 4, 64, 16), (131072, 1, 64, 16)]:
        p = {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
             "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
        x = make_inputs(p, torch.device("cuda"), need_indices=False)
        t, cfg = x.tensors, x.cfg
        k_cmp, v_cmp, cu_cmp = compression.compress_kv(t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], x.cu_seqlens, cfg)
        _, lse = compression.compressed_attention(t["q"], k_cmp, v_cmp, x.cu_seqlens, cu_cmp, cfg)
        args = (t["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, cfg)
        fns = {"int64 keys (tree)": lambda: k64.select_blocks(*args), "int32 keys": lambda: k32.select_blocks(*args)}
        a, b = fns["int64 keys (tree)"](), fns["int32 keys"]()
        differ = int((a != b).any(-1).sum())
        samples = {}
        for order in (list(fns), list(fns)[::-1]):
            for name in order:
                samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=100, rep=400, return_mode="all"))
        ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "rows": a.shape[0] * a.shape[1], "rows_differ": differ, "ms": ms,
                    "samples": samples})
        base = ms["int64 keys (tree)"]
        picked = {n: str(getattr(m._select_kernel, "best_config", None)) for n, m in (("int64", k64), ("int32", k32))}
        out[-1]["configs"] = picked
        print(f"N{N} g{g} ({B},{T}): " + "  ".join(f"{n} {v:.3f} ms ({v / base:.2f})" for n, v in ms.items())
              + f"  rows differing: {differ} of {a.shape[0] * a.shape[1]}; configs {picked}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    # The GPU test's selection checks (tests/test_gpu_compression.py) with the int32 kernel.
    sys.path.insert(0, "tests")
    import test_gpu_compression as tg
    from fsalab.config import NSAConfig
    tg.select_blocks = k32.select_blocks
    for lengths, g, pair, dtype in tg.SELECT_CASES:
        tg._check_select(lengths, g, NSAConfig(block_size=pair[0], topk=pair[1]), dtype, 0, torch.device("cuda"))
    for g, pair in [(1, (64, 16)), (16, (64, 16)), (4, (128, 8))]:
        tg._check_select([131072], g, NSAConfig(block_size=pair[0], topk=pair[1]), torch.bfloat16, 0,
                         torch.device("cuda"), 8192)
    print("check_selection of tests/test_gpu_compression.py's cases with int32 keys: passed", flush=True)
finally:
    os.remove(path)
