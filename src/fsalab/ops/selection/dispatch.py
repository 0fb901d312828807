"""``impl="auto"``: pick the fastest selected-attention implementation per shape, once.

This is the "online profiling module" the FSA paper describes (Appendix E) and its authors
announced but did not release. On the first call with a new shape key — (GPU, dtype, g, h_kv, d,
block_size, topk, token-count bucket, whether gradients are needed) — every candidate is timed
on the call's own inputs (forward, plus backward when gradients are needed) and the winner is
cached in memory and on disk. Later calls with the same key only look the winner up.

Environment:
- ``FSALAB_DISPATCH=rules`` skips profiling and applies the fixed rules below.
- ``FSALAB_DISPATCH_CACHE=/path/file.json`` relocates the disk cache (default:
  ``$XDG_CACHE_HOME/fsalab/dispatch.json``, i.e. ``~/.cache/fsalab/dispatch.json``);
  ``FSALAB_DISPATCH_CACHE=`` (empty) keeps the cache in memory only.

Profiling synchronises the device once per new key; the steady state adds no host sync.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import torch

CANDIDATES = ("fsa", "nsa")
# Without profiling (CPU, or FSALAB_DISPATCH=rules): FSA's loop order wins when a group has few
# heads to batch per token; NSA's once g fills the MMA rows. On the H200 grid
# (results/h200/kernel.csv) this picks the fwd+bwd winner between fsa and nsa at every point;
# see docs/perf-log.md.
RULE_MAX_G_FOR_FSA = 8

_memory: dict[str, str] = {}


def cache_path() -> Path | None:
    value = os.environ.get("FSALAB_DISPATCH_CACHE")
    if value is not None:
        return Path(value) if value else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fsalab" / "dispatch.json"


def _load() -> dict[str, str]:
    path = cache_path()
    if path is None or not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}  # a corrupt or unreadable cache only costs a re-profile


def _store(key: str, impl: str) -> None:
    path = cache_path()
    if path is None:
        return
    entries = _load()
    entries[key] = impl
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic replace: concurrent processes never see a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@functools.cache
def _gpu_name(index: int) -> str:
    # Queried once per device: the key is built on every call, on the launch path.
    return torch.cuda.get_device_name(index)


def shape_key(q: torch.Tensor, k: torch.Tensor, block_idx: torch.Tensor, block_size: int) -> str:
    total, h, d = q.shape
    h_kv, topk = k.shape[1], block_idx.shape[2]
    if q.device.type == "cuda":
        device = _gpu_name(q.device.index if q.device.index is not None else torch.cuda.current_device())
    else:
        device = q.device.type
    bucket = 1 << max(0, (max(total, 1) - 1).bit_length())
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k))
    return f"{device}|{str(q.dtype).removeprefix('torch.')}|g{h // h_kv}|hkv{h_kv}|d{d}|B{block_size}|T{topk}|N{bucket}|grad{int(grad)}"


def rule(g: int) -> str:
    return "fsa" if g <= RULE_MAX_G_FOR_FSA else "nsa"


def _time(fn, args, grad: bool) -> float:
    import triton.testing

    q, k, v = (t.detach().requires_grad_(grad) for t in args[:3])
    rest = args[3:]

    def step():
        o, _ = fn(q, k, v, *rest)
        if grad:
            o.backward(do)

    do = torch.randn(q.shape, device=q.device, dtype=q.dtype) if grad else None
    with torch.enable_grad() if grad else torch.no_grad():
        return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))


def choose(q, k, v, block_idx, cu_seqlens, block_size, scale=None) -> str:
    """The impl name to run for these inputs (profiling on first sight of the shape key)."""
    from . import resolve

    g = q.shape[1] // k.shape[1]
    if q.device.type != "cuda" or os.environ.get("FSALAB_DISPATCH", "profile") == "rules":
        return rule(g)
    key = shape_key(q, k, block_idx, block_size)
    if key not in _memory:
        _memory.update(_load())
    if key not in _memory:
        grad = key.endswith("grad1")
        timings = {}
        for impl in CANDIDATES:
            try:
                timings[impl] = _time(resolve(impl), (q, k, v, block_idx, cu_seqlens, block_size, scale), grad)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        _memory[key] = min(timings, key=timings.get) if timings else rule(g)
        _store(key, _memory[key])
    return _memory[key]


def selected_attention_auto(q, k, v, block_idx, cu_seqlens, block_size, scale=None):
    from . import resolve

    return resolve(choose(q, k, v, block_idx, cu_seqlens, block_size, scale))(q, k, v, block_idx, cu_seqlens, block_size, scale)
