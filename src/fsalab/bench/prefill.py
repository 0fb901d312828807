"""End-to-end prefill benchmark (FSA Fig. 6): one forward pass over B sequences of N tokens in
fp16 (the paper's inference precision), full depth on one GPU by default.

A step is ``model(input_ids, use_cache=False, logits_to_keep=1)`` under ``torch.inference_mode``:
every layer over all N tokens, the LM head on the last token only (what prefill needs to start
decoding). No KV cache is written (the NSA adapter keeps none; the full-attention baseline is run
the same way so both sides do the same work). Attention vs MLP: one layer's attention module and
MLP timed in isolation (fwd), times L. With ``layers`` < full depth the row adds a labelled
``full_depth_ms`` estimate = slice + (L_full - L) x one layer's forward.

With ``parallel: tp`` under torchrun the model is split over the ranks by tensor parallelism
(``fsalab.parallel.tp``, Appendix I): the same row, with the attention split giving the
attention-module latency at that TP degree (Tables 12-13) and ``median_ms`` the end-to-end
prefill (Tables 14-15).

Model build (``model_build``), the attention/MLP split (``layer_split``), rows and the command
line (``e2e_cli``) are shared with the other end-to-end runners.
"""

from __future__ import annotations

import sys
import time

import torch

from .. import settings
from .e2e_cli import run_cli
from .layer_split import layer_part_times, split_columns
from .model_build import build_patched_model, linear_params, random_batch, release
from .points import DTYPES, PREFILL_DEFAULTS
from .rows import e2e_row, fail_row
from .timing import timed_steps_with_peak


def run_point(p: dict, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Measure one prefill point; always returns a row."""
    from ..models.patch import attention_context
    from ..parallel import fsdp, tp
    from .provenance import detect_platform, provenance

    platform = platform or detect_platform()
    row = e2e_row(p, "prefill", "fwd", platform)
    timing = {"warmup": 2, "repeats": 5, **exp.get("timing", {})}
    dtype = DTYPES[p["dtype"]]
    started = time.time()
    lm = None
    tensor_parallel = p.get("parallel", "none") == "tp"
    world = fsdp.world_size() if tensor_parallel else 1
    try:
        if p.get("parallel", "none") not in ("none", "tp"):
            raise ValueError(f"prefill runs with parallel none or tp, got {p['parallel']!r}")
        if tensor_parallel and not fsdp.is_initialized():
            raise ValueError("parallel: tp needs a process group (launch with torchrun)")
        lm = build_patched_model(p, device, dtype, shard=tp.apply_tensor_parallel if tensor_parallel else None)
        lm.eval()
        ids, _ = random_batch(lm.config.vocab_size, p["batch"], p["N"], device, p["seed"])
        last = []

        def prefill():
            with torch.inference_mode(), attention_context(p["impl"]):
                logits = lm(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            last.append(logits)

        with settings.override(value_checks=False):
            t, peak = timed_steps_with_peak(prefill, device, timing)
            finite = bool(torch.isfinite(last[-1]).all())
            last.clear()
            names = ("attention", "mlp", "layer") if p["split"] else ("layer",)
            slice_only = row["layers"] < row["layers_full"]
            parts = layer_part_times(lm, p, device, dtype, timing, False, names) if p["split"] or slice_only else None
        row.update(t.summary())
        row["samples_ms"] = t.samples_ms
        row["timing"] = {"method": t.method, **t.settings, "scope": "forward of all layers + LM head on the last token"}
        row["peak_mem_gib"] = fsdp.max_over_ranks(peak) if tensor_parallel else peak
        row["world_size"] = world
        row["peak_mem_kind"] = "max_memory_allocated over the timed forwards (weights and activations)"
        row["check"] = {"status": "pass" if finite else "fail", "what": "finite last-token logits"}
        row["tokens_per_s"] = p["batch"] * p["N"] / (row["median_ms"] * 1e-3)
        flops = 2 * linear_params(lm, include_head=False) * p["batch"] * p["N"]
        row["useful_tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
        row["useful_flops_kind"] = "2 x linear-layer params (LM head excluded) x tokens; attention excluded"
        layers, layers_full = row["layers"], row["layers_full"]
        if parts is not None:
            row["split_parts"] = parts
        if p["split"]:
            row.update(split_columns(parts, layers, layers_full, False, False))
            row["split_kind"] = ("layer 0's attention and MLP timed in isolation; with tensor parallelism "
                                 "this rank's share, its all-reduce waited on inside the timed call")
        if layers == layers_full:
            row["full_depth_ms"], row["full_depth_kind"] = row["median_ms"], "measured"
        elif parts is not None:
            row["full_depth_ms"] = row["median_ms"] + (layers_full - layers) * parts["layer_fwd_ms"]
            row["full_depth_kind"] = "estimate: slice forward + (L_full - L) x isolated layer forward"
        row["status"] = "ok" if finite else "error"
        if not finite:
            row["message"] = "non-finite logits"
    except Exception as exc:  # noqa: BLE001 - every failure of a point becomes a row
        fail_row(row, exc)
    finally:
        lm = None
        release(device)
    row["elapsed_s"] = round(time.time() - started, 3)
    row["provenance"] = provenance(platform)
    return row


def main(argv=None) -> int:
    """``fsalab bench-prefill``: one point, a whole experiment, or an ad-hoc point from flags."""
    return run_cli(argv, run_point, "prefill", "float16", PREFILL_DEFAULTS)


if __name__ == "__main__":
    sys.exit(main())
