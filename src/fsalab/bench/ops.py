"""The ops a kernel benchmark can time, each bound to an implementation and to its reference.

op              impl                                  what one call computes
selected        reference | nsa | fsa_paper | fsa |   selected attention on fixed block indices
                auto | fla_nsa (fsalab.ops.selected;
                fla_nsa: fla-core's kernels, a peer)
compressed      reference | triton                    compress_kv + compressed_attention +
                                                      select_blocks (the whole compression branch)
window          reference | any backend of            sliding-window attention
                fsalab.ops.window (auto, triton, flash_attn)
full_attention  reference | any impl of fsalab.ops.full   causal full attention (the baseline)
                (sdpa_flash, sdpa_cudnn, flash_attn, triton, sdpa_math)
nsa_attention   reference | a selected impl           all three branches + gates; compression
                                                      and window use fsalab's kernels

An implementation that does not exist yet (module not landed, impl not registered) raises
``Unsupported`` at bind time, so the runner writes an ``unsupported`` row instead of crashing.
The reference side is what the correctness check compares against: the fp32 PyTorch reference
beside each op's kernels (``fsalab.ops.<op>.reference``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..ops import CompressionOps
from ..ops.gate import reference as gate_reference
from ..ops.impls import COMPRESSION_IMPLS, GATE_IMPLS
from ..ops.selected import reference as selected_reference
from ..ops.window import reference as window_reference
from .inputs import Inputs, compressed_branch, compression_path
from .rows import Unsupported

OPS = ("selected", "compressed", "window", "full_attention", "nsa_attention")
# The compression branch is timed per named kernel set; "auto" would only pick one by device.
_COMPRESSED_IMPLS = tuple(i for i in COMPRESSION_IMPLS if i != "auto")
# Gradients flow to these inputs (compression weights only where the op compresses).
_GRAD_ARGS = {
    "selected": ("q", "k", "v"),
    "compressed": ("q", "k", "v", "w_k", "w_v", "pe"),
    "window": ("q", "k", "v"),
    "full_attention": ("q", "k", "v"),
    "nsa_attention": ("q", "k", "v", "w_k", "w_v", "pe", "gate"),
}


@dataclass
class BoundOp:
    """``fn(inputs) -> (o, aux)`` runs the op once; ``reference(inputs, aux) -> o`` is its fp32
    reference (aux carries data the reference must share, e.g. the kernel's block choice)."""

    op: str
    impl: str
    fn: Callable[[Inputs], tuple[torch.Tensor, object]]
    reference: Callable[[Inputs, object], torch.Tensor]
    need_indices: bool
    sources: dict = field(default_factory=dict)

    @property
    def grad_args(self) -> tuple[str, ...]:
        return _GRAD_ARGS[self.op]


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _import(module: str, attr: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise Unsupported(f"{module}.{attr} is not available: {exc}") from exc


def _selected_fn(impl: str, options: dict) -> Callable:
    """selected_attention(q, k, v, block_idx, cu_seqlens, block_size) -> (o, lse) for ``impl``."""
    from ..ops import selected

    try:
        fn = selected.resolve(impl)
    except ValueError as exc:
        raise Unsupported(str(exc)) from exc
    if impl == "fla_nsa" and not options:
        # The peer is timed as fla runs it, without the adapter's pass that zeroes rows selecting
        # nothing (fla leaves NaN there): the benchmark's indices always hold the token's own block
        # (local_blocks >= 1), and its correctness check fails on a NaN row.
        options = {"zero_empty_rows": False}
    if not options:
        return lambda q, k, v, idx, cu, bs: selected.selected_attention(q, k, v, idx, cu, bs, impl=impl)
    # Ablation switches (inner_loop=, early_return=) go to the implementation function itself.
    return lambda q, k, v, idx, cu, bs: fn(q, k, v, idx, cu, bs, None, **options)


def _ref_selected(x: Inputs, block_idx: torch.Tensor) -> torch.Tensor:
    t = x.tensors
    return selected_reference.selected_attention(t["q"], t["k"], t["v"], block_idx, x.cu_seqlens, x.cfg.block_size)[0]


def _ref_compressed(x: Inputs) -> tuple[torch.Tensor, ...]:
    return compressed_branch(compression_path("reference")[0], x.tensors, x.cu_seqlens, x.cfg)


def _ref_window(x: Inputs, window: int | None = None) -> torch.Tensor:
    t = x.tensors
    w = window if window is not None else x.cfg.window_size
    return window_reference.window_attention(t["q"], t["k"], t["v"], x.cu_seqlens, w)[0]


def _ref_nsa(x: Inputs, block_idx: torch.Tensor) -> torch.Tensor:
    o_cmp = _ref_compressed(x)[0]
    return gate_reference.gated_sum(o_cmp, _ref_selected(x, block_idx), _ref_window(x), x.tensors["gate"])


def _bind_selected(impl: str, options: dict) -> BoundOp:
    sel = _selected_fn(impl, options)

    def fn(x: Inputs):
        t = x.tensors
        return _first(sel(t["q"], t["k"], t["v"], x.block_idx, x.cu_seqlens, x.cfg.block_size)), None

    return BoundOp("selected", impl, fn, lambda x, aux: _ref_selected(x, x.block_idx), True, {"selected": impl})


def _compression_impl(impl: str):
    if impl not in _COMPRESSED_IMPLS:
        raise Unsupported(f"compressed impl must be one of {_COMPRESSED_IMPLS}, got {impl!r}")
    return compression_path(impl)


def _compress_and_select(mod, x: Inputs):
    o_cmp, lse_cmp, k_cmp, _, cu_cmp = compressed_branch(mod, x.tensors, x.cu_seqlens, x.cfg)
    block_idx = mod.select_blocks(x.tensors["q"], k_cmp, lse_cmp, x.cu_seqlens, cu_cmp, x.cfg)
    return o_cmp, block_idx.to(torch.int32)


def _bind_compressed(impl: str, options: dict) -> BoundOp:
    mod, source = _compression_impl(impl)
    return BoundOp(
        "compressed", impl, lambda x: _compress_and_select(mod, x), lambda x, aux: _ref_compressed(x)[0], False,
        {"compression": source},
    )


def _window_fn(impl: str) -> Callable:
    if impl == "reference":
        return lambda q, k, v, cu, w: window_reference.window_attention(q, k, v, cu, w)
    win = _import("fsalab.ops.window", "window_attention")
    return lambda q, k, v, cu, w: win(q, k, v, cu, w, backend=impl)


def _bind_window(impl: str, options: dict) -> BoundOp:
    win = _window_fn(impl)

    def fn(x: Inputs):
        t = x.tensors
        return _first(win(t["q"], t["k"], t["v"], x.cu_seqlens, x.cfg.window_size)), None

    return BoundOp("window", impl, fn, lambda x, aux: _ref_window(x), False, {"window": impl})


def _bind_full(impl: str, options: dict) -> BoundOp:
    if impl == "reference":

        def fn(x: Inputs):
            return _ref_window(x, window=x.total), None

    else:
        full = _import("fsalab.ops.full", "full_attention")

        def fn(x: Inputs):
            t = x.tensors
            return _first(full(t["q"], t["k"], t["v"], x.cu_seqlens, max_seqlen=x.max_seqlen, impl=impl)), None

    return BoundOp("full_attention", impl, fn, lambda x, aux: _ref_window(x, window=x.total), False, {"full": impl})


@dataclass
class NSAParts:
    """The branch functions whole NSA attention is made of, as ``nsa_attention`` binds them for
    one impl (the versus runner times them one by one on the same inputs).

    compression: ``ops.CompressionOps`` (compress_kv, compressed_attention, select_blocks); selected/window:
    ``(q, k, v, block_idx, cu, block_size)`` / ``(q, k, v, cu, window)`` -> o [total, h, d];
    gated_sum: ``(o_cmp, o_slc, o_win, gate_logits)`` -> o. ``sources`` names each choice.
    """

    compression: CompressionOps
    selected: Callable
    window: Callable
    gated_sum: Callable
    sources: dict


def nsa_parts(impl: str, options: dict | None = None) -> NSAParts:
    """The branches of ``nsa_attention`` for ``impl``; ``Unsupported`` when one cannot run here.

    ``options`` may hold gate_impl, a name of ``ops.impls.GATE_IMPLS`` as in the module:
    "triton" (ops.gate's fused kernel), "reference" (torch's ops) or "auto" (the default: the
    reference for the reference impl, the kernel for the others); the rest goes to the
    selected-attention impl.
    """
    options = dict(options or {})
    gate = options.pop("gate_impl", "auto")
    if gate not in GATE_IMPLS:
        raise Unsupported(f"nsa_attention's gate_impl must be one of {GATE_IMPLS}, got {gate!r}")
    if gate == "auto":
        gate = "reference" if impl == "reference" else "triton"
    gated_sum = _import("fsalab.ops.gate", "gated_sum") if gate == "triton" else gate_reference.gated_sum
    if impl == "reference":
        mod, win, sel = compression_path("reference")[0], _window_fn("reference"), _selected_fn("reference", {})
    else:
        mod, _ = _compression_impl("triton")
        win, sel = _window_fn("auto"), _selected_fn(impl, options)
    sources = {"selected": impl, "compression": "reference" if impl == "reference" else "triton",
               "window": "reference" if impl == "reference" else "auto",
               "gate": gate}
    return NSAParts(mod, lambda *a: _first(sel(*a)), lambda *a: _first(win(*a)), gated_sum, sources)


def _bind_nsa(impl: str, options: dict) -> BoundOp:
    """The whole attention as users call it (``ops.attention.nsa_attention``, no RoPE): one
    autograd node where every branch runs fsalab's kernels."""
    parts = nsa_parts(impl, options)
    if set(options) - {"gate_impl"}:
        raise Unsupported(f"nsa_attention takes only gate_impl as an option, got {sorted(options)}")
    nsa_attention = _import("fsalab.ops.attention", "nsa_attention")
    src = parts.sources

    def fn(x: Inputs):
        t = x.tensors
        # The window's "auto" backend: flash-attn where usable, else fsalab's kernel (the
        # module's "auto" would take the reference off CUDA).
        window = src["window"] if x.device.type == "cuda" else ("reference" if impl == "reference" else "triton")
        return nsa_attention(t["q"], t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], t["gate"], x.cu_seqlens, x.cfg,
                             None, src["compression"], impl, window, src["gate"], return_indices=True)

    # need_indices: the op selects its own blocks; the input-time selection only counts the
    # attended keys of its useful FLOPs (same compression path, same inputs).
    return BoundOp("nsa_attention", impl, fn, _ref_nsa, True, src)


_BINDERS = {
    "selected": _bind_selected,
    "compressed": _bind_compressed,
    "window": _bind_window,
    "full_attention": _bind_full,
    "nsa_attention": _bind_nsa,
}


def bind(op: str, impl: str, options: dict | None = None) -> BoundOp:
    """The callable pair for (op, impl); ``Unsupported`` when it cannot run here."""
    if op not in _BINDERS:
        raise Unsupported(f"op must be one of {OPS}, got {op!r}")
    return _BINDERS[op](impl, dict(options or {}))


def known_impls(op: str) -> tuple[str, ...]:
    """Every impl name ``bind`` knows for ``op``, available here or not (grids are checked
    against it: a misspelt impl is a config error, an impl missing on this machine a row)."""
    from ..ops import WINDOW_IMPLS, full, selected

    names = {
        "selected": tuple(selected.IMPLS),
        "compressed": _COMPRESSED_IMPLS,
        "window": WINDOW_IMPLS,
        "full_attention": ("reference", *full.IMPLS),
        "nsa_attention": tuple(selected.IMPLS),
    }
    if op not in names:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return names[op]


def direction_callable(bound: BoundOp, inputs: Inputs, direction: str, seed: int) -> Callable[[], object]:
    """A zero-argument callable that launches the work of ``direction`` (fwd, bwd, fwd+bwd) of
    the bound op: fwd under no_grad; bwd the gradients of one recorded forward (upstream
    gradient seeded by ``seed``); fwd+bwd a fresh forward and its gradients on every call."""
    if direction == "fwd":

        def fwd():
            with torch.no_grad():
                return bound.fn(inputs)[0]

        return fwd
    x = inputs.with_leaves(bound.grad_args)
    leaves = [x.tensors[n] for n in bound.grad_args]
    o = bound.fn(x)[0]
    gen = torch.Generator(device=o.device).manual_seed(seed + 2)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32).to(o.dtype)
    if direction == "bwd":
        graph_out = o
        return lambda: torch.autograd.grad(graph_out, leaves, do, retain_graph=True, allow_unused=True)
    del o  # fwd+bwd rebuilds the graph on every call; don't hold this one during timing
    return lambda: torch.autograd.grad(bound.fn(x)[0], leaves, do, allow_unused=True)
