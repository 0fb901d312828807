"""``impl="auto"``: pick the fastest selected-attention kernels per shape and direction, once.

This is the "online profiling module" the FSA paper describes (Appendix E) and its authors
announced but did not release. On the first call with a new shape key — (GPU, dtype, g, h_kv, d,
block_size, topk, token-count bucket, whether gradients are needed) — every candidate's forward
is timed on the call's own inputs, and when gradients are needed every candidate's backward too;
the winners are cached in memory and on disk. Forward and backward are chosen independently:
both kernel families read and write the same (o, lse), so e.g. FSA's forward can feed NSA's
backward (``_Composed``). Later calls with the same key only look the winners up.

Settings:
- ``fsalab.settings.configure(dispatch="rules")`` (``--dispatch rules`` on the runners) skips
  profiling and applies the fixed rules below.
- ``FSALAB_DISPATCH_CACHE=/path/file.json`` (environment) relocates the disk cache (default:
  ``$XDG_CACHE_HOME/fsalab/dispatch.json``, i.e. ``~/.cache/fsalab/dispatch.json``);
  ``FSALAB_DISPATCH_CACHE=`` (empty) keeps the cache in memory only.

Profiling synchronises the device once per new key; the steady state adds no host sync.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from ... import settings
from ...checks import check_kernel_call
from .. import scratch
from ..library import grads_like, lse_like, op_or
from .index import SelectionIndex, build_selection_index, empty_index

CANDIDATES = ("fsa", "nsa")
_MODULES = {"fsa": "fsalab.ops.selected.fsa", "nsa": "fsalab.ops.selected.nsa"}
# Without profiling (CPU, or the setting dispatch="rules"), from the measured kernels
# (docs/performance.md, "Selected attention"): FSA's forward is fastest or tied at every g up to
# 16; FSA's backward wins up to g = 8; NSA's at g = 16, where a token's heads fill the MMA rows.
RULE_MAX_G_FOR_FSA_BWD = 8
# Bumped when the meaning of a cached value changes or a kernel change moves the winners, so
# stale entries are re-profiled.
_KEY_VERSION = "v4"

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


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether a call on these inputs records an autograd graph."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def shape_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_size: int,
              grad: bool | None = None) -> str:
    """The cache key of a call; ``grad``: whether it needs gradients (default: ``needs_grad(q, k, v)``)."""
    total, h, d = q.shape
    h_kv, topk = k.shape[1], block_idx.shape[2]
    if q.device.type == "cuda":
        device = _gpu_name(q.device.index if q.device.index is not None else torch.cuda.current_device())
    else:
        device = q.device.type
    bucket = 1 << max(0, (max(total, 1) - 1).bit_length())
    grad = needs_grad(q, k, v) if grad is None else grad
    return (f"{_KEY_VERSION}|{device}|{str(q.dtype).removeprefix('torch.')}|g{h // h_kv}|hkv{h_kv}|d{d}"
            f"|B{block_size}|T{topk}|N{bucket}|grad{int(grad)}")


def rule(g: int) -> tuple[str, str]:
    """(forward impl, backward impl) without profiling."""
    return "fsa", ("fsa" if g <= RULE_MAX_G_FOR_FSA_BWD else "nsa")


def _module(impl: str):
    return importlib.import_module(_MODULES[impl])


def _encode(choice: tuple[str, str], grad: bool) -> str:
    return f"{choice[0]}/{choice[1]}" if grad else choice[0]


def _decode(value: str) -> tuple[str, str]:
    """A cached value: "fwd" (no gradients) or "fwd/bwd"."""
    fwd, _, bwd = value.partition("/")
    return fwd, bwd or fwd


def _run_forward(fwd: str, with_index: bool, q, k, v, block_idx, cu_seqlens, block_size, scale):
    """(o, lse, index) of impl ``fwd``; the index lists are built when the forward or a later
    backward needs them (every impl's backward does, NSA's forward does not)."""
    # Without a backward to keep them for, fsa's lists are the call's scratch.
    index = (build_selection_index(block_idx, cu_seqlens, block_size, in_scratch=not with_index)
             if with_index or fwd != "nsa" else None)
    o, lse = _module(fwd).forward_pass(q, k, v, block_idx, cu_seqlens, block_size, scale, index)
    return o, lse, index


def _forward_chosen(q, k, v, block_idx, cu_seqlens, block_size, scale, with_grad):
    """(o, lse, ``SelectionIndex.tensors()``, [] without gradients) of the forward ``choose``
    picks; with gradients the index is built for the backward (the arguments of the op
    ``fsalab::selected_attention_auto``)."""
    fwd, _ = choose(q, k, v, block_idx, cu_seqlens, block_size, scale, grad=with_grad)
    with scratch.planned(("auto.forward", *scratch.shapes(q, k, block_idx, cu_seqlens), block_size, fwd, with_grad),
                         q.device):
        o, lse, index = _run_forward(fwd, with_grad, q, k, v, block_idx, cu_seqlens, block_size, scale)
    return o, lse, index.tensors() if with_grad else []


def _backward_chosen(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, index, block_size, scale):
    """(dq, dk, dv) of the backward ``choose`` picked with the forward (looked up again by shape
    key), on the forward's ``SelectionIndex.tensors()`` (the arguments of the op
    ``fsalab::selected_attention_auto_backward``)."""
    _, bwd = choose(q, k, v, block_idx, cu_seqlens, block_size, scale, grad=True)
    with scratch.planned(("auto.backward", *scratch.shapes(q, k, block_idx, cu_seqlens), block_size, bwd,
                          dlse is None), q.device):
        return _module(bwd).backward_pass(q, k, v, o, lse, do, dlse, block_idx, cu_seqlens, block_size, scale,
                                          SelectionIndex.from_tensors(index))


class _Composed(torch.autograd.Function):
    """Forward of one impl, backward of another (or the same): both use the same (o, lse).
    (q, k, v, block_idx, cu_seqlens, block_size, scale, with_grad) -> (o, lse). Its ``setup`` and
    ``backward`` are also the autograd of the op ``fsalab::selected_attention_auto`` below, which
    torch.compile sees in its place and which returns the index's tensors as well."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_chosen(*inputs)
        _Composed.setup(ctx, inputs, output)
        return output[:2]

    @staticmethod
    def setup(ctx, inputs, output):
        q, k, v, block_idx, cu_seqlens, block_size, scale, _ = inputs
        o, lse, index = output
        ctx.save_for_backward(q, k, v, o, lse, block_idx, cu_seqlens, *index)
        ctx.args = (block_size, scale)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse, *_):  # _: the op's index outputs' gradients (None)
        q, k, v, o, lse, block_idx, cu_seqlens, *index = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dlse = None if dlse is None else dlse.contiguous().float()
        backward = op_or("selected_attention_auto_backward", _backward_chosen, do)
        dq, dk, dv = backward(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, index, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


# torch.compile's view of the dispatcher (ops/library.py): opaque ops with fake kernels; the
# profiling and its cache run inside them, when the graph runs.
@torch.library.custom_op("fsalab::selected_attention_auto", mutates_args=())
def _selected_attention_auto_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor,
    block_size: int, scale: float, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(o, lse, the index's tensors, [] without gradients)."""
    return _forward_chosen(q, k, v, block_idx, cu_seqlens, block_size, scale, with_grad)


@_selected_attention_auto_op.register_fake
def _(q, k, v, block_idx, cu_seqlens, block_size, scale, with_grad):
    index = empty_index(block_idx, cu_seqlens, block_size).tensors() if with_grad else []
    return q.new_empty(q.shape), lse_like(q), index


@torch.library.custom_op("fsalab::selected_attention_auto_backward", mutates_args=())
def _selected_attention_auto_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor, index: list[torch.Tensor], block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_chosen(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, index, block_size, scale)


@_selected_attention_auto_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, index, block_size, scale):
    return grads_like(q, k, v)


_selected_attention_auto_op.register_autograd(_Composed.backward, setup_context=_Composed.setup)


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _profile(grad: bool, q, k, v, block_idx, cu_seqlens, block_size, scale) -> tuple[str, str] | None:
    """(fastest forward, fastest backward) on these inputs; None when every candidate ran out of
    memory. Backward candidates are timed on one forward's (o, lse), index lists built once."""
    args = (q, k, v, block_idx, cu_seqlens, block_size, scale)
    fwd_ms, bwd_ms = {}, {}
    with torch.no_grad():
        for impl in CANDIDATES:
            try:
                fwd_ms[impl] = _bench(lambda impl=impl: _run_forward(impl, grad, *args))
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        if not fwd_ms:
            return None
        fwd = min(fwd_ms, key=fwd_ms.get)
        if not grad:
            return fwd, fwd
        o, lse, index = _run_forward(fwd, True, *args)
        do = torch.randn_like(o)
        for impl in CANDIDATES:
            back = _module(impl).backward_pass
            try:
                bwd_ms[impl] = _bench(lambda back=back: back(q, k, v, o, lse, do, None, block_idx, cu_seqlens, block_size, scale, index))
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
    return (fwd, min(bwd_ms, key=bwd_ms.get)) if bwd_ms else None


def choose(q, k, v, block_idx, cu_seqlens, block_size, scale=None, grad: bool | None = None) -> tuple[str, str]:
    """(forward impl, backward impl) for these inputs, profiling on first sight of the shape key.
    Inputs contiguous; ``scale`` a float or None (1/sqrt(d)); ``grad`` as in ``shape_key`` (the
    ops pass it: their inputs never require gradients)."""
    g = q.shape[1] // k.shape[1]
    if q.device.type != "cuda" or settings.current.dispatch == "rules":
        return rule(g)
    key = shape_key(q, k, v, block_idx, block_size, grad)
    if key not in _memory:
        _memory.update(_load())
    if key not in _memory:
        grad = key.endswith("grad1")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        with scratch.suspended():
            choice = _profile(grad, q.detach(), k.detach(), v.detach(), block_idx, cu_seqlens, block_size,
                              scale) or rule(g)
        _memory[key] = _encode(choice, grad)
        _store(key, _memory[key])
    return _decode(_memory[key])


def selected_attention_auto(q, k, v, block_idx, cu_seqlens, block_size, scale=None):
    """Selected attention with the profiled (or rule-based) forward and backward kernels; same
    contract as ``selected.selected_attention`` (inputs validated there)."""
    check_kernel_call(q.device, block_size, "the selected-attention kernels")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k, v, block_idx, cu_seqlens = (t.contiguous() for t in (q, k, v, block_idx, cu_seqlens))
    grad = needs_grad(q, k, v)
    # Inference: no autograd node to build, and at short lengths the call is host-bound.
    o, lse = op_or("selected_attention_auto", _Composed.apply if grad else _forward_chosen)(
        q, k, v, block_idx, cu_seqlens, block_size, scale, grad)[:2]
    return o, lse
