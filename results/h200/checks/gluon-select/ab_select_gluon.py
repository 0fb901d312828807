"""A/B of the selection kernel at g = 1: the tree's Triton select_blocks against the Gluon
prototype (select_gluon.py: the top-T with a token's row in one thread). A small packed batch
first (the first differing row printed), then at 16K-128K, (64, 16) and (128, 8), 4 KV heads,
d = 128, bf16: selections compared (rows differing; they should be identical) and both timed
(do_bench medians, rounds in both orders); last, select_gluon against the reference on
tests/test_gpu_compression.py's g = 1 cases.
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/gluon-select/ab_select_gluon.py out.json"""
import json, os, sys
import torch, triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, "tests")
import select_gluon as sg
from fsalab.bench.inputs import compressed_branch, make_inputs
from fsalab.config import NSAConfig
from fsalab.ops import block_select, compression

dev = torch.device("cuda")
out = []
# First a small packed batch against the tree's kernel, printing the first differing row, so a
# wrong prototype shows how it is wrong within seconds.
import test_gpu_compression as tg
gen = torch.Generator(device=dev).manual_seed(0)
cfg0 = NSAConfig(block_size=64, topk=16)
lengths0 = [3000, 17, 2100]
cu0 = tg.cu_seqlens_of(lengths0, dev)
q0 = torch.randn(sum(lengths0), 4, 128, generator=gen, device=dev).to(torch.bfloat16)
k0 = torch.randn(sum(lengths0) // 16, 4, 128, generator=gen, device=dev).to(torch.bfloat16)
cuc0 = tg.compressed_cu_seqlens(cu0, cfg0.kernel_size, cfg0.kernel_stride)
_, lse0 = compression.compressed_attention(q0, k0, k0, cu0, cuc0, cfg0)
want0 = block_select.select_blocks(q0, k0, lse0, cu0, cuc0, cfg0)
got0 = sg.select_blocks_gluon(q0, k0, lse0, cu0, cuc0, cfg0)
bad = (want0 != got0).any(-1).nonzero()
print(f"small packed batch {lengths0}: rows differing {len(bad)} of {want0.shape[0] * want0.shape[1]}", flush=True)
if len(bad):
    t, h = bad[0].tolist()
    print(f"  first: token {t}, KV head {h}: tree {want0[t, h].tolist()} gluon {got0[t, h].tolist()}", flush=True)
for N, B, T in ((65536, 64, 16), (65536, 128, 8), (16384, 64, 16), (131072, 64, 16)):
    p = {"N": N, "g": 1, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, dev, need_indices=False)
    _, lse, k_cmp, _, cu_cmp = compressed_branch(compression, x.tensors, x.cu_seqlens, x.cfg)
    args = (x.tensors["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, x.cfg)
    fns = {"triton (tree)": lambda: block_select.select_blocks(*args), "gluon": lambda: sg.select_blocks_gluon(*args)}
    try:
        a, b = fns["triton (tree)"](), fns["gluon"]()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the prototype may not run: say how
        print(f"N{N} ({B},{T}): gluon failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
        break
    differ = int((a != b).any(-1).sum())
    row = {"N": N, "B": B, "T": T, "rows": a.shape[0] * a.shape[1], "rows_differ": differ}
    print(f"N{N} g1 ({B},{T}): rows differing {differ} of {row['rows']}", flush=True)
    samples = {}
    for order in (list(fns), list(fns)[::-1]):
        for name in order:
            samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=100, rep=300, return_mode="all"))
    row["ms"] = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
    row["samples"] = samples
    base = row["ms"]["triton (tree)"]
    print("   " + "  ".join(f"{n} {v:.3f} ms ({v / base:.3f})" for n, v in row["ms"].items()), flush=True)
    out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)

tg.select_blocks = sg.select_blocks_gluon
for lengths in (tg.VARLEN_8K, [32768]):
    tg._check_select(lengths, 1, NSAConfig(block_size=64, topk=16), torch.bfloat16, 0, dev)
tg._check_select([131072], 1, NSAConfig(block_size=64, topk=16), torch.bfloat16, 0, dev, 8192)
print("select_gluon against the reference (tests/test_gpu_compression.py's g = 1 cases, 8K varlen, 32K, 128K): passed",
      flush=True)
