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

Rows follow DESIGN §2 (``fsalab.bench.kernel.COLUMNS``; op ``train_step``, direction ``fwd+bwd``,
``model`` filled) with provenance; every failure (OOM included) becomes a row. ``main(argv)`` is
the command line (also ``python -m fsalab.bench.train`` and ``torchrun -m fsalab.bench.train``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.utils.checkpoint import checkpoint

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_TAGS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Point parameters and their defaults (an experiment's `defaults` and grid values override them).
DEFAULTS = {
    "batch": 1,
    "layers": 2,
    "block_size": 64,
    "topk": 16,
    "kernel_size": 32,
    "kernel_stride": 16,
    "init_blocks": 1,
    "local_blocks": 2,
    "window_size": 512,
    "compression_impl": "auto",
    "window_impl": "auto",
    "gate_impl": "auto",
    "checkpointing": True,
    "loss_chunk": 4096,
    "split": True,
    "seed": 0,
    "parallel": "none",
    "model_overrides": {},
}
# NSA branches whose op is chosen by name, and their tag in a point id when not "auto".
_BRANCH_TAGS = (("compression_impl", "cmp"), ("window_impl", "win"), ("gate_impl", "gate"))


# ---------------------------------------------------------------- experiments and points


def repo_root() -> Path:
    from .grid import repo_root as root

    return root()


def load_experiment(name_or_path: str | Path, smoke: bool = False) -> dict:
    """``experiments/<name>.yaml`` (or a path), validated by ``fsalab.bench.grid`` (with ``smoke``
    its entry of experiments/smoke.yaml merged over it)."""
    from .grid import load_experiment as load

    return load(name_or_path, smoke=smoke)


def point_id(p: dict) -> str:
    """Stable, file-name-safe id: a readable prefix and ``grid.point_hash`` of every parameter,
    e.g. ``trainstep-llama3-8b-fsa-N65536-b1-L2-B64-T16-bf16-1a2b3c4d``. The prefix of parallel
    runs ends with the mode and rank count (``-fsdp8``), of convergence runs with their step
    count (``-S500``, after ``-span32`` when needles are runs of 32 tokens); a compression,
    window or gate branch other than ``auto`` adds ``-cmp<impl>`` / ``-win<impl>`` / ``-gate<impl>``."""
    from .grid import point_hash

    layers = "full" if p.get("layers") in (None, 0) else p["layers"]
    parts = [p["op"].replace("_", ""), p["model"], p["impl"], f"N{p['N']}", f"b{p['batch']}", f"L{layers}",
             f"B{p['block_size']}", f"T{p['topk']}", _DTYPE_TAGS[p["dtype"]]]
    if p.get("window_size", 512) != 512:
        parts.append(f"w{p['window_size']}")
    for key, tag in _BRANCH_TAGS:
        if p.get(key, "auto") != "auto":
            parts.append(f"{tag}{p[key]}")
    if p.get("parallel", "none") != "none":
        # The rank count comes from the launcher (torchrun sets WORLD_SIZE before Python starts),
        # so TP = 2 and TP = 8 runs on one host write different results.
        parts.append(f"{p['parallel']}{os.environ.get('WORLD_SIZE', '1')}")
    if p["op"] == "convergence":  # a longer run of the same model is a different result
        if p.get("needle_span", 1) != 1:  # a different task (bench.convergence.retrieval_batch)
            parts.append(f"span{p['needle_span']}")
        parts.append(f"S{p['steps']}")
    parts.append(point_hash(p))
    return "-".join(re.sub(r"[^A-Za-z0-9.\-]+", "", str(x)) for x in parts)


def expand(exp: dict, base: dict | None = None) -> list[dict]:
    """The experiment's points (``fsalab.bench.grid.expand``): runner defaults <- ``base`` <- exp
    defaults <- each sub-grid's values, ``experiment`` and ``id`` set."""
    from .grid import expand as grid_expand

    return grid_expand(exp, base)


def nsa_config_of(p: dict):
    from ..config import NSAConfig

    return NSAConfig(
        kernel_size=p["kernel_size"], kernel_stride=p["kernel_stride"], block_size=p["block_size"],
        topk=p["topk"], init_blocks=p["init_blocks"], local_blocks=p["local_blocks"], window_size=p["window_size"],
    )


# ---------------------------------------------------------------- model and loss


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``labels`` (-100 ignored), fp32.

    hidden [tokens, hidden_size], labels int64 [tokens]. Logits are built one chunk of ``chunk``
    tokens at a time (cast to fp32 inside the chunk only) and rebuilt in backward
    (checkpointed), so peak extra memory is one chunk's logits instead of tokens x vocab.
    """

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(h).float(), y, ignore_index=-100, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start : start + chunk], labels[start : start + chunk]
        total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
    return total / (labels != -100).sum().clamp(min=1)


class CausalLMLoss(nn.Module):
    """An HF causal LM returning the chunked next-token loss; the unit FSDP2 shards as its root.

    forward(input_ids [B, S], labels [B, S]) -> scalar loss. Labels are the next tokens, -100
    where there is none.
    """

    def __init__(self, lm: nn.Module, chunk: int) -> None:
        super().__init__()
        self.lm, self.chunk = lm, chunk

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return chunked_cross_entropy(hidden.flatten(0, 1), self.lm.lm_head, labels.flatten(), self.chunk)


def build_patched_model(p: dict, device: torch.device, dtype: torch.dtype, wrap=None, shard=None) -> nn.Module:
    """The point's model built on the meta device with its attention swapped, optionally wrapped
    (``wrap(model)``, e.g. CausalLMLoss) and sharded (``shard(root)``, FSDP2), then materialised
    on ``device`` with random weights: no rank ever holds an unsharded copy."""
    from ..models import configs, patch

    impl = patch.canonical_impl(p["impl"])
    model = configs.build_model(p["model"], p.get("layers") or None, "meta", dtype,
                                patch.attn_implementation_for(impl), **p.get("model_overrides", {}))
    patch.patch_model(model, impl, nsa_config_of(p), p["compression_impl"], p["window_impl"], p["gate_impl"])
    root = wrap(model) if wrap is not None else model
    if shard is not None:
        shard(root)
    root.to_empty(device=device)
    configs.init_random_(model, seed=p["seed"])
    return root


def enable_checkpointing(lm: nn.Module) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant), via transformers' API
    (``activation_checkpointing_enable`` from 5.2x on, ``gradient_checkpointing_enable`` before)."""
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def random_batch(vocab: int, batch: int, n: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [batch, n] and their next-token labels (-100 at the end of each row)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, n), generator=gen).to(device)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def linear_params(model: nn.Module, include_head: bool = True) -> int:
    """Parameters of the nn.Linear weights (the matmul FLOP count's P), LM head optional."""
    head = getattr(model, "lm_head", None)
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Linear) and (include_head or m is not head))


# ---------------------------------------------------------------- rows


def model_shape(p: dict) -> dict:
    """h, h_kv, g, d, hidden, L_full of the point's model (overrides applied)."""
    from ..models.configs import get_spec

    spec = get_spec(p["model"])
    cfg = {**spec.config, **p.get("model_overrides", {})}
    h, h_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // h
    return {"h": h, "h_kv": h_kv, "g": h // h_kv, "d": d, "hidden": cfg["hidden_size"],
            "layers_full": cfg["num_hidden_layers"]}


def base_row(p: dict, op: str, direction: str, platform: str) -> dict:
    """A row with the DESIGN columns and the point's parameters, measurements unset."""
    from .kernel import COLUMNS

    shape = model_shape(p)
    row = {c: None for c in COLUMNS}
    row.update({k: v for k, v in p.items() if k != "id"})
    row.update(op=op, direction=direction, point=p["id"], platform=platform, status=None, message="",
               h=shape["h"], h_kv=shape["h_kv"], g=shape["g"], d=shape["d"],
               layers=p.get("layers") or shape["layers_full"], layers_full=shape["layers_full"])
    return row


def classify(exc: BaseException) -> str:
    """Row status of a failure: oom | unsupported (impl missing, config rejected) | error."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    if isinstance(exc, (ValueError, NotImplementedError, ImportError)):
        return "unsupported"
    return "error"


def fail_row(row: dict, exc: BaseException) -> dict:
    row["status"] = classify(exc)
    row["message"] = f"{type(exc).__name__}: {exc}"[:4000]
    if row["status"] == "error":
        row["traceback"] = traceback.format_exc()[-4000:]
    return row


class value_checks_off:
    """Time without fsalab's device-side input-value asserts (as the kernel runner does)."""

    def __enter__(self):
        self.old = os.environ.get("FSALAB_VALUE_CHECKS")
        os.environ["FSALAB_VALUE_CHECKS"] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("FSALAB_VALUE_CHECKS", None)
        else:
            os.environ["FSALAB_VALUE_CHECKS"] = self.old


def timed(fn, device: torch.device, timing: dict):
    """``fsalab.bench.timing.measure`` with a fixed sample count (cuda_events on GPU, wallclock on CPU)."""
    from .timing import measure

    method = timing.get("method", "auto")
    if method in ("auto", "do_bench"):
        method = "cuda_events" if device.type == "cuda" else "wallclock"
    return measure(fn, device, method, warmup=timing.get("warmup", 2), repeats=timing.get("repeats", 5))


def timed_with_peak(fn, device: torch.device, timing: dict):
    """(timing of fn, peak GiB allocated while it ran: None off CUDA), peak counted from a
    synchronised, reset start so the numbers cover the timed calls only."""
    if device.type != "cuda":
        return timed(fn, device, timing), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t = timed(fn, device, timing)
    return t, torch.cuda.max_memory_allocated(device) / 2**30


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- attention / MLP split


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` with any pending collective waited on. Under tensor parallelism a row-parallel
    layer returns an AsyncCollectiveTensor whose all-reduce is waited on only at its first use,
    so a timed call that discards its output would end before the all-reduce does."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def layer_part_times(lm: nn.Module, p: dict, device: torch.device, dtype: torch.dtype, timing: dict,
                     train: bool, names: tuple[str, ...] = ("attention", "mlp", "layer")) -> dict:
    """Per-layer times (ms) of decoder layer 0's attention, MLP and whole layer (``names``), in
    isolation at the point's shape [batch, N, hidden].

    ``train``: fwd (no grad) and fwd+bwd of attention and MLP; the whole layer as it runs in the
    step (checkpointed when enabled: fwd, then recompute + bwd). Otherwise fwd only (prefill).
    """
    from ..models.patch import attention_context, decoder_layers

    layer = decoder_layers(lm)[0]
    batch, n, hidden = p["batch"], p["N"], lm.config.hidden_size
    # Drawn on the device: one [1, 64K, 5120] fp32 draw takes 1.8 s on a host core (measured on
    # the 2-core development machine), and each point makes two. The same seed on every rank
    # gives tensor-parallel ranks the same replicated input.
    gen = torch.Generator(device=device).manual_seed(p["seed"] + 7)
    x = torch.randn(batch, n, hidden, generator=gen, device=device, dtype=dtype)
    pos = torch.arange(n, device=device)[None].expand(batch, n)
    pe = lm.model.rotary_emb(x, pos)
    dout = torch.randn(batch, n, hidden, generator=gen, device=device, dtype=dtype)

    parts = {
        "attention": lambda t: layer.self_attn(hidden_states=t, position_embeddings=pe, attention_mask=None)[0],
        "mlp": lambda t: layer.mlp(t),
        "layer": lambda t: layer(t, attention_mask=None, position_ids=pos, position_embeddings=pe, use_cache=False),
    }
    out = {}
    with attention_context(p["impl"]):
        for name in names:
            f = parts[name]

            def fwd(f=f):
                with torch.no_grad():
                    return settled(f(x))

            def fwd_bwd(f=f):
                xg = x.detach().requires_grad_(True)
                f(xg).backward(dout)

            if name != "layer":
                out[f"{name}_fwd_ms"] = timed(fwd, device, timing).summary()["median_ms"]
            if train:
                out[f"{name}_fwdbwd_ms"] = timed(fwd_bwd, device, timing).summary()["median_ms"]
            elif name == "layer":
                out["layer_fwd_ms"] = timed(fwd, device, timing).summary()["median_ms"]
    lm.zero_grad(set_to_none=True)
    return out


def split_columns(parts: dict, layers: int, layers_full: int, train: bool, checkpointing: bool) -> dict:
    """Per-layer attention/MLP cost as it appears in the step, and L x that for slice and full depth."""
    out = {}
    for name in ("attention", "mlp"):
        if train:
            per_layer = parts[f"{name}_fwdbwd_ms"] + (parts[f"{name}_fwd_ms"] if checkpointing else 0.0)
        else:
            per_layer = parts[f"{name}_fwd_ms"]
        out[f"{name}_ms_per_layer"] = per_layer
        out[f"{name}_ms_slice"] = per_layer * layers
        out[f"{name}_ms_full_depth"] = per_layer * layers_full
    return out


# ---------------------------------------------------------------- the training step


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
    row = base_row(p, "train_step", "fwd+bwd", platform)
    timing = {"warmup": 2, "repeats": 5, **exp.get("timing", {})}
    dtype = _DTYPES[p["dtype"]]
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

        with value_checks_off():
            t, peak = timed_with_peak(step, device, timing)
            final_loss = float(losses[-1])
            # AdamW alone (gradients present), to scale it to the full parameter count.
            for prm in model.parameters():
                prm.grad = torch.zeros_like(prm)
            t_opt = timed(opt.step, device, timing).summary()["median_ms"]
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
    row["provenance"] = provenance()
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


# ---------------------------------------------------------------- command line


def add_point_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by bench-train and bench-prefill (experiment points or one ad-hoc point)."""
    ap.add_argument("--experiment", help="experiments/<name>.yaml (or a path)")
    ap.add_argument("--point", help="a point id of the experiment")
    ap.add_argument("--all", action="store_true", help="every point of the experiment, in this process")
    ap.add_argument("--list", action="store_true", help="print the experiment's point ids")
    ap.add_argument("--filter", default=".", help="with --all: only point ids matching this regular expression")
    ap.add_argument("--smoke", action="store_true", help="the experiment's tiny entry in experiments/smoke.yaml")
    ap.add_argument("--skip-existing", action="store_true")
    ap.add_argument("--results-dir", default=None, help="default: <repo>/results")
    ap.add_argument("--platform", default=None, help="default: detected (h200, cpu-interpret, ...)")
    ap.add_argument("--out", help="ad-hoc point: write the row here (default: print it)")
    ap.add_argument("--force", action="store_true",
                    help="write even into another machine's results folder or over its row (importing copies)")
    for flag, kind in (("model", str), ("impl", str), ("N", int), ("batch", int), ("layers", int),
                       ("block-size", int), ("topk", int), ("window-size", int),
                       ("seed", int), ("loss-chunk", int), ("parallel", str)):
        ap.add_argument(f"--{flag}", type=kind, default=None)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    ap.add_argument("--model-overrides", type=yaml.safe_load, default=None,
                    help="YAML/JSON mapping of config fields to replace (tiny test models)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)


def run_cli(argv, runner, op: str, default_dtype: str, defaults: dict | None = None) -> int:
    """Shared driver: resolve points from an experiment or from flags, run them, write rows.

    Exit status 0 once every point has its row on disk, failed points included (a failed point
    is a row: a non-zero status would make Snakemake delete the job's files, the good ones with
    it); an ad-hoc point printed instead of written exits 1 when it failed with ``error``."""
    from ..parallel import fsdp

    doc = sys.modules[runner.__module__].__doc__ or ""
    ap = argparse.ArgumentParser(prog=f"fsalab bench-{op.split('_')[0]}", description=doc.split("\n\n")[0])
    add_point_args(ap)
    args = ap.parse_args(argv)
    device = fsdp.setup_device()  # first: selects the Triton interpreter before triton is imported
    from .kernel import check_writable, result_path, run_safely, write_row
    from .provenance import detect_platform

    exp = load_experiment(args.experiment, args.smoke) if args.experiment else {"experiment": op, "runner": {"train_step": "train"}.get(op, op), "grid": []}
    base = {**(defaults or {}), "op": op, "dtype": default_dtype}
    if args.list:
        for p in expand(exp, base):
            print(p["id"])
        return 0
    if args.warmup is not None or args.repeats is not None:
        exp["timing"] = {**exp.get("timing", {}), **{k: v for k, v in
                                                     (("warmup", args.warmup), ("repeats", args.repeats)) if v is not None}}
    if args.point or args.all:
        if not args.experiment:
            ap.error("--point/--all need --experiment")
        points = expand(exp, base)
        if args.all:
            points = [p for p in points if re.search(args.filter, p["id"])]
        if args.point:
            points = [p for p in points if p["id"] == args.point]
            if not points:
                ap.error(f"experiment {exp['experiment']!r} has no point {args.point!r}")
    else:
        flags = {k: getattr(args, k.replace("-", "_")) for k in
                 ("model", "impl", "N", "batch", "layers", "block_size", "topk", "window_size", "dtype", "seed",
                  "loss_chunk", "parallel", "model_overrides")}
        p = {**copy.deepcopy(DEFAULTS), **base, **exp.get("defaults", {})}
        p.update({k: v for k, v in flags.items() if v is not None})
        missing = [k for k in ("model", "impl", "N") if p.get(k) is None]
        if missing:
            ap.error(f"an ad-hoc point needs --{' --'.join(missing)} (or --experiment with --point/--all)")
        p["experiment"], p["id"] = exp["experiment"], point_id(p)
        points = [p]
    platform = args.platform or detect_platform()
    results = Path(args.results_dir) if args.results_dir else repo_root() / "results"
    writes = bool(args.out or args.point or args.all)
    paths = [Path(args.out) if args.out else result_path(results, platform, p["experiment"], p["id"]) for p in points]
    for path in paths if writes else []:  # refuse before measuring anything (another machine's folder)
        if not (args.skip_existing and path.exists()):
            check_writable(path, platform, args.force)
    status = 0
    for i, (p, path) in enumerate(zip(points, paths), 1):
        if args.skip_existing and path.exists():
            continue
        row = run_safely(runner, p, exp, device, platform)
        if fsdp.rank() == 0:
            if writes:
                write_row(row, path, args.force)
            lat = f"{row['median_ms']:.1f} ms" if row.get("median_ms") is not None else row["message"][:120]
            print(f"[{i}/{len(points)}] {p['id']}: {row['status']} {lat}", file=sys.stderr, flush=True)
            if not writes:
                print(json.dumps({k: v for k, v in row.items() if k not in ("provenance", "samples_ms")}, indent=1,
                                 default=str))
        if not writes:
            status = status or (row["status"] not in ("ok", "oom", "unsupported"))
    fsdp.teardown()
    return int(status)


def main(argv=None) -> int:
    """``fsalab bench-train``: one point, a whole experiment, or an ad-hoc point from flags."""
    return run_cli(argv, run_point, "train_step", "bfloat16")


if __name__ == "__main__":
    sys.exit(main())
