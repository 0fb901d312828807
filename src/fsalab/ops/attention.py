"""Whole NSA attention as one op: compression, compressed attention, block selection, selected
and sliding-window attention and the gated sum (DESIGN §4), with RoPE.

Where every branch runs fsalab's kernels (``fused``), the call is one autograd node (and one
``torch.library`` op, ``fsalab::nsa_attention``, under torch.compile): its backward runs the
branches' backward kernels into one set of gradient buffers. The selected attention's backward
writes dq, dk and dv first; the window's and the compressed attention's kernels add theirs in
their stores, and the compression's dk/dv kernel adds the raw keys' and values' share last, so
no gradient is summed or zero-filled by a separate launch. Elsewhere (the fp32 references, the
flash-attn window, the peer kernels) the branches are composed by autograd from their own ops.

RoPE (``rotary``): cos and sin [total, d] per packed token in the rotate-half convention (HF's),
applied to q and k and to each compressed key at its window's first token; compression reads
the keys before it.
"""

from __future__ import annotations

import math

import torch

from ..checks import KERNEL_DTYPES, check_attention_inputs, check_tensor
from ..config import NSAConfig
from ..varlen import compressed_capacity, compressed_index, sequence_ids
from . import compression_ops, gate_op, scratch, selection_default, window_op
from ._triton import INTERPRET
from .compression.compress_kv import _backward as compress_backward
from .compression.compress_kv import _compressed_offsets as compressed_offsets
from .compression.compress_kv import _forward as compress_forward
from .compression.compress_kv import check_compression_inputs
from .flash import NO_WINDOW
from .flash import _backward as flash_backward
from .flash import _forward as flash_forward
from .gate import fused as gate_kernels
from .library import grads_like, lse_like, op_or
from .selected import selected_attention
from .selected.host import HOST_PAIRS
from .topk.block_select import _select as select_kernel
from .window.attention import flash_attn_usable


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention: x [n, heads, d], cos/sin [n, d] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rotate_back(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``rotate``'s input for its output's gradient dy (the transposed rotation)."""
    half = dy.shape[-1] // 2
    t = dy * sin[:, None, :]
    return dy * cos[:, None, :] + torch.cat([t[..., half:], -t[..., :half]], dim=-1)


def fused(compression_impl: str, selection_impl: str, window_impl: str, gate_impl: str, q: torch.Tensor) -> bool:
    """Whether these impls run as the one-node op on q's device: every branch on fsalab's kernels
    (compression "triton"/"auto", a selected impl with host functions, the window on fsalab's
    flash kernel, the fused gate), on CUDA or under the Triton interpreter."""
    # Off CUDA "auto" is the reference for these three (the selection's "auto" is its dispatcher).
    on_kernels = q.is_cuda or (INTERPRET and "auto" not in (compression_impl, window_impl, gate_impl))
    window = window_impl == "triton" or (window_impl == "auto" and not flash_attn_usable(q))
    return (on_kernels and compression_impl in ("triton", "auto") and selection_impl in HOST_PAIRS and window
            and gate_impl in ("triton", "auto") and q.dtype in (torch.float16, torch.bfloat16, torch.float32))


# ----------------------------------------------------------------------------------------------
# The one-node op: host functions of the forward and the backward
# ----------------------------------------------------------------------------------------------

# Positions in the forward's list of saved tensors (after them: q and k rotated where RoPE is
# given, then the selected attention's own).
_CU_CMP, _TAB, _K_CMP, _V_CMP, _O_CMP, _LSE_CMP, _BLOCK_IDX, _O_SLC, _LSE_SLC, _O_WIN, _LSE_WIN = range(11)
_N_FIXED = 11


def _forward(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, cfg_ints: list[int], selection: str,
             grad: bool):
    """(o [total, h, d], saved: list[Tensor]) on contiguous inputs; the arguments of the op."""
    cfg = NSAConfig.from_ints(cfg_ints)
    l, s = cfg.kernel_size, cfg.kernel_stride
    scale = 1.0 / math.sqrt(q.shape[-1])
    key = ("nsa_attention.forward", *scratch.shapes(q, k, w_k, cu_seqlens), cos is None, tuple(cfg_ints), selection,
           grad)
    with scratch.planned(key, q.device):  # one allocation for every branch's scratch
        cu_cmp = compressed_offsets(cu_seqlens, l, s)
        k_cmp, v_cmp, tab = compress_forward(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, l, s)
        rotated = []
        if cos is not None:
            # Padding rows (window start -1) hold zeros, which any rotation keeps; the clamp keeps
            # every gather in bounds whatever the table holds.
            start = tab[0].clamp(0, max(q.shape[0] - 1, 0))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k_cmp = rotate(k_cmp, cos[start], sin[start])
            rotated = [q, k]
        o_win, lse_win = flash_forward(q, k, v, cu_seqlens, cu_seqlens, 1, 0, min(cfg.window_size, NO_WINDOW), scale)
        o_cmp, lse_cmp = flash_forward(q, k_cmp, v_cmp, cu_seqlens, cu_cmp, s, l - 1, NO_WINDOW, scale)
        block_idx = select_kernel(q, k_cmp, lse_cmp, cu_seqlens, cu_cmp, cfg_ints, scale, "auto")
        o_slc, lse_slc, selected = HOST_PAIRS[selection].forward(q, k, v, block_idx, cu_seqlens, cfg.block_size, scale,
                                                                 grad)
        o = gate_kernels._forward(o_cmp, o_slc, o_win, gate_logits)
    return o, [cu_cmp, tab, k_cmp, v_cmp, o_cmp, lse_cmp, block_idx, o_slc, lse_slc, o_win, lse_win, *rotated, *selected]


def _backward(do, q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, saved, cfg_ints: list[int],
              selection: str, need_w: bool, need_pe: bool):
    """(dq, dk, dv, dw_k, dw_v, dpe, dgate) of ``_forward``; dw_k, dw_v (need_w) and dpe (need_pe)
    None where not needed. The arguments of the backward op."""
    cfg = NSAConfig.from_ints(cfg_ints)
    l, s = cfg.kernel_size, cfg.kernel_stride
    scale = 1.0 / math.sqrt(q.shape[-1])
    cu_cmp, tab, k_cmp, v_cmp = saved[_CU_CMP], saved[_TAB], saved[_K_CMP], saved[_V_CMP]
    q_att, k_att = (saved[_N_FIXED], saved[_N_FIXED + 1]) if cos is not None else (q, k)
    selected = saved[_N_FIXED + (2 if cos is not None else 0):]
    key = ("nsa_attention.backward", *scratch.shapes(q, k, w_k, cu_seqlens), cos is None, tuple(cfg_ints), selection,
           need_w, need_pe)
    with scratch.planned(key, q.device):  # one allocation for every branch's scratch
        do_cmp, do_slc, do_win, dgate = gate_kernels._backward(do.contiguous(), saved[_O_CMP], saved[_O_SLC],
                                                               saved[_O_WIN], gate_logits, branches_in_scratch=True)
        dq, dk, dv = HOST_PAIRS[selection].backward(do_slc, q_att, k_att, v, saved[_O_SLC], saved[_LSE_SLC],
                                                    saved[_BLOCK_IDX], cu_seqlens, selected, cfg.block_size, scale)
        flash_backward(do_win, None, q_att, k_att, v, saved[_O_WIN], saved[_LSE_WIN], cu_seqlens, cu_seqlens, 1, 0,
                       min(cfg.window_size, NO_WINDOW), scale, False, into=(dq, dk, dv))
        # Compressed rows past cu_cmp[-1] are padding that the compression's backward never reads:
        # their gradients need no zeros.
        _, dk_cmp, dv_cmp = flash_backward(do_cmp, None, q_att, k_cmp, v_cmp, saved[_O_CMP], saved[_LSE_CMP],
                                           cu_seqlens, cu_cmp, s, l - 1, NO_WINDOW, scale, False,
                                           into=(dq, None, None))
        if cos is not None:
            start = tab[0].clamp(0, max(q.shape[0] - 1, 0))
            dk_cmp = _rotate_back(dk_cmp, cos[start], sin[start])
            dq, dk = _rotate_back(dq, cos, sin), _rotate_back(dk, cos, sin)
        _, _, dw_k, dw_v, dpe = compress_backward(dk_cmp, dv_cmp, k, v, w_k, w_v, pe, tab, l, s, True, need_w, need_pe,
                                                  into=(dk, dv))
    return dq, dk, dv, dw_k, dw_v, dpe, dgate


class _NSAAttention(torch.autograd.Function):
    """(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, cfg_ints, selection, grad) -> o.
    Its ``setup`` and ``backward`` are also the autograd of the op ``fsalab::nsa_attention``,
    which torch.compile sees in its place and which returns the saved tensors as well."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _NSAAttention.setup(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1])
        return output[0], *output[1]  # the saved tensors as outputs: a prefill's cache reads some

    @staticmethod
    def setup(ctx, inputs, output):
        q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, cfg_ints, selection, _ = inputs
        ctx.save_for_backward(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, *output[1])
        ctx.args = (cfg_ints, selection)
        ctx.set_materialize_grads(False)  # the saved tensors' gradients would be zero fills

    @staticmethod
    def backward(ctx, do, *_):  # _: the saved tensors' gradients (None)
        q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, *saved = ctx.saved_tensors
        need = ctx.needs_input_grad
        do = torch.zeros_like(q) if do is None else do
        backward = op_or("nsa_attention_backward", _backward, do)
        grads = backward(do, q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, saved, *ctx.args,
                         need[3] or need[4], need[5])
        # The op gives empty tensors for the gradients not needed, _backward None.
        return (*(g if n and g is not None and g.numel() else None for g, n in zip(grads, need[:7])),
                None, None, None, None, None, None)


# torch.compile's view of the op (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::nsa_attention", mutates_args=())
def _nsa_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, pe: torch.Tensor,
    gate_logits: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
    cfg_ints: list[int], selection: str, grad: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(o, the tensors the backward reads)."""
    return _forward(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, cfg_ints, selection, grad)


@_nsa_attention_op.register_fake
def _(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, cfg_ints, selection, grad):
    cfg = NSAConfig.from_ints(cfg_ints)
    total, h, _ = q.shape
    rows = compressed_capacity(total, cfg.kernel_stride)
    block_idx = q.new_empty((total, k.shape[1], cfg.topk), dtype=torch.int32)
    fixed = [torch.empty_like(cu_seqlens), q.new_empty((3, rows), dtype=torch.int32), k.new_empty((rows, *k.shape[1:])),
             v.new_empty((rows, *v.shape[1:])), q.new_empty(q.shape), lse_like(q), block_idx, q.new_empty(q.shape),
             lse_like(q), q.new_empty(q.shape), lse_like(q)]
    rotated = [q.new_empty(q.shape), k.new_empty(k.shape)] if cos is not None else []
    selected = HOST_PAIRS[selection].fake_saved(q, block_idx, cu_seqlens, cfg.block_size, grad)
    return q.new_empty(q.shape), fixed + rotated + selected


@torch.library.custom_op("fsalab::nsa_attention_backward", mutates_args=())
def _nsa_attention_backward_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
    pe: torch.Tensor, gate_logits: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor | None,
    sin: torch.Tensor | None, saved: list[torch.Tensor], cfg_ints: list[int], selection: str, need_w: bool,
    need_pe: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dw_k, dw_v, dpe, dgate), an empty tensor for each one not needed."""
    grads = _backward(do, q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, saved, cfg_ints, selection,
                      need_w, need_pe)
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, (q, k, v, w_k, w_v, pe, gate_logits)))


@_nsa_attention_backward_op.register_fake
def _(do, q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cos, sin, saved, cfg_ints, selection, need_w, need_pe):
    dq, dk, dv, dgate = grads_like(q, k, v, gate_logits)
    dw_k, dw_v, dpe = (x.new_empty(x.shape if need else (0,)) for x, need in ((w_k, need_w), (w_v, need_w),
                                                                              (pe, need_pe)))
    return dq, dk, dv, dw_k, dw_v, dpe, dgate


_nsa_attention_op.register_autograd(_NSAAttention.backward, setup_context=_NSAAttention.setup)


# ----------------------------------------------------------------------------------------------
# The composed branches (any impls), and the entry point
# ----------------------------------------------------------------------------------------------


def _window_starts(cu_seqlens: torch.Tensor, cu_cmp: torch.Tensor, rows: int, total: int, stride: int) -> torch.Tensor:
    """int64 [rows]: the packed index of each compressed row's first raw token (clamped into the
    batch for padding rows)."""
    seq = sequence_ids(cu_cmp, rows).clamp(max=cu_seqlens.numel() - 2)
    return (cu_seqlens.long()[seq] + compressed_index(cu_cmp, rows) * stride).clamp(0, max(total - 1, 0))


def _composed(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cfg, rotary, impls, cache):
    """(o, block_idx): the branches as autograd composes them from each op (any impl)."""
    compression_impl, selection_impl, window_impl, gate_impl = impls
    cmp = compression_ops(compression_impl, q.device)
    k_cmp, v_cmp, cu_cmp = cmp.compress_kv(k, v, w_k, w_v, pe, cu_seqlens, cfg)
    k_cmp, v_cmp = k_cmp.to(q.dtype), v_cmp.to(q.dtype)
    k_raw = k
    if rotary is not None:
        cos, sin = rotary
        start = _window_starts(cu_seqlens, cu_cmp, k_cmp.shape[0], q.shape[0], cfg.kernel_stride)
        q, k, k_cmp = rotate(q, cos, sin), rotate(k, cos, sin), rotate(k_cmp, cos[start], sin[start])
    if cache is not None:
        cache.fill(k, k_raw, v, k_cmp, v_cmp, cu_seqlens)
    # The window branch needs only q, k, v: launched first, its kernel runs while the host
    # prepares the compression branch's launches (eager calls at g = 1 are host-bound up to ~32K).
    o_win, _ = window_op(window_impl, q.device)(q, k, v, cu_seqlens, cfg.window_size)
    o_cmp, lse_cmp = cmp.compressed_attention(q, k_cmp, v_cmp, cu_seqlens, cu_cmp, cfg)
    block_idx = cmp.select_blocks(q, k_cmp, lse_cmp, cu_seqlens, cu_cmp, cfg)
    # block_idx comes from select_blocks, whose output meets the index checks by construction.
    o_slc, _ = selected_attention(q, k, v, block_idx, cu_seqlens, cfg.block_size, impl=selection_impl,
                                  check_indices=False)
    o = gate_op(gate_impl, q.device)(o_cmp.to(q.dtype), o_slc.to(q.dtype), o_win.to(q.dtype), gate_logits)
    return o, block_idx


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    pe: torch.Tensor,
    gate_logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: NSAConfig,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    compression_impl: str = "auto",
    selection_impl: str | None = None,
    window_impl: str = "auto",
    gate_impl: str = "auto",
    cache=None,
    return_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """NSA attention of q [total, h, d] over k, v [total, h_kv, d] (projected, before RoPE),
    differentiable in q, k, v, the compression's weights and the gate logits; o [total, h, d] in
    q's dtype.

    w_k, w_v [h_kv, l*d, d], pe [h_kv, l, d]: the compression's weights (``compress_kv``);
    gate_logits [total, h, 3]: the gates' logits (compressed, selected, window); cu_seqlens int32
    [batch + 1]; rotary: (cos, sin) [total, d] in q's dtype (module doc), None for no RoPE. Impls
    by name as in ``NativeSparseAttention`` ("auto": the kernels on CUDA, the references
    elsewhere), but ``selection_impl`` as ``ops.selected.selected_attention`` takes it ("auto":
    the dispatcher, None: "auto" on CUDA and the reference elsewhere). ``cache``: an
    ``ops.decode.NSADecodeCache`` filled with this prefill's keys, values and compressed tokens.
    ``return_indices``: also return the selected blocks, int32 [total, h_kv, topk]
    (``select_blocks``).
    """
    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    check_tensor("gate_logits", gate_logits, 3, None, q.device)
    if gate_logits.shape != (*q.shape[:2], 3):
        raise ValueError(f"gate_logits must be {(*q.shape[:2], 3)}, got {tuple(gate_logits.shape)}")
    if rotary is not None:
        for name, t in zip(("cos", "sin"), rotary):
            check_tensor(name, t, 2, (q.dtype,), q.device)
            if t.shape != (q.shape[0], q.shape[2]):
                raise ValueError(f"rotary {name} must be [total, d] = {[q.shape[0], q.shape[2]]}, got {tuple(t.shape)}")
    selection_impl = selection_impl or selection_default(q.device)
    impls = (compression_impl, selection_impl, window_impl, gate_impl)
    if not fused(*impls, q):
        o, block_idx = _composed(q, k, v, w_k, w_v, pe, gate_logits, cu_seqlens, cfg, rotary, impls, cache)
        return (o, block_idx) if return_indices else o
    # The composed path's checks, once (its ops check their own inputs).
    check_attention_inputs(q, k, v, cu_seqlens, KERNEL_DTYPES)
    check_compression_inputs(k, v, w_k, w_v, pe, cu_seqlens, cfg)
    cos, sin = rotary if rotary is not None else (None, None)
    tensors = [t.contiguous() for t in (q, k, v, w_k, w_v, pe, gate_logits)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    out = op_or("nsa_attention", _NSAAttention.apply if grad else _forward)(*tensors, cu_seqlens, cos, sin,
                                                                             cfg.as_ints(), selection_impl, grad)
    # The op and _forward give (o, saved), the Function (o, *saved).
    o, saved = (out[0], list(out[1])) if len(out) == 2 and isinstance(out[1], (list, tuple)) else (out[0], out[1:])
    if cache is not None:
        k_rot = saved[_N_FIXED + 1] if rotary is not None else k
        cache.fill(k_rot, k, v, saved[_K_CMP], saved[_V_CMP], cu_seqlens)
    return (o, saved[_BLOCK_IDX]) if return_indices else o
