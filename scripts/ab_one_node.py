"""A/B of the whole NSA attention on one GPU: one autograd node (``ops.attention.nsa_attention``,
"fused") against the same kernels composed by autograd (its ``fused`` check turned off,
"composed"), cuDNN's causal attention beside, interleaved in one process (``bench.timing.interleaved``:
eager, CUDA events, L2 flushed), bf16, 4 KV heads, d = 128, the published config, one sequence.
Prints a correctness line per shape (forward bits, gradients' largest relative difference,
launches), each callable's median by the callable that ran just before it, and a table last;
writes ab_node.json to $OUT (default /tmp).
``AB_SMOKE=1`` runs one tiny shape on the CPU under the Triton interpreter (a check of the script);
``AB_SHAPES=65536:4`` times only the listed (N, g), ``AB_ROUNDS`` sets the interleaved rounds (20).
``AB_PROFILE=1`` then prints, per shape and call, the GPU time of each kernel over 5 calls under
torch.profiler, node and composed side by side (where their times differ).

    PYTHONPATH=src python scripts/ab_one_node.py
"""
import json, os, statistics, sys
SMOKE = os.environ.get("AB_SMOKE") == "1"  # a CPU run of tiny shapes under the interpreter, to check the script
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
import torch
from fsalab import settings
from fsalab.config import NSAConfig
from fsalab.ops import attention
from fsalab.bench.timing import Rounds, interleaved
from fsalab.testing import LaunchCounter
from fsalab.ops.full import full_attention

settings.configure(value_checks=False)
dev = torch.device("cpu" if SMOKE else "cuda")
print("cpu" if SMOKE else torch.cuda.get_device_name(), torch.__version__, flush=True)
cfg = (NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=16)
       if SMOKE else NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=16, init_blocks=1, local_blocks=2, window_size=512))
DT = torch.float16 if SMOKE else torch.bfloat16
rows = []


def composed(*a, **kw):
    saved = attention.fused
    attention.fused = lambda *x: False
    try:
        return attention.nsa_attention(*a, **kw)
    finally:
        attention.fused = saved


SHAPES = [(64, 1)] if SMOKE else [(8192, 1), (16384, 1), (32768, 1), (65536, 1), (16384, 4), (32768, 4), (65536, 4), (32768, 5)]
if os.environ.get("AB_SHAPES"):  # e.g. "65536:4,32768:5": only these (N, g)
    SHAPES = [tuple(int(x) for x in shape.split(":")) for shape in os.environ["AB_SHAPES"].split(",")]
ROUNDS = int(os.environ.get("AB_ROUNDS", "20"))  # interleaved rounds per shape (more: a tighter median)
PROFILE = os.environ.get("AB_PROFILE") == "1"


def kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """GPU ms per call of each kernel name over ``calls`` calls of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 1e3 / calls for e in prof.key_averages() if e.device_time_total > 0}


def print_profiles(fns) -> None:
    for what in ("fwd", "fwd+bwd"):
        node, comp = kernel_ms(fns[f"fused {what}"]), kernel_ms(fns[f"composed {what}"])
        print(f"  {what}: GPU ms per call by kernel, node / composed (total {sum(node.values()):.3f} / {sum(comp.values()):.3f})")
        for name in sorted(set(node) | set(comp), key=lambda k: -max(node.get(k, 0), comp.get(k, 0))):
            a, b = node.get(name, 0.0), comp.get(name, 0.0)
            if abs(a - b) > 0.01 or max(a, b) > 0.5:
                print(f"    {a:8.3f} {b:8.3f}  {name[:100]}")


WARMUP = 1  # untimed calls of each callable before the rounds


def print_by_predecessor(t, calls) -> None:
    """Each callable's median ms by the callable that ran just before it (the rounds rotate, so
    every callable follows every other one): a predecessor that slows the next call shows here."""
    seen: dict[str, int] = {}
    by: dict[str, dict[str, list[float]]] = {}
    for i, name in enumerate(calls):
        k = seen[name] = seen.get(name, -1 - WARMUP) + 1  # below 0: warm-up calls, untimed
        if k >= 0 and i > 0 and not isinstance(t[name], BaseException):
            by.setdefault(name, {}).setdefault(calls[i - 1], []).append(t[name].samples_ms[k])
    for name, groups in by.items():
        cells = "  ".join(f"{p} {statistics.median(xs):.3f} ({len(xs)})" for p, xs in sorted(groups.items()))
        print(f"  {name} ms by predecessor: {cells}")


for N, g in SHAPES:
    h_kv, d = (1, 16) if SMOKE else (4, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=gen, device=dev) * sc).to(DT)
    q, k, v = r(N, h_kv * g, d), r(N, h_kv, d), r(N, h_kv, d)
    l = cfg.kernel_size
    w_k, w_v, pe = r(h_kv, l * d, d, sc=d ** -0.5 / 4), r(h_kv, l * d, d, sc=d ** -0.5 / 4), r(h_kv, l, d, sc=0.02)
    gate = r(N, h_kv * g, 3)
    cu = torch.tensor([0, N], dtype=torch.int32, device=dev)
    leaves = [t.requires_grad_() for t in (q, k, v, w_k, w_v, pe, gate)]
    do = r(N, h_kv * g, d)
    args = (*leaves, cu, cfg, None, "triton", "auto", "triton", "triton")
    fns = {}
    for name, f in (("fused", attention.nsa_attention), ("composed", composed)):
        def fwd(f=f):
            with torch.no_grad():
                return f(*args)
        def fwdbwd(f=f):
            return torch.autograd.grad(f(*args), leaves, do)
        fns[f"{name} fwd"], fns[f"{name} fwd+bwd"] = fwd, fwdbwd
    qkv = leaves[:3]
    def cudnn_fwd():
        with torch.no_grad():
            return full_attention(*qkv, cu, max_seqlen=N, impl="sdpa_cudnn")
    def cudnn_fwdbwd():
        return torch.autograd.grad(full_attention(*qkv, cu, max_seqlen=N, impl="sdpa_cudnn"), qkv, do)
    if not SMOKE:
        fns["cudnn fwd"], fns["cudnn fwd+bwd"] = cudnn_fwd, cudnn_fwdbwd
    # correctness: same forward, gradients within bf16 rounding of each other
    o1, o2 = fns["fused fwd"](), fns["composed fwd"]()
    g1, g2 = fns["fused fwd+bwd"](), fns["composed fwd+bwd"]()
    gerr = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)) for a, b in zip(g1, g2))
    counts = {}
    for name in ("fused", "composed"):
        with LaunchCounter() as c:
            fns[f"{name} fwd+bwd"]()
        counts[name] = c.total
    print(f"N={N} g={g}: fwd equal {torch.equal(o1, o2)}, max grad rel diff {gerr:.2e}, launches fwd+bwd {counts}", flush=True)
    del o1, o2, g1, g2
    calls = []  # every call's name, in order: each sample's predecessor
    logged = {name: (lambda name=name, f=f: (calls.append(name), f())[1]) for name, f in fns.items()}
    t = interleaved(logged, dev, rounds=Rounds(rounds=2, min_rounds=1, rep_ms=0, max_rounds=2) if SMOKE
                    else Rounds(rounds=ROUNDS, rep_ms=200, budget_ms=4000 * ROUNDS // 20), warmup=WARMUP)
    print_by_predecessor(t, calls)
    row = {"N": N, "g": g, "fwd_equal": True, "grad_rel_diff": gerr, "launches": counts}
    for name, tm in t.items():
        row[name] = tm.summary() if not isinstance(tm, BaseException) else repr(tm)
    rows.append(row)
    m = lambda k: row[k]["median_ms"] if isinstance(row.get(k), dict) else float("nan")
    print(f"  N={N} g={g} fused/composed/cudnn ms: fwd {m('fused fwd'):.3f}/{m('composed fwd'):.3f}/{m('cudnn fwd'):.3f} "
          f"fwd+bwd {m('fused fwd+bwd'):.3f}/{m('composed fwd+bwd'):.3f}/{m('cudnn fwd+bwd'):.3f}", flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_node.json"), "w"), indent=1)
    if PROFILE and not SMOKE:
        print_profiles(fns)
    del leaves, q, k, v, args, fns
    torch.cuda.empty_cache()

print(f"{'N':>6} {'g':>2} {'fused fwd':>10} {'comp fwd':>10} {'c/f':>6} {'cudnn/f':>7} {'fused f+b':>10} {'comp f+b':>10} {'c/f':>6} {'cudnn/f':>7}")
for r in rows:
    m = lambda k: r[k]["median_ms"] if isinstance(r.get(k), dict) else float("nan")
    print(f"{r['N']:>6} {r['g']:>2} {m('fused fwd'):10.3f} {m('composed fwd'):10.3f} {m('composed fwd')/m('fused fwd'):6.3f} "
          f"{m('cudnn fwd')/m('fused fwd'):7.3f} {m('fused fwd+bwd'):10.3f} {m('composed fwd+bwd'):10.3f} "
          f"{m('composed fwd+bwd')/m('fused fwd+bwd'):6.3f} {m('cudnn fwd+bwd')/m('fused fwd+bwd'):7.3f}")
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, "ab_node.json"), "w"), indent=1)
