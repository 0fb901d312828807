"""A/B/C of FSA's NaN containment (selected attention, fsa impl, fwd and fwd+bwd).

A: no containment (the kernels before it), B: containment as merged (row flags every key tile),
C: the working tree (blocks flagged by a pre-pass over V; the plain tiles never inspect V).
Variant packages are copies of fsalab.ops.selection with fsa_partials.py / fsa_bwd.py / fsa.py
swapped: .ab/sel_B = those files at commit 30f91ac (containment as merged in eed2411), .ab/sel_A =
the same with the containment lines removed (plain V loads, no row flags, no NaN write). Run from
the repository root on the GPU with .ab carried: python .ab/ab_nan_guard.py OUT.json
(kept here as the record of what produced ab-nan-guard-*.{log,json}).
"""
import json, shutil, sys, time
from pathlib import Path
import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
SEL = ROOT / "src/fsalab/ops/selection"
for name, src in (("_abA", ROOT / ".ab/sel_A"), ("_abB", ROOT / ".ab/sel_B")):
    dst = SEL.parent / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(SEL, dst)
    for f in ("fsa_partials.py", "fsa_bwd.py", "fsa.py"):
        shutil.copy(src / f, dst / f)
import importlib
from fsalab.bench.inputs import make_inputs
mods = {"A": importlib.import_module("fsalab.ops._abA.fsa"), "B": importlib.import_module("fsalab.ops._abB.fsa"),
        "C": importlib.import_module("fsalab.ops.selection.fsa")}
CPU = not torch.cuda.is_available()  # smoke run through the interpreter
dev = torch.device("cpu" if CPU else "cuda")
out = {"checks": {}, "time": {}}

def point(n, g, bs, topk):
    from dataclasses import asdict
    from fsalab.config import NSAConfig
    return {**asdict(NSAConfig()), "N": n, "batch": 1, "h_kv": 4, "g": g, "d": 128, "dtype": "float16" if CPU else "bfloat16", "block_size": bs, "topk": topk, "seed": 0, **({"kernel_size": 16, "kernel_stride": 8, "window_size": 32} if CPU else {})}

def call(mod, x, grad):
    t = x.tensors
    leaves = [t[k].detach().clone().requires_grad_(grad) for k in ("q", "k", "v")]
    def fwd():
        return mod.selected_attention_fsa(*leaves, x.block_idx, x.cu_seqlens, x.cfg.block_size)[0]
    if not grad:
        return lambda: fwd(), leaves
    do = torch.randn_like(t["q"])
    return (lambda: torch.autograd.grad(fwd(), leaves, do)), leaves

t0 = time.time()
for (n, g, bs, topk) in [(256, 2, 32, 4)] if CPU else [(65536, 1, 64, 16), (65536, 4, 64, 16), (65536, 8, 64, 16), (65536, 4, 128, 8), (16384, 4, 64, 16)]:
    x = make_inputs(point(n, g, bs, topk), dev)
    key = f"N{n} g{g} ({bs},{topk})"
    # correctness: finite inputs give equal outputs in all three; NaN in v of one token: B and C agree
    with torch.no_grad():
        res = {v: mods[v].selected_attention_fsa(x.tensors["q"], x.tensors["k"], x.tensors["v"], x.block_idx, x.cu_seqlens, bs)[0] for v in "ABC"}
        vb = x.tensors["v"].clone(); vb[n // 2 + 3, 1, 5] = float("nan")
        nb = {v: mods[v].selected_attention_fsa(x.tensors["q"], x.tensors["k"], vb, x.block_idx, x.cu_seqlens, bs)[0] for v in "BC"}
    out["checks"][key] = {"A==B": bool(torch.equal(res["A"], res["B"])), "B==C": bool(torch.equal(res["B"], res["C"])),
                          "nan rows B": int(nb["B"].isnan().any(-1).sum()), "nan rows C": int(nb["C"].isnan().any(-1).sum()),
                          "nan pattern equal": bool(torch.equal(nb["B"].isnan(), nb["C"].isnan())),
                          "finite equal": bool(torch.equal(torch.nan_to_num(nb["B"]), torch.nan_to_num(nb["C"])))}
    print(key, out["checks"][key], flush=True)
    for direction in () if CPU else ("fwd", "fwd+bwd"):
        fns = {v: call(mods[v], x, direction != "fwd")[0] for v in "ABC"}
        for f in fns.values():
            f()
        samples = {v: [] for v in "ABC"}
        for order in ("ABC", "CBA", "BCA", "ACB"):
            for v in order:
                samples[v].append(do_bench(fns[v], warmup=10, rep=100, return_mode="median"))
        med = {v: sorted(s)[len(s) // 2] for v, s in samples.items()}
        out["time"][f"{key} {direction}"] = {"samples": samples, "median": med}
        print(f"{key} {direction}: " + " ".join(f"{v} {med[v]:.3f}" for v in "ABC"), f"({time.time()-t0:.0f} s)", flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print("\n| point | dir | A none ms | B every tile | C flagged tiles | B/A | C/A |\n|---|---|---|---|---|---|---|")
for k, r in out["time"].items():
    m = r["median"]; p, d = k.rsplit(" ", 1)
    print(f"| {p} | {d} | {m['A']:.3f} | {m['B']:.3f} | {m['C']:.3f} | {m['B']/m['A']:.3f} | {m['C']/m['A']:.3f} |")
