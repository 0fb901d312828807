"""GPU check of the end-to-end path, < 5 minutes on one H200.

1. Swap correctness in bf16 on the GPU: a tiny Llama and Qwen3 patched with NSA configured as full
   attention (topk >= blocks, gates forced to the selected branch) must match HF's SDPA logits,
   for each selection kernel.
2. cuDNN SDPA with GQA (enable_gqa, as transformers calls it without a mask) agrees with flash,
   and HF passes attention_mask=None to the full-attention baseline (no dense mask is built).
3. Llama3-8B 2-layer slice training step at 32K, (64,16): fsa / nsa / sdpa_cudnn / sdpa_flash,
   with the attention/MLP split and the full-depth estimate.
4. Llama3-8B full-depth fp16 prefill at 32K: fsa / nsa / sdpa_cudnn / sdpa_flash.

Prints a table and writes every row to ``--out`` (default ``$OUT`` or ./e2e_check) as JSON.

    python scripts/gpu/check_e2e.py [--out DIR] [--N 32768] [--compression-impl auto]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn


def swap_check(impls, compression_impl: str, window_impl: str) -> list[str]:
    from fsalab import NSAConfig
    from fsalab.models import configs, patch

    tiny = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 512, "bos_token_id": None, "eos_token_id": None}
    lines = []
    for name in ("llama3-8b", "qwen3-14b"):
        hf = configs.build_model(name, 2, "cuda", torch.bfloat16, **tiny)
        configs.init_random_(hf, seed=0)
        ids = torch.randint(0, 512, (2, 1000), device="cuda")
        with torch.no_grad(), patch.attention_context("sdpa_flash"):
            ref = hf(input_ids=ids, use_cache=False).logits.float()
        for impl in impls:
            model = copy.deepcopy(hf)
            try:
                patch.patch_model(model, impl, NSAConfig(block_size=64, topk=16, window_size=64),
                                  compression_impl, window_impl)
                for adapter in patch.attention_modules(model):
                    h = adapter.nsa.num_heads
                    gate = nn.Linear(adapter.nsa.hidden_size, 3 * h, bias=True, device="cuda", dtype=torch.bfloat16)
                    with torch.no_grad():
                        gate.weight.zero_()
                        gate.bias.copy_(torch.tensor([-100.0, 100.0, -100.0]).repeat(h))
                    adapter.nsa.gate_proj = gate
                with torch.no_grad():
                    out = model(input_ids=ids, use_cache=False).logits.float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                verdict = "ok" if err < 3e-2 else "FAIL"
                lines.append(f"swap {name:10s} {impl:10s} rel max err vs HF sdpa (bf16): {err:.2e} {verdict}")
            except Exception as exc:  # noqa: BLE001 - report and continue
                lines.append(f"swap {name:10s} {impl:10s} ERROR {type(exc).__name__}: {str(exc)[:200]}")
    return lines


def sdpa_check() -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsalab.models import configs, patch

    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = {}
    lines = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                outs[name] = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except Exception as exc:  # noqa: BLE001
            lines.append(f"sdpa {name} with enable_gqa: ERROR {type(exc).__name__}: {str(exc)[:200]}")
    if len(outs) == 2:
        err = (outs["cudnn"].float() - outs["flash"].float()).abs().max().item()
        lines.append(f"sdpa cudnn vs flash, GQA g=4, 8K causal: max abs diff {err:.2e} {'ok' if err < 2e-2 else 'FAIL'}")
    model = configs.build_model("llama3-8b", 1, "cuda", torch.bfloat16, vocab_size=512, bos_token_id=None,
                                eos_token_id=None)
    seen = {}

    def record_mask(module, args, kwargs):
        seen.setdefault("mask_is_none", kwargs.get("attention_mask") is None)

    model.model.layers[0].self_attn.register_forward_pre_hook(record_mask, with_kwargs=True)
    with torch.no_grad(), patch.attention_context("sdpa_cudnn"):
        model(input_ids=torch.randint(0, 512, (1, 4096), device="cuda"), use_cache=False)
    lines.append(f"HF full attention gets attention_mask=None: {seen.get('mask_is_none')}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "e2e_check")
    ap.add_argument("--N", type=int, default=32768)
    ap.add_argument("--impls", default="fsa,nsa,sdpa_cudnn,sdpa_flash")
    ap.add_argument("--compression-impl", default="auto")
    ap.add_argument("--window-impl", default="auto")
    ap.add_argument("--checks-only", action="store_true", help="only steps 1-2 (no timed points)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    from fsalab.bench import prefill, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    impls = args.impls.split(",")
    t0 = time.time()
    report = swap_check([i for i in impls if not i.startswith("sdpa")], args.compression_impl, args.window_impl)
    print("\n".join(report), flush=True)
    try:
        lines = sdpa_check()
    except Exception as exc:  # noqa: BLE001 - report and go on to the timed points
        lines = [f"sdpa check ERROR {type(exc).__name__}: {str(exc)[:300]}"]
    print("\n".join(lines), flush=True)
    report += lines
    if args.checks_only:
        return 1 if any("FAIL" in x or "ERROR" in x for x in report) else 0

    rows = []
    common = {"model": "llama3-8b", "N": args.N, "block_size": 64, "topk": 16,
              "compression_impl": args.compression_impl, "window_impl": args.window_impl}
    for op, runner, extra in (
        ("train_step", train.run_point, {"dtype": "bfloat16", "layers": 2, "split": True}),
        ("prefill", prefill.run_point, {"dtype": "float16", "layers": None, "split": True}),
    ):
        for impl in impls:
            p = {**train.DEFAULTS, **common, **extra, "op": op, "impl": impl, "experiment": "e2e_check"}
            p["id"] = train.point_id(p)
            row = runner(p, {"timing": {"warmup": 2, "repeats": 5}}, torch.device("cuda"))
            rows.append(row)
            (out / f"{p['id']}.json").write_text(json.dumps(row, indent=1, default=str))
            print(f"{p['id']}: {row['status']} {row.get('median_ms') or row['message'][:300]}", flush=True)

    print(f"\n{'op':11s} {'impl':11s} {'status':7s} {'median_ms':>10s} {'full_ms':>10s} {'attn/L':>8s} "
          f"{'mlp/L':>8s} {'tok/s':>9s} {'peakGiB':>8s}")
    def f(r, key, fmt="{:.1f}"):
        return fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else "-"

    for r in rows:
        print(f"{r['op']:11s} {r['impl']:11s} {r['status']:7s} {f(r, 'median_ms'):>10s} {f(r, 'full_depth_ms'):>10s} "
              f"{f(r, 'attention_ms_per_layer'):>8s} {f(r, 'mlp_ms_per_layer'):>8s} {f(r, 'tokens_per_s', '{:.0f}'):>9s} "
              f"{f(r, 'peak_mem_gib'):>8s}")
    for op in ("train_step", "prefill"):
        ms = {r["impl"]: r["median_ms"] for r in rows if r["op"] == op and r["status"] == "ok"}
        if "fsa" in ms:
            ratios = ", ".join(f"{k}/fsa = {v / ms['fsa']:.2f}x" for k, v in ms.items() if k != "fsa")
            print(f"{op}: {ratios}")
    print(f"total {time.time() - t0:.0f} s")
    failed = [r for r in rows if r["status"] != "ok"] or [x for x in report if "FAIL" in x or "ERROR" in x]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
