"""A/B of generate() with each NSA layer's decode step eager (A) or replayed from a CUDA graph (B):
Llama3-8B, 4-layer slice, random weights, bf16, batch 1, 32K and 64K prompts, 64 new tokens,
fsa selection; rounds A B B A A B (median of 3 each), wall clock of the whole call and of a 1-token call (the prefill),
mean step = (whole - prefill) / 63. Tokens of A and B compared. Usage: python ab_generate_graphs.py out.json"""
import json, sys, time
import torch
from fsalab.models import configs, patch
from fsalab.models.cache import generate
from fsalab.config import NSAConfig

dev = torch.device("cuda")
out = []
lm = configs.build_model("llama3-8b", 4, "meta", torch.bfloat16, patch.attn_implementation_for("fsa"))
patch.patch_model(lm, "fsa", NSAConfig(block_size=64, topk=16))
lm.to_empty(device=dev)
configs.init_random_(lm, seed=0)
lm.eval()
STEPS = 64
for N in (32768, 65536):
    ids = torch.randint(0, lm.config.vocab_size, (1, N), generator=torch.Generator(device=dev).manual_seed(N), device=dev)
    def wall(steps, graphs):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.inference_mode():
            o = generate(lm, ids, steps, cuda_graphs=graphs)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, o
    toks = {}
    for graphs in (False, True):
        toks[graphs] = wall(STEPS, graphs)[1]  # warm-up: compile, tune, plans
    row = {"N": N, "steps": STEPS, "same_tokens": bool(torch.equal(toks[False], toks[True])), "ms": {"A_eager": [], "B_graphs": []},
           "prefill_ms": {"A_eager": [], "B_graphs": []}}
    for name in ("A_eager", "B_graphs", "B_graphs", "A_eager", "A_eager", "B_graphs"):
        graphs = name == "B_graphs"
        row["ms"][name].append(wall(STEPS, graphs)[0])
        row["prefill_ms"][name].append(wall(1, graphs)[0])
    for name in ("A_eager", "B_graphs"):
        whole, pre = sorted(row["ms"][name])[1], sorted(row["prefill_ms"][name])[1]
        row[name] = {"median_ms": whole, "prefill_ms": pre, "step_ms": (whole - pre) / (STEPS - 1), "tokens_per_s": STEPS / whole * 1e3}
    out.append(row)
    print(f"N{N}: same tokens {row['same_tokens']}; eager step {row['A_eager']['step_ms']:.3f} ms, graphs {row['B_graphs']['step_ms']:.3f} ms, "
          f"ratio {row['B_graphs']['step_ms'] / row['A_eager']['step_ms']:.3f}; tokens/s {row['A_eager']['tokens_per_s']:.1f} -> {row['B_graphs']['tokens_per_s']:.1f}", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
