"""Convergence parity (the claim behind FSA Fig. 11): train a small model on a synthetic
long-context retrieval task with FSA, NSA and full attention from the same seed; FSA's and
NSA's loss curves must agree within numerical noise and all three must learn.

Task (generated on the fly from a per-step seed shared by every impl): each row is a context of
random filler with ``pairs`` needles scattered over it, each a token that stands for a
(key, value) pair, then ``queries`` key tokens; the target at each query is the value of the
needle with that key, usually thousands of tokens back, beyond NSA's sliding window, so NSA must
reach it through compression and block selection. Needles fuse key and value into one token so
the task needs a single attention hop: a key-value pair split over two tokens needs an induction
circuit (two composed heads), which small models did not form within a few hundred steps.
``needle_span`` > 1 makes each needle a run of that many copies of its token (the committed
``-span32`` points: one kernel_size). A single-token needle is 1 of kernel_size terms of a
compressed key, each behind its own offset-specific map, so the compressed scores (which alone
rank blocks for selection: selection has no gradient) never learn to find it; NSA and FSA then
stay at chance while full attention learns. A run fills a compression window, and they learn.

Model: the Llama architecture of ``fsalab.models.configs`` shrunk by ``model_overrides``
(``points.CONVERGENCE_DEFAULTS``: 2 layers, hidden 256, 4 query / 2 KV heads of 64), with the same attention swap as
the benchmarks. Parameters, gradients and AdamW state in ``dtype`` (bf16 by default, as the
paper trains). One result row per impl (DESIGN §2 columns; op ``convergence``; median step
time; the loss and accuracy curves under ``curve``, accuracy split into "far" queries, whose
needle lies beyond the sliding window, and "near" ones).
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

from .e2e_cli import run_cli
from .model_build import build_patched_model, release
from .points import CONVERGENCE_DEFAULTS, DTYPES
from .rows import e2e_row, fail_row


def retrieval_batch(p: dict, vocab: int, step: int, device: torch.device):
    """ids [batch, N], labels [batch, N] (-100 except at each query) and ``far`` [batch, N] bool
    (the queries whose needle lies ``window_size`` or more tokens back: only compression and
    selection can reach it in NSA).

    Each row: a context of N - queries tokens of random filler holding ``pairs`` needles at
    random positions, each one token that encodes a (key, value) pair with distinct keys, then
    ``queries`` key tokens drawn (with repetition) from the row's needles; the label at a query
    is its value. One attention hop solves it (match the key, read the value), which is what makes
    it learnable in a few hundred steps. Vocabulary: 0 unused, values, keys, needles
    (key-major), filler. Deterministic in (seed, step), identical for every impl.
    ``needle_span`` > 1: each needle is that many consecutive copies of its token (starts on
    distinct span-aligned slots shifted by one random offset per row); ``far`` then measures from
    the run's last token. Span 1 draws exactly the original batches.
    """
    b, n, pairs, queries = p["batch"], p["N"], p["pairs"], p["queries"]
    nk, nv = p["num_keys"], p["num_values"]
    val0, key0, needle0 = 1, 1 + nv, 1 + nv + nk
    fill0 = needle0 + nk * nv
    context = n - queries
    if fill0 >= vocab or pairs > nk or pairs > context:
        raise ValueError(f"retrieval task needs vocab > {fill0}, pairs <= num_keys and pairs <= N - queries")
    gen = torch.Generator(device="cpu").manual_seed(p["seed"] * 1_000_003 + step)
    ids = torch.randint(fill0, vocab, (b, n), generator=gen)
    keys = torch.argsort(torch.rand(b, nk, generator=gen), dim=1)[:, :pairs]
    values = torch.randint(0, nv, (b, pairs), generator=gen)
    span = p.get("needle_span", 1)
    if span == 1:  # the original task (committed results): needles at any distinct positions
        pos = torch.argsort(torch.rand(b, context, generator=gen), dim=1)[:, :pairs]
        ids.scatter_(1, pos, needle0 + keys * nv + values)
    else:  # each needle a run of `span` copies: distinct span-aligned slots, one random shift per row
        slots = context // span - 1
        if pairs > slots:
            raise ValueError(f"{pairs} needles of span {span} do not fit in a context of {context} tokens")
        start = torch.argsort(torch.rand(b, slots, generator=gen), dim=1)[:, :pairs] * span
        start = start + torch.randint(0, span, (b, 1), generator=gen)
        run = start[..., None] + torch.arange(span)
        ids.scatter_(1, run.flatten(1), (needle0 + keys * nv + values)[..., None].expand(-1, -1, span).flatten(1))
        pos = start + span - 1  # the needle's last token: the one nearest the queries
    probe = torch.randint(0, pairs, (b, queries), generator=gen)
    ids[:, context:] = key0 + keys.gather(1, probe)
    labels = torch.full_like(ids, -100)
    labels[:, context:] = val0 + values.gather(1, probe)
    far = torch.zeros_like(ids, dtype=torch.bool)
    far[:, context:] = context + torch.arange(queries) - pos.gather(1, probe) >= p["window_size"]
    return ids.to(device), labels.to(device), far.to(device)


def lr_at(p: dict, step: int) -> float:
    """Linear warm-up to ``lr``, then constant."""
    return p["lr"] * min(1.0, (step + 1) / max(1, p["warmup_steps"]))


def run_point(p: dict, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Train one impl for ``steps`` steps; the row carries the curves and the median step time."""
    from ..models.patch import attention_context
    from .provenance import detect_platform, provenance

    platform = platform or detect_platform()
    row = e2e_row(p, "convergence", "fwd+bwd", platform)
    dtype = DTYPES[p["dtype"]]
    started = time.time()
    lm = opt = None
    try:
        lm = build_patched_model(p, device, dtype)
        lm.train()
        vocab = lm.config.vocab_size
        opt = torch.optim.AdamW(lm.parameters(), lr=p["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        curve = {"step": [], "loss": [], "accuracy": [], "accuracy_far": [], "accuracy_near": []}
        step_ms = []
        for step in range(p["steps"]):
            ids, labels, far = retrieval_batch(p, vocab, step, device)
            for group in opt.param_groups:
                group["lr"] = lr_at(p, step)
            t0 = time.perf_counter()
            with attention_context(p["impl"]):
                logits = lm(input_ids=ids, use_cache=False).logits.float()
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                loss.backward()
            nn.utils.clip_grad_norm_(lm.parameters(), p["grad_clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if step % p["log_every"] == 0 or step == p["steps"] - 1:
                hit = logits.argmax(-1) == labels
                mask = labels != -100
                curve["step"].append(step)
                curve["loss"].append(float(loss.detach()))
                for key, m in (("accuracy", mask), ("accuracy_far", far), ("accuracy_near", mask & ~far)):
                    curve[key].append(float(hit[m].float().mean()) if bool(m.any()) else None)
            if (step + 1) % max(1, p["steps"] // 10) == 0:  # a run takes minutes: show it moving
                print(f"  {p['id']}: step {step + 1}/{p['steps']}, loss {curve['loss'][-1]:.3f}, "
                      f"{time.time() - started:.0f} s", file=sys.stderr, flush=True)
        timed_ms = sorted(step_ms[1:] or step_ms)  # the first step compiles/autotunes
        row.update(median_ms=timed_ms[len(timed_ms) // 2], p20_ms=timed_ms[int(0.2 * (len(timed_ms) - 1))],
                   p80_ms=timed_ms[int(0.8 * (len(timed_ms) - 1))], n_samples=len(timed_ms))
        row["samples_ms"] = step_ms
        row["timing"] = {"method": "wallclock", "scope": "one training step (synchronised)", "first_step_excluded": True}
        row["curve"] = curve
        row["final_loss"], row["final_accuracy"] = curve["loss"][-1], curve["accuracy"][-1]
        row["final_accuracy_far"] = curve["accuracy_far"][-1]
        row["chance_loss"] = math.log(p["num_values"])
        finite = all(math.isfinite(x) for x in curve["loss"])
        row["check"] = {"status": "pass" if finite else "fail", "what": "finite losses"}
        row["status"] = "ok" if finite else "error"
        if not finite:
            row["message"] = "non-finite loss"
    except Exception as exc:  # noqa: BLE001 - every failure of a point becomes a row
        fail_row(row, exc)
    finally:
        lm = opt = None  # drop references before freeing the cache
        release(device)
    row["elapsed_s"] = round(time.time() - started, 3)
    row["provenance"] = provenance(platform)
    return row


def main(argv=None) -> int:
    """``fsalab convergence``: the experiment's impls (or one ad-hoc impl), one row each."""
    return run_cli(argv, run_point, "convergence", "bfloat16", CONVERGENCE_DEFAULTS)


if __name__ == "__main__":
    sys.exit(main())
