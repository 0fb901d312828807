"""Convergence parity (the claim behind FSA Fig. 11): train a small model on a synthetic
long-context retrieval task, or on real text, with FSA, NSA and full attention from the same
seed; FSA's and NSA's loss curves must agree within numerical noise and all three must learn.

Retrieval task (``task: retrieval``, the default; generated on the fly from a per-step seed
shared by every impl): each row is a context of random filler with ``pairs`` needles scattered
over it, each a token that stands for a (key, value) pair, then ``queries`` key tokens; the
target at each query is the value of the needle with that key, usually thousands of tokens back,
beyond NSA's sliding window, so NSA must reach it through compression and block selection. Needles fuse key and value into one token so
the task needs a single attention hop: a key-value pair split over two tokens needs an induction
circuit (two composed heads), which small models did not form within a few hundred steps.
``needle_span`` > 1 makes each needle a run of that many copies of its token (the committed
``-span32`` points: one kernel_size). A single-token needle is 1 of kernel_size terms of a
compressed key, each behind its own offset-specific map, so the compressed scores (which alone
rank blocks for selection: selection has no gradient) never learn to find it; NSA and FSA then
stay at chance while full attention learns. A run fills a compression window, and they learn.

Text task (``task: text``, ``text_batch``): byte-level language modelling of the Python standard
library's own sources, the one real text every machine has offline (``text_corpus``): each row
N + 1 consecutive bytes from the training split, the label at each byte the next byte; a fixed
held-out batch from the held-out split (the corpus's last ``TEXT_HELDOUT_FRACTION`` of bytes) is
evaluated at each logged step (``curve["eval_loss"]``). Another Python ships other sources, so
rows record the corpus's identity (``corpus_*``: Python version, files, bytes, SHA-256).

Model: the Llama architecture of ``fsalab.models.configs`` shrunk by ``model_overrides``
(``points.CONVERGENCE_DEFAULTS``: 2 layers, hidden 256, 4 query / 2 KV heads of 64), with the same attention swap as
the benchmarks. Parameters, gradients and AdamW state in ``dtype`` (bf16 by default, as the
paper trains). One result row per impl (DESIGN §2 columns; op ``convergence``; median step
time; the loss and accuracy curves under ``curve``; for retrieval, accuracy split into "far"
queries, whose needle lies beyond the sliding window, and "near" ones; for text, next-byte
accuracy and the held-out batch's loss and accuracy).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform as platform_module
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

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


# The text task's corpus: the standard library's *.py sources, without the folders whose content
# depends on the installation (third-party packages) or that distributions often strip (tests).
TEXT_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
TEXT_HELDOUT_FRACTION = 0.05
# Below this the training split would repeat within a few hundred steps of 8 rows of 8K bytes.
TEXT_MIN_BYTES = 1 << 20
TEXT_VOCAB = 256  # bytes


@dataclass(frozen=True)
class TextCorpus:
    """The text task's corpus: ``data`` (uint8, every byte), ``split`` (the first held-out byte)
    and ``identity`` (the ``corpus_*`` fields a row records)."""

    data: torch.Tensor
    split: int
    identity: dict


@functools.lru_cache(maxsize=None)
def text_corpus(root: str | None = None) -> TextCorpus:
    """The concatenated bytes of every ``*.py`` file under ``root`` (default: this Python's
    standard library, ``sysconfig.get_paths()["stdlib"]``), in sorted order of their relative
    paths, skipping ``TEXT_SKIP_DIRS``; built once per process. ValueError when they hold fewer
    than ``TEXT_MIN_BYTES``."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in TEXT_SKIP_DIRS]  # prune: site-packages is most of the tree
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda f: f.relative_to(base).as_posix())
    blob = b"".join(f.read_bytes() for f in files)
    if len(blob) < TEXT_MIN_BYTES:
        raise ValueError(f"the text task needs at least {TEXT_MIN_BYTES} bytes of Python sources, but {base} holds "
                         f"{len(blob)} in {len(files)} *.py files (a stripped standard library?)")
    split = len(blob) - int(len(blob) * TEXT_HELDOUT_FRACTION)
    identity = {"corpus": "python-stdlib", "corpus_python": platform_module.python_version(),
                "corpus_files": len(files), "corpus_bytes": len(blob), "corpus_heldout_bytes": len(blob) - split,
                "corpus_sha256": hashlib.sha256(blob).hexdigest()}
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return TextCorpus(data, split, identity)


def text_offsets(p: dict, step: int, corpus: TextCorpus) -> torch.Tensor:
    """First bytes of the training rows of ``step`` ([batch]): uniform over the training split,
    each row's N + 1 bytes (ids and the last label) ending before ``corpus.split``. Deterministic
    in (seed, step)."""
    room = corpus.split - p["N"]
    if room < 1:
        raise ValueError(f"the text corpus's training split ({corpus.split} bytes) is shorter than a row (N + 1 = "
                         f"{p['N'] + 1})")
    gen = torch.Generator(device="cpu").manual_seed(p["seed"] * 1_000_003 + step)
    return torch.randint(0, room, (p["batch"],), generator=gen)


def heldout_offsets(p: dict, corpus: TextCorpus) -> torch.Tensor:
    """First bytes of the held-out batch ([batch]): evenly spaced over the held-out split, the
    same for every step, seed and impl."""
    last = corpus.data.numel() - p["N"] - 1
    if last < corpus.split:
        raise ValueError(f"the text corpus's held-out split ({corpus.data.numel() - corpus.split} bytes) is shorter "
                         f"than a row (N + 1 = {p['N'] + 1})")
    return torch.linspace(corpus.split, last, p["batch"], dtype=torch.float64).round().long()


def _rows(corpus: TextCorpus, offsets: torch.Tensor, n: int, device: torch.device):
    rows = corpus.data[offsets[:, None] + torch.arange(n + 1)].long()
    return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)


def text_batch(p: dict, step: int, device: torch.device, corpus: TextCorpus | None = None):
    """ids [batch, N] and labels [batch, N] (the next byte) of training step ``step``: rows of
    ``text_offsets`` from the training split (``text_corpus`` by default)."""
    corpus = corpus or text_corpus()
    return _rows(corpus, text_offsets(p, step, corpus), p["N"], device)


def heldout_batch(p: dict, device: torch.device, corpus: TextCorpus | None = None):
    """ids and labels of the held-out batch (``heldout_offsets``), evaluated at each logged step."""
    corpus = corpus or text_corpus()
    return _rows(corpus, heldout_offsets(p, corpus), p["N"], device)


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
        text = p.get("task", "retrieval") == "text"
        corpus = text_corpus() if text else None  # first: a corpus too small fails before the model is built
        lm = build_patched_model(p, device, dtype)
        lm.train()
        vocab = lm.config.vocab_size
        if text and vocab < TEXT_VOCAB:
            raise ValueError(f"the text task models bytes: vocab_size must be at least {TEXT_VOCAB}, got {vocab}")
        opt = torch.optim.AdamW(lm.parameters(), lr=p["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        if text:
            curve = {"step": [], "loss": [], "accuracy": [], "eval_loss": [], "eval_accuracy": []}
            held_ids, held_labels = heldout_batch(p, device, corpus)
        else:
            curve = {"step": [], "loss": [], "accuracy": [], "accuracy_far": [], "accuracy_near": []}
        step_ms = []
        for step in range(p["steps"]):
            if text:
                (ids, labels), far = text_batch(p, step, device, corpus), None
            else:
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
                splits = (("accuracy", mask),) if far is None else (
                    ("accuracy", mask), ("accuracy_far", far), ("accuracy_near", mask & ~far))
                for key, m in splits:
                    curve[key].append(float(hit[m].float().mean()) if bool(m.any()) else None)
                if text:  # after this step's update, outside the timed step
                    with torch.no_grad(), attention_context(p["impl"]):
                        held = lm(input_ids=held_ids, use_cache=False).logits.float()
                    held_loss = nn.functional.cross_entropy(held.flatten(0, 1), held_labels.flatten())
                    curve["eval_loss"].append(float(held_loss))
                    curve["eval_accuracy"].append(float((held.argmax(-1) == held_labels).float().mean()))
                    held = None
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
        if text:  # next-byte prediction has no far/near split; chance = a uniform guess over bytes
            row.update(corpus.identity, final_accuracy_far=None, chance_loss=math.log(TEXT_VOCAB),
                       final_eval_loss=curve["eval_loss"][-1], final_eval_accuracy=curve["eval_accuracy"][-1])
        else:
            row["final_accuracy_far"] = curve["accuracy_far"][-1]
            row["chance_loss"] = math.log(p["num_values"])
        finite = all(math.isfinite(x) for x in curve["loss"] + curve.get("eval_loss", []))
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
