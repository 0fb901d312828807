"""End-to-end training-step benchmark (FSA Fig. 5; attention vs MLP split of Fig. 10).

One point = one model (``fsalab.models.configs``) x attention impl (NSA selection impl, or a
full-attention baseline) x sequence length N x batch (B sequences of N tokens each, no padding)
x (block_size, topk). A step is forward + backward + AdamW step in bf16 (parameters, gradients
and optimizer state all bf16), with activation checkpointing per decoder layer and a chunked
cross-entropy (``chunked_cross_entropy``) that holds fp32 logits for one chunk of tokens at a time.

On one GPU a point runs a slice of ``layers`` decoder layers plus the embedding, final norm and
LM head. The row reports the slice's step time (``median_ms``) and, labelled as an estimate,
``full_depth_estimate_ms`` = slice + (L_full - L) x one checkpointed layer's fwd+bwd (timed in
isolation) + AdamW time scaled to the full parameter count. Under torchrun (``parallel: fsdp``)
the same step runs at the depth asked for with FSDP2 (``fsalab.parallel``) and no estimate is needed.

Attention vs MLP (Fig. 10): one layer's attention module and MLP are timed in isolation at the
step's shape (fwd, and fwd+bwd); with checkpointing a layer costs fwd + (recompute fwd + bwd),
so ``attention_ms_per_layer`` = fwd + fwd+bwd. Slice and full-depth totals are L x per layer.

Rows follow DESIGN §2 (``fsalab.bench.rows``; op ``train_step``, direction ``fwd+bwd``,
``model`` filled) with provenance; every failure (OOM included) becomes a row. ``main(argv)`` is
the command line (``fsalab.bench.e2e_cli``; also ``python -m fsalab.bench.train`` and
``torchrun -m fsalab.bench.train``).
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

from .. import settings
from .e2e_cli import run_cli
from .layer_split import layer_part_times, split_columns
from .model_build import CausalLMLoss, build_patched_model, enable_checkpointing, linear_params, random_batch, release
from .points import DTYPES
from .rows import e2e_row, fail_row
from .timing import timed_steps, timed_steps_with_peak


def training_memory_floor(p: dict, dtype: torch.dtype, world: int) -> int | None:
    """A lower bound (bytes per rank) on what a full-depth training step of the published model
    holds: parameters, gradients and AdamW's two moments, all in ``dtype`` and sharded ``world``
    ways, plus every checkpointed decoder layer's input [batch, N, hidden]. None for slices and
    overridden configs (they fit by construction). It leaves out the layer being recomputed,
    the loss chunk and FSDP's gather buffers, so a point above it cannot fit."""
    from ..models.configs import get_spec

    spec = get_spec(p["model"])
    if p.get("model_overrides") or (p.get("layers") or spec.num_layers) < spec.num_layers:
        return None
    size = torch.empty((), dtype=dtype).element_size()
    state = 4 * spec.num_params * size // world
    checkpoints = spec.num_layers * p["batch"] * p["N"] * spec.config["hidden_size"] * size if p["checkpointing"] else 0
    return state + checkpoints


def check_training_fits(p: dict, dtype: torch.dtype, world: int, capacity: int) -> None:
    """Raise torch.OutOfMemoryError before anything is built when the point's memory floor
    (``training_memory_floor``) exceeds ``capacity`` bytes: a full-depth point that cannot fit
    on this many GPUs becomes an ``oom`` row in seconds instead of after a model build."""
    floor = training_memory_floor(p, dtype, world)
    if floor is not None and floor > capacity:
        gib = 2**30
        raise torch.OutOfMemoryError(
            f"predicted before building: at least {floor / gib:.1f} GiB per rank (parameters, gradients and "
            f"AdamW state over {world} rank(s) + checkpointed layer inputs) > {capacity / gib:.1f} GiB on this GPU")


def run_point(p: dict, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Measure one training-step point; always returns a row."""
    from ..models.patch import attention_context
    from ..parallel import fsdp
    from .provenance import detect_platform, provenance

    platform = platform or detect_platform()
    row = e2e_row(p, "train_step", "fwd+bwd", platform)
    timing = {"warmup": 2, "repeats": 5, **exp.get("timing", {})}
    dtype = DTYPES[p["dtype"]]
    distributed = p.get("parallel", "none") == "fsdp"
    world = fsdp.world_size() if distributed else 1
    started = time.time()
    try:
        if distributed and not fsdp.is_initialized():
            raise ValueError("parallel: fsdp needs a process group (launch with torchrun)")
        if device.type == "cuda":
            check_training_fits(p, dtype, world, torch.cuda.get_device_properties(device).total_memory)
        model = build_patched_model(p, device, dtype, wrap=lambda m: CausalLMLoss(m, p["loss_chunk"]),
                                    shard=fsdp.shard_causal_lm if distributed else None)
        lm = model.lm
        if p["checkpointing"]:
            enable_checkpointing(lm)
        lm.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        ids, labels = random_batch(lm.config.vocab_size, p["batch"], p["N"], device, p["seed"] + fsdp.rank())
        losses = []

        def step():
            with attention_context(p["impl"]):
                loss = model(ids, labels)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        with settings.override(value_checks=False):
            t, peak = timed_steps_with_peak(step, device, timing)
            final_loss = float(losses[-1])
            # AdamW alone (gradients present), to scale it to the full parameter count.
            for prm in model.parameters():
                prm.grad = torch.zeros_like(prm)
            t_opt = timed_steps(opt.step, device, timing).summary()["median_ms"]
            opt.zero_grad(set_to_none=True)
            # One layer alone: the full-depth estimate always, the attention/MLP split if asked.
            parts = None if distributed else layer_part_times(
                lm, p, device, dtype, timing, True, ("attention", "mlp", "layer") if p["split"] else ("layer",))
        row.update(t.summary())
        row["samples_ms"] = t.samples_ms
        row["timing"] = {"method": t.method, **t.settings, "scope": "fwd + bwd + AdamW step"}
        row["peak_mem_gib"] = fsdp.max_over_ranks(peak) if distributed else peak
        row["peak_mem_kind"] = "max_memory_allocated over the timed steps (weights, grads, optimizer, activations)"
        row["loss"] = final_loss
        row["check"] = {"status": "pass" if math.isfinite(final_loss) else "fail", "what": "finite loss"}
        tokens = p["batch"] * p["N"] * world
        row["tokens_per_s"] = tokens / (row["median_ms"] * 1e-3)
        # DTensor.numel() is the global size, so this is the whole model's count under FSDP too.
        row["useful_tflops"] = 6 * linear_params(lm) * tokens / (row["median_ms"] * 1e-3) / 1e12
        row["useful_flops_kind"] = ("6 x linear-layer params x tokens, summed over ranks (attention excluded: "
                                    "same numerator for every impl)")
        row["optimizer_ms"] = t_opt
        row.update(_estimate(row, lm, p, parts, t_opt, distributed))
        row["world_size"] = world
        if distributed:
            row["local_param_fraction"] = fsdp.local_fraction(model)
        row["status"] = "ok" if row["check"]["status"] == "pass" else "error"
        if row["status"] == "error":
            row["message"] = f"non-finite loss {final_loss}"
    except Exception as exc:  # noqa: BLE001 - every failure of a point becomes a row
        fail_row(row, exc)
    finally:
        model = lm = opt = None  # drop references before freeing the cache
        release(device)
    row["elapsed_s"] = round(time.time() - started, 3)
    row["provenance"] = provenance(platform)
    return row


def _estimate(row: dict, lm: nn.Module, p: dict, parts: dict | None, t_opt: float, distributed: bool) -> dict:
    """Full-depth columns: measured (FSDP / full depth) or estimated from the slice."""
    layers, layers_full = row["layers"], row["layers_full"]
    out = {}
    if parts is not None:
        out["split_parts"] = parts
    if parts is not None and p["split"]:
        out.update(split_columns(parts, layers, layers_full, True, p["checkpointing"]))
    if layers == layers_full:
        out["full_depth_ms"] = row["median_ms"]
        out["full_depth_kind"] = "measured" + (" (FSDP2)" if distributed else "")
        return out
    if parts is None:
        return out
    from ..models.configs import get_spec

    slice_params = sum(prm.numel() for prm in lm.parameters())
    full_params = get_spec(p["model"]).num_params if not p.get("model_overrides") else slice_params
    extra_opt = t_opt * max(full_params - slice_params, 0) / slice_params
    out["full_depth_ms"] = row["median_ms"] + (layers_full - layers) * parts["layer_fwdbwd_ms"] + extra_opt
    out["full_depth_kind"] = (
        "estimate: slice step + (L_full - L) x isolated checkpointed layer fwd+bwd "
        "+ AdamW time x (full params - slice params) / slice params"
    )
    return out


def main(argv=None) -> int:
    """``fsalab bench-train``: one point, a whole experiment, or an ad-hoc point from flags."""
    return run_cli(argv, run_point, "train_step", "bfloat16")


if __name__ == "__main__":
    sys.exit(main())
