"""NSA's gated sum of the three branch outputs (DESIGN §4, the last step) as one kernel per direction.

o = σ(g_cmp)·o_cmp + σ(g_slc)·o_slc + σ(g_win)·o_win, gate logits [total, h, 3]; the fp32
reference is ``reference.gated_sum``.

Why a kernel: in torch the forward is six elementwise ops (a sigmoid, three products, two sums)
and the backward fifteen (counted by scripts/count_launches.py), most of them a pass over
[total, h, d]. Short calls are bound by their launches, so every launch shows; at long ones the
forward's ops make 12 passes over the branch outputs where one kernel makes 4 (read three,
write one), and one backward kernel makes 7 (read do and the three outputs, write their three
gradients): docs/performance.md, "Gate". The logits' sigmoid and every product are computed in
fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import check_tensor
from .. import scratch
from .._triton import cdiv, next_pow2
from ..library import grads_like, op_or

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# Rows of [total * h, d] per program: ~4K elements per tensor, whatever d is.
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rows(pid, n_rows, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's rows of [n_rows, D]: the first row (int64: n_rows * D can pass 2^31), the
    rows' int32 offsets from it, and the masks; per-element offsets stay 32-bit."""
    first = pid.to(tl.int64) * BLOCK_R
    i = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, D_PAD)
    r_ok = first + i < n_rows
    return first, i, r_ok, i[:, None] * D + dd[None, :], r_ok[:, None] & (dd < D)[None, :]


@triton.jit
def _gated_sum_fwd(o1_ptr, o2_ptr, o3_ptr, g_ptr, out_ptr, n_rows,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    first, i, r_ok, off, ok = _rows(tl.program_id(0), n_rows, D, D_PAD, BLOCK_R)
    g_ptr += first * 3 + i * 3
    base = first * D
    s1 = tl.sigmoid(tl.load(g_ptr, mask=r_ok, other=0.0).to(tl.float32))
    s2 = tl.sigmoid(tl.load(g_ptr + 1, mask=r_ok, other=0.0).to(tl.float32))
    s3 = tl.sigmoid(tl.load(g_ptr + 2, mask=r_ok, other=0.0).to(tl.float32))
    o = s1[:, None] * tl.load(o1_ptr + base + off, mask=ok, other=0.0).to(tl.float32)
    o += s2[:, None] * tl.load(o2_ptr + base + off, mask=ok, other=0.0).to(tl.float32)
    o += s3[:, None] * tl.load(o3_ptr + base + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + off, o.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _branch_bwd(do, o_ptr, g_ptr, d_ptr, dg_ptr, r_ok, off, ok, k: tl.constexpr):
    """Branch k's gradients: d o_k = σ_k · do, d g_k = σ_k (1 - σ_k) · <do, o_k> over d.
    o_ptr, d_ptr: this program's first row; g_ptr, dg_ptr: each row's three logits."""
    s = tl.sigmoid(tl.load(g_ptr + k, mask=r_ok, other=0.0).to(tl.float32))
    o = tl.load(o_ptr + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(d_ptr + off, (s[:, None] * do).to(d_ptr.dtype.element_ty), mask=ok)
    dg = s * (1.0 - s) * tl.sum(do * o, axis=1)
    tl.store(dg_ptr + k, dg.to(dg_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _gated_sum_bwd(do_ptr, o1_ptr, o2_ptr, o3_ptr, g_ptr, d1_ptr, d2_ptr, d3_ptr, dg_ptr, n_rows,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    first, i, r_ok, off, ok = _rows(tl.program_id(0), n_rows, D, D_PAD, BLOCK_R)
    base = first * D
    rows3 = first * 3 + i * 3
    do = tl.load(do_ptr + base + off, mask=ok, other=0.0).to(tl.float32)
    _branch_bwd(do, o1_ptr + base, g_ptr + rows3, d1_ptr + base, dg_ptr + rows3, r_ok, off, ok, 0)
    _branch_bwd(do, o2_ptr + base, g_ptr + rows3, d2_ptr + base, dg_ptr + rows3, r_ok, off, ok, 1)
    _branch_bwd(do, o3_ptr + base, g_ptr + rows3, d3_ptr + base, dg_ptr + rows3, r_ok, off, ok, 2)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(kernel, n_rows: int, d: int, *args) -> None:
    d_pad = max(16, next_pow2(d))
    block_r = max(1, _ELEMENTS_PER_PROGRAM // d_pad)
    kernel[(cdiv(n_rows, block_r),)](*args, n_rows, D=d, D_PAD=d_pad, BLOCK_R=block_r, num_warps=4)


def _forward(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """The gated sum [total, h, d] of contiguous inputs, one launch."""
    total, h, d = o_cmp.shape
    out = _empty(o_cmp.shape, o_cmp.dtype, o_cmp.device)
    if out.numel():
        _launch(_gated_sum_fwd, total * h, d, o_cmp, o_slc, o_win, gate_logits, out)
    return out


def _backward(do, o_cmp, o_slc, o_win, gate_logits, branches_in_scratch: bool = False) -> tuple[torch.Tensor, ...]:
    """Gradients of (o_cmp, o_slc, o_win, gate_logits) for the output gradient do, one launch.
    ``branches_in_scratch``: the three branches' gradients are the caller's scratch (``ops.scratch``:
    the whole attention's backward, which consumes them)."""
    total, h, d = o_cmp.shape
    branch = scratch.empty if branches_in_scratch else _empty
    grads = (*(branch(t.shape, t.dtype, t.device) for t in (o_cmp, o_slc, o_win)),
             _empty(gate_logits.shape, gate_logits.dtype, gate_logits.device))
    if do.numel():
        _launch(_gated_sum_bwd, total * h, d, do.contiguous(), o_cmp, o_slc, o_win, gate_logits, *grads)
    return grads


class _GatedSum(torch.autograd.Function):
    """(o_cmp, o_slc, o_win, gate_logits) -> o. Its ``setup`` and ``backward`` are also the
    autograd of the op ``fsalab::gated_sum`` below, which torch.compile sees in its place."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _GatedSum.setup(ctx, inputs, output)
        return output

    @staticmethod
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, do):
        return op_or("gated_sum_backward", _backward, do)(do, *ctx.saved_tensors)


# torch.compile's view of the kernels (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::gated_sum", mutates_args=())
def _gated_sum_op(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
                  gate_logits: torch.Tensor) -> torch.Tensor:
    return _forward(o_cmp, o_slc, o_win, gate_logits)


@_gated_sum_op.register_fake
def _(o_cmp, o_slc, o_win, gate_logits):
    return o_cmp.new_empty(o_cmp.shape)


@torch.library.custom_op("fsalab::gated_sum_backward", mutates_args=())
def _gated_sum_backward_op(
    do: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gate_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, o_cmp, o_slc, o_win, gate_logits)


@_gated_sum_backward_op.register_fake
def _(do, o_cmp, o_slc, o_win, gate_logits):
    return grads_like(o_cmp, o_slc, o_win, gate_logits)


_gated_sum_op.register_autograd(_GatedSum.backward, setup_context=_GatedSum.setup)


def gated_sum(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """σ(g_cmp)·o_cmp + σ(g_slc)·o_slc + σ(g_win)·o_win, differentiable in all four inputs.

    o_cmp, o_slc, o_win [total, h, d], one dtype (fp16, bf16 or fp32); gate_logits [total, h, 3]
    in any of those dtypes. Returns [total, h, d] in the outputs' dtype. Non-contiguous inputs
    are copied once.
    """
    outs = (o_cmp, o_slc, o_win)
    for name, t in zip(("o_cmp", "o_slc", "o_win"), outs):
        check_tensor(name, t, 3, _FLOATS, o_cmp.device)
        if t.shape != o_cmp.shape or t.dtype != o_cmp.dtype:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}; o_cmp is {tuple(o_cmp.shape)} {o_cmp.dtype}")
    check_tensor("gate_logits", gate_logits, 3, _FLOATS, o_cmp.device)
    if gate_logits.shape != (*o_cmp.shape[:2], 3):
        raise ValueError(f"gate_logits must be {(*o_cmp.shape[:2], 3)}, got {tuple(gate_logits.shape)}")
    return op_or("gated_sum", _GatedSum.apply)(*(t.contiguous() for t in (*outs, gate_logits)))
