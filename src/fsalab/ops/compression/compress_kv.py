"""Linear KV compression of NSA (DESIGN §4 step 1), forward and backward in Triton.

``compress_kv``: compressed token j of a sequence is a linear map of its raw window
[j*s, j*s + l): k_cmp[j] = flatten(k[window] + pe) @ w_k, v_cmp[j] = flatten(v[window]) @ w_v.

Why Triton rather than torch: the torch formulation (``reference.compress_kv``) gathers the window
tensor [rows, h_kv, l*d] (l/s = 2 copies of k and of v: 1 GiB in bf16 at 256K tokens, h_kv=4,
d=128) and its backward scatters window gradients back with index_add, which uses atomics on CUDA
(non-deterministic). The kernels below read each window straight from k/v (row r's window
starts at a gathered offset, so a tile of rows is a strided gather), fuse the ``pe`` add and the
padding-row mask, and keep the backward deterministic without atomics:
- dW (one program per (head, l*d tile, d tile)) reduces over all compressed rows in a loop;
- dk/dv (one program per (row tile, head, offset i < s)) writes token start_r + i as the sum of
  its <= l/s windows, in registers; the tail of each sequence's last window is handled by the
  same program (tokens no window covers get 0);
- dpe = w_k @ sum_r dk_cmp[r] (pe is added to every window), one small kernel.
The kernel experiment's ``compressed`` op times the whole compression branch (docs/performance.md,
"Compression branch").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    check_cu_seqlens,
    check_tensor,
)
from ...config import NSAConfig
from ...varlen import compressed_capacity
from .._triton import autotune as _autotune
from .._triton import cdiv as _cdiv
from .._triton import dot_precision as _dot_precision
from .._triton import interpreter_meta as _meta
from .._triton import next_pow2 as _next_pow2
from .._triton import search_steps as _search_steps
from .._triton import tile_config as _tile_config
from .._triton import unit_last_stride as _unit_last_stride
from ..library import op_or


@triton.jit
def _window_rows(r, cu_ptr, cuc_ptr, batch, steps, S: tl.constexpr):
    """For compressed rows r: (valid, local index j, first raw token of the window, last of its sequence).

    The sequence of row r is the largest b < batch with cu_cmp[b] <= r (binary lifting; empty
    sequences, whose offsets repeat, are skipped because the last equal offset wins).
    """
    seq = r * 0
    for it in range(steps):
        cand = seq + (1 << (steps - 1 - it))
        ok = cand < batch
        seq = tl.where(ok & (tl.load(cuc_ptr + cand, mask=ok, other=0) <= r), cand, seq)
    valid = r < tl.load(cuc_ptr + batch)
    c_start = tl.load(cuc_ptr + seq)
    j = r - c_start
    start = tl.load(cu_ptr + seq) + j * S
    last = valid & (r == tl.load(cuc_ptr + seq + 1) - 1)
    return valid, j, start, last


_CU_BLOCK = 256  # sequences per step of the offsets kernel's scan


@triton.jit
def _cu_cmp_kernel(cu_ptr, out_ptr, batch, L: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    """out [batch + 1]: exclusive prefix sum of each sequence's compressed tokens (one program)."""
    carry = batch * 0
    tl.store(out_ptr, carry)
    for start in range(0, batch, BLOCK):
        b = start + tl.arange(0, BLOCK)
        ok = b < batch
        n = tl.load(cu_ptr + b + 1, mask=ok, other=0) - tl.load(cu_ptr + b, mask=ok, other=0)
        n_cmp = tl.where(n >= L, (n - L) // S + 1, 0)
        tl.store(out_ptr + b + 1, carry + tl.cumsum(n_cmp, axis=0), mask=ok)
        carry += tl.sum(n_cmp, axis=0)


def compressed_offsets(cu_seqlens: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """``varlen.compressed_cu_seqlens`` in one launch instead of a dozen torch ops: int32 [batch + 1]."""
    return op_or("compressed_offsets", _compressed_offsets)(cu_seqlens, kernel_size, kernel_stride)


def _compressed_offsets(cu_seqlens: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    out = torch.empty_like(cu_seqlens)
    _cu_cmp_kernel[(1,)](cu_seqlens, out, cu_seqlens.numel() - 1, L=kernel_size, S=kernel_stride, BLOCK=_CU_BLOCK)
    return out


# ----------------------------------------------------------------------------------------------
# compress_kv kernels. A grid axis carries (head, k-or-v): one launch serves both k and v.
# The forward also writes a window table tab int32 [3, rows] = (first raw token or -1 for
# padding rows, local index j, is-last-of-sequence) that the backward kernels read.
# ----------------------------------------------------------------------------------------------

_FWD_CONFIGS = [_tile_config(4, 3, BLOCK_R=64, BLOCK_N=64, BLOCK_K=64), _tile_config(4, 3, BLOCK_R=64, BLOCK_N=128, BLOCK_K=64),
                _tile_config(8, 3, BLOCK_R=128, BLOCK_N=128, BLOCK_K=64), _tile_config(4, 4, BLOCK_R=32, BLOCK_N=128, BLOCK_K=128)]
_DX_CONFIGS = [_tile_config(4, 3, BLOCK_R=64, BLOCK_Y=128, BLOCK_K=64), _tile_config(8, 3, BLOCK_R=128, BLOCK_Y=128, BLOCK_K=64),
               _tile_config(4, 3, BLOCK_R=64, BLOCK_Y=64, BLOCK_K=64)]
_DW_CONFIGS = [_tile_config(4, 3, BLOCK_X=64, BLOCK_R=64, BLOCK_N=128), _tile_config(8, 3, BLOCK_X=128, BLOCK_R=64, BLOCK_N=128),
               _tile_config(4, 3, BLOCK_X=64, BLOCK_R=128, BLOCK_N=64)]


@_autotune(_FWD_CONFIGS, key=["HEAD_DIM", "L", "S", "size_bucket"])
@triton.jit
def _compress_fwd_kernel(
    k_ptr, v_ptr, wk_ptr, wv_ptr, pe_ptr, kc_ptr, vc_ptr, cu_ptr, cuc_ptr, tab_ptr,
    s_kt, s_kh, s_vt, s_vh, s_wh, s_wx, s_ph, s_ot, s_oh,
    rows, batch, steps, size_bucket,
    HEAD_DIM: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[r, h, n0:n0+BLOCK_N] = sum_{i < l} (x[start_r + i, h] (+ pe[h, i])) @ w[h, i*d:(i+1)*d, n0:]."""
    h = tl.program_id(1)
    is_v = tl.program_id(2) % 2
    nn = (tl.program_id(2) // 2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid, j, start, last = _window_rows(r, cu_ptr, cuc_ptr, batch, steps, S)
    if (h == 0) & (tl.program_id(2) == 0):
        in_buf = r < rows
        tl.store(tab_ptr + r, tl.where(valid, start, -1), mask=in_buf)
        tl.store(tab_ptr + rows + r, j, mask=in_buf)
        tl.store(tab_ptr + 2 * rows + r, last.to(tl.int32), mask=in_buf)
    # Pointers come from the branches; integer strides from tl.where (an int argument equal to 1
    # is specialised to a constant, which the two branches of an if could not both yield).
    s_xt = tl.where(is_v == 1, s_vt, s_kt)
    if is_v == 1:
        x_ptr = v_ptr + h * s_vh
        w_ptr = wv_ptr + h * s_wh
        o_ptr = vc_ptr
    else:
        x_ptr = k_ptr + h * s_kh
        w_ptr = wk_ptr + h * s_wh
        o_ptr = kc_ptr
    kk = tl.arange(0, BLOCK_K)
    n_ok = nn < HEAD_DIM
    x_rows = x_ptr + start.to(tl.int64) * s_xt
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    # One flat loop over the window's l*d inputs x = i*d + c (pipelines better than nested loops).
    for x0 in range(0, L * HEAD_DIM, BLOCK_K):
        xx = x0 + kk
        x_ok = xx < L * HEAD_DIM
        x = tl.load(x_rows[:, None] + ((xx // HEAD_DIM) * s_xt + xx % HEAD_DIM)[None, :], mask=valid[:, None] & x_ok[None, :], other=0.0)
        pe = tl.load(pe_ptr + h * s_ph + xx, mask=x_ok & (is_v == 0), other=0.0)
        # k + pe rounds once to the input dtype, as the same add in PyTorch would.
        x = tl.where(valid[:, None], x.to(tl.float32) + pe.to(tl.float32)[None, :], 0.0).to(k_ptr.dtype.element_ty)
        w = tl.load(w_ptr + xx[:, None] * s_wx + nn[None, :], mask=x_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PREC)
    out = o_ptr + r.to(tl.int64)[:, None] * s_ot + h * s_oh + nn[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=(r < rows)[:, None] & n_ok[None, :])


@_autotune(_DW_CONFIGS, key=["HEAD_DIM", "L", "S", "size_bucket"])
@triton.jit
def _compress_dw_kernel(
    k_ptr, v_ptr, pe_ptr, dkc_ptr, dvc_ptr, dwk_ptr, dwv_ptr, tab_ptr,
    s_kt, s_kh, s_vt, s_vh, s_ph, s_gt, s_gh, s_wh, s_wx,
    rows, size_bucket,
    HEAD_DIM: tl.constexpr, L: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_X: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dw[h, x, n] = sum_r (window_r[x] (+ pe[h, x])) * dout[r, h, n], x = i*d + c; rows reduced in order."""
    xx = tl.program_id(0) * BLOCK_X + tl.arange(0, BLOCK_X)
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(2) // 2
    is_v = tl.program_id(2) % 2
    s_xt = tl.where(is_v == 1, s_vt, s_kt)
    if is_v == 1:
        x_ptr = v_ptr + h * s_vh
        g_ptr = dvc_ptr + h * s_gh
        dw_ptr = dwv_ptr
    else:
        x_ptr = k_ptr + h * s_kh
        g_ptr = dkc_ptr + h * s_gh
        dw_ptr = dwk_ptr
    x_ok = xx < L * HEAD_DIM
    n_ok = nn < HEAD_DIM
    x_off = (xx // HEAD_DIM) * s_xt + xx % HEAD_DIM  # window position i, channel c
    pe = tl.load(pe_ptr + h * s_ph + xx, mask=x_ok & (is_v == 0), other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_X, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        start = tl.load(tab_ptr + r, mask=r < rows, other=-1)
        valid = start >= 0
        xt = tl.load(x_ptr + start.to(tl.int64)[None, :] * s_xt + x_off[:, None], mask=x_ok[:, None] & valid[None, :], other=0.0)
        xt = tl.where(valid[None, :], xt.to(tl.float32) + pe[:, None], 0.0).to(k_ptr.dtype.element_ty)
        g = tl.load(g_ptr + r.to(tl.int64)[:, None] * s_gt + nn[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xt, g, acc, input_precision=DOT_PREC)
    out = dw_ptr + h * s_wh + xx[:, None] * s_wx + nn[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=x_ok[:, None] & n_ok[None, :])


@_autotune(_DX_CONFIGS, key=["HEAD_DIM", "L", "S", "size_bucket"], restore_value=["dk_ptr", "dv_ptr"])
@triton.jit
def _compress_dx_kernel(
    dkc_ptr, dvc_ptr, wk_ptr, wv_ptr, dk_ptr, dv_ptr, tab_ptr,
    s_gt, s_gh, s_wh, s_wx, s_xt, s_xh,
    rows, size_bucket,
    HEAD_DIM: tl.constexpr, L: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Gradient of the raw tokens of each window's cells (s tokens), summed over their windows.

    Cell b of window r holds tokens start_r + b*s + i; with y = i*d + n (token in the cell,
    channel), dx[r, b, y] = sum_{a=b}^{l/s-1} dout[r - (a - b)] @ w[a*s*d + y]^T: one GEMM over
    (a, c) per tile of y. Cell 0 of every window is written by its own row; cells b >= 1 only by
    the last window of a sequence (the others are cell 0 of a later window): each token once.
    ACCUMULATE adds each token's gradient to what dk/dv hold (the attention branches' gradients
    of the same keys and values); tokens no window covers keep it.
    """
    MP: tl.constexpr = L // S
    h = tl.program_id(1) // 2
    is_v = tl.program_id(1) % 2
    yy = tl.program_id(2) * BLOCK_Y + tl.arange(0, BLOCK_Y)
    y_ok = yy < S * HEAD_DIM
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_buf = r < rows
    start = tl.load(tab_ptr + r, mask=in_buf, other=-1)
    valid = start >= 0
    j = tl.load(tab_ptr + rows + r, mask=in_buf, other=0)
    last = valid & (tl.load(tab_ptr + 2 * rows + r, mask=in_buf, other=0) != 0)
    if is_v == 1:
        g_ptr = dvc_ptr + h * s_gh
        w_ptr = wv_ptr + h * s_wh
        x_ptr = dv_ptr + h * s_xh
    else:
        g_ptr = dkc_ptr + h * s_gh
        w_ptr = wk_ptr + h * s_wh
        x_ptr = dk_ptr + h * s_xh
    kk = tl.arange(0, BLOCK_K)
    has_last = tl.max(last.to(tl.int32), axis=0) > 0
    for b in range(MP):
        if (b == 0) | has_last:
            acc = tl.zeros([BLOCK_R, BLOCK_Y], dtype=tl.float32)
            for k0 in range(0, (MP - b) * HEAD_DIM, BLOCK_K):
                kx = k0 + kk
                back = kx // HEAD_DIM  # a - b
                cc = kx % HEAD_DIM
                k_ok = kx < (MP - b) * HEAD_DIM
                src_ok = valid[:, None] & (j[:, None] >= back[None, :]) & k_ok[None, :]
                g = tl.load(g_ptr + (r[:, None] - back[None, :]).to(tl.int64) * s_gt + cc[None, :], mask=src_ok, other=0.0)
                w_row = (back + b) * (S * HEAD_DIM)
                wt = tl.load(w_ptr + (w_row[:, None] + yy[None, :]) * s_wx + cc[:, None], mask=k_ok[:, None] & y_ok[None, :], other=0.0)
                acc = tl.dot(g, wt.to(g.dtype), acc, input_precision=DOT_PREC)
            dst_ok = tl.where(b == 0, valid, last)
            tok = (start + b * S).to(tl.int64)[:, None] + (yy // HEAD_DIM)[None, :]
            out = x_ptr + tok * s_xt + (yy % HEAD_DIM)[None, :]
            if ACCUMULATE:
                acc += tl.load(out, mask=dst_ok[:, None] & y_ok[None, :], other=0.0).to(tl.float32)
            tl.store(out, acc.to(x_ptr.dtype.element_ty), mask=dst_ok[:, None] & y_ok[None, :])


@triton.jit
def _compress_dpe_kernel(
    dkc_ptr, wk_ptr, dpe_ptr, tab_ptr, rows, s_gt, s_gh, s_wh, s_wx, s_ph,
    HEAD_DIM: tl.constexpr, LX: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
):
    """dpe[h, x] = sum_n w_k[h, x, n] * sum_r dk_cmp[r, h, n] over the valid rows (pe is added to
    every window). One program per (head, tile of x); each sums the rows itself (rows x d, L2
    hits) so that no program waits on another and the sum order is fixed (no atomics). The rows
    accumulate elementwise into a [BLOCK_R, d] tile (<= 8192 fp32: sm_90 builds spill-free at
    d = 64-256, scripts/ptxas_report.py), reduced across rows once after the loop: a reduction
    per step put a cross-warp round trip into every iteration of the loop."""
    h = tl.program_id(0)
    nn = tl.arange(0, D_PAD)
    n_ok = nn < HEAD_DIM
    acc = tl.zeros([BLOCK_R, D_PAD], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        valid = tl.load(tab_ptr + r, mask=r < rows, other=-1) >= 0
        g = tl.load(dkc_ptr + r.to(tl.int64)[:, None] * s_gt + h * s_gh + nn[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0)
        acc += g.to(tl.float32)
    dsum = tl.sum(acc, axis=0)
    xx = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    x_ok = xx < LX
    w = tl.load(wk_ptr + h * s_wh + xx[:, None] * s_wx + nn[None, :], mask=x_ok[:, None] & n_ok[None, :], other=0.0)
    dpe = tl.sum(w.to(tl.float32) * dsum[None, :], axis=1)
    tl.store(dpe_ptr + h * s_ph + xx, dpe.to(dpe_ptr.dtype.element_ty), mask=x_ok)


def _tiles(d: int, kernel_size: int, kernel_stride: int, dtype: torch.dtype, rows: int) -> dict:
    return {"HEAD_DIM": d, "L": kernel_size, "S": kernel_stride, "DOT_PREC": _dot_precision(dtype),
            "size_bucket": rows.bit_length()}


def _forward(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, kernel_size: int, kernel_stride: int):
    """(k_cmp, v_cmp, tab): the compressed tokens [total // s, h_kv, d] and the window table
    int32 [3, rows] the backward reads; inputs with the layouts ``compress_kv`` makes."""
    total, h_kv, d = k.shape
    rows = compressed_capacity(total, kernel_stride)
    k_cmp = k.new_empty((rows, h_kv, d))
    v_cmp = v.new_empty((rows, h_kv, d))
    tab = torch.empty((3, rows), dtype=torch.int32, device=k.device)
    if rows:
        batch = cu_seqlens.numel() - 1
        grid = lambda meta: (_cdiv(rows, meta["BLOCK_R"]), h_kv, 2 * _cdiv(d, meta["BLOCK_N"]))
        _compress_fwd_kernel[grid](
            k, v, w_k, w_v, pe, k_cmp, v_cmp, cu_seqlens, cu_cmp, tab, *_strides(k, v), w_k.stride(0), w_k.stride(1),
            pe.stride(0), k_cmp.stride(0), k_cmp.stride(1), rows, batch, _search_steps(batch),
            **_tiles(d, kernel_size, kernel_stride, k.dtype, rows),
            **_meta(BLOCK_R=64, BLOCK_N=_next_pow2(max(d, 16)), BLOCK_K=512),
        )
    return k_cmp, v_cmp, tab


def _backward(dk_cmp, dv_cmp, k, v, w_k, w_v, pe, tab, kernel_size: int, kernel_stride: int, need_x: bool,
              need_w: bool, need_pe: bool, into=None):
    """(dk, dv, dw_k, dw_v, dpe) for the gradients of (k_cmp, v_cmp); None where not needed
    (dk, dv: need_x; dw_k, dw_v: need_w; dpe: need_pe). ``into``: contiguous (dk, dv) buffers
    holding other gradients of k and v, to which dk, dv are added in the kernel's stores."""
    _, h_kv, d = k.shape
    rows = dk_cmp.shape[0]
    dk_cmp, dv_cmp = dk_cmp.contiguous(), dv_cmp.contiguous()
    if into is not None:
        dk, dv = into
    else:
        # Tokens no window covers keep a zero gradient; the kernel writes every covered one once.
        dk = torch.zeros_like(k, memory_format=torch.contiguous_format) if need_x else None
        dv = torch.zeros_like(v, memory_format=torch.contiguous_format) if need_x else None
    new_dw = torch.empty_like if rows else torch.zeros_like  # the dw kernel writes every element
    dw_k = new_dw(w_k) if need_w else None
    dw_v = new_dw(w_v) if need_w else None
    tiles = _tiles(d, kernel_size, kernel_stride, k.dtype, rows)
    if need_x and rows:
        grid = lambda meta: (_cdiv(rows, meta["BLOCK_R"]), 2 * h_kv, _cdiv(kernel_stride * d, meta["BLOCK_Y"]))
        _compress_dx_kernel[grid](
            dk_cmp, dv_cmp, w_k, w_v, dk, dv, tab, dk_cmp.stride(0), dk_cmp.stride(1), w_k.stride(0), w_k.stride(1),
            dk.stride(0), dk.stride(1), rows, **tiles, ACCUMULATE=into is not None,
            **_meta(BLOCK_R=64, BLOCK_Y=1024, BLOCK_K=_next_pow2(max(d, 16))),
        )
    if need_w and rows:
        lx = kernel_size * d
        grid = lambda meta: (_cdiv(lx, meta["BLOCK_X"]), _cdiv(d, meta["BLOCK_N"]), 2 * h_kv)
        _compress_dw_kernel[grid](
            k, v, pe, dk_cmp, dv_cmp, dw_k, dw_v, tab, *_strides(k, v), pe.stride(0), dk_cmp.stride(0),
            dk_cmp.stride(1), dw_k.stride(0), dw_k.stride(1), rows, **tiles,
            **_meta(BLOCK_X=1024, BLOCK_R=64, BLOCK_N=_next_pow2(max(d, 16))),
        )
    dpe = None
    if need_pe and not rows:
        dpe = torch.zeros_like(pe)
    elif need_pe:
        dpe = torch.empty_like(pe, memory_format=torch.contiguous_format)
        lx, block_x, d_pad = kernel_size * d, 64, _next_pow2(max(d, 16))
        _compress_dpe_kernel[(h_kv, _cdiv(lx, block_x))](
            dk_cmp, w_k, dpe, tab, rows, dk_cmp.stride(0), dk_cmp.stride(1), w_k.stride(0), w_k.stride(1),
            dpe.stride(0), HEAD_DIM=d, LX=lx, D_PAD=d_pad, BLOCK_R=min(64, 8192 // d_pad), BLOCK_X=block_x,
        )
    return dk, dv, dw_k, dw_v, dpe


class _CompressKV(torch.autograd.Function):
    """(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, kernel_size, kernel_stride) -> (k_cmp, v_cmp).
    Its ``setup`` and ``backward`` are also the autograd of the op ``fsalab::compress_kv`` below,
    which torch.compile sees in its place and which returns the window table as well."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _CompressKV.setup(ctx, inputs, output)
        return output[:2]

    @staticmethod
    def setup(ctx, inputs, output):
        k, v, w_k, w_v, pe, _, _, kernel_size, kernel_stride = inputs
        ctx.save_for_backward(k, v, w_k, w_v, pe, output[2])
        ctx.sizes = (kernel_size, kernel_stride)
        ctx.set_materialize_grads(False)  # the window table would get a zero gradient (a fill)

    @staticmethod
    def backward(ctx, dk_cmp, dv_cmp, *_):  # _: the op's window table's gradient (None)
        k, v, w_k, w_v, pe, tab = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_x, need_w = need[0] or need[1], need[2] or need[3]
        # An unused output's gradient is zeros, as autograd would materialise it.
        dk_cmp, dv_cmp = (k.new_zeros((tab.shape[1], *k.shape[1:])) if g is None else g for g in (dk_cmp, dv_cmp))
        backward = op_or("compress_kv_backward", _backward, dk_cmp)
        grads = backward(dk_cmp, dv_cmp, k, v, w_k, w_v, pe, tab, *ctx.sizes, need_x, need_w, need[4])
        # The op gives empty tensors for the gradients not needed, _backward None.
        return (*(g if kept else None for g, kept in zip(grads, (need_x, need_x, need_w, need_w, need[4]))),
                None, None, None, None)


# torch.compile's view of the kernels (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::compressed_offsets", mutates_args=())
def _compressed_offsets_op(cu_seqlens: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    return _compressed_offsets(cu_seqlens, kernel_size, kernel_stride)


@_compressed_offsets_op.register_fake
def _(cu_seqlens, kernel_size, kernel_stride):
    return torch.empty_like(cu_seqlens)


@torch.library.custom_op("fsalab::compress_kv", mutates_args=())
def _compress_kv_op(k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, pe: torch.Tensor,
                    cu_seqlens: torch.Tensor, cu_cmp: torch.Tensor, kernel_size: int,
                    kernel_stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, kernel_size, kernel_stride)


@_compress_kv_op.register_fake
def _(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, kernel_size, kernel_stride):
    rows = compressed_capacity(k.shape[0], kernel_stride)
    return (k.new_empty((rows, *k.shape[1:])), v.new_empty((rows, *v.shape[1:])),
            k.new_empty((3, rows), dtype=torch.int32))


@torch.library.custom_op("fsalab::compress_kv_backward", mutates_args=())
def _compress_kv_backward_op(
    dk_cmp: torch.Tensor, dv_cmp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor,
    w_v: torch.Tensor, pe: torch.Tensor, tab: torch.Tensor, kernel_size: int, kernel_stride: int, need_x: bool,
    need_w: bool, need_pe: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dk, dv, dw_k, dw_v, dpe), an empty tensor for each one not needed (a schema has no None
    among outputs)."""
    grads = _backward(dk_cmp, dv_cmp, k, v, w_k, w_v, pe, tab, kernel_size, kernel_stride, need_x, need_w, need_pe)
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, (k, v, w_k, w_v, pe)))


@_compress_kv_backward_op.register_fake
def _(dk_cmp, dv_cmp, k, v, w_k, w_v, pe, tab, kernel_size, kernel_stride, need_x, need_w, need_pe):
    needed = (need_x, need_x, need_w, need_w, need_pe)
    return tuple(x.new_empty(x.shape if need else (0,)) for x, need in zip((k, v, w_k, w_v, pe), needed))


_compress_kv_op.register_autograd(_CompressKV.backward, setup_context=_CompressKV.setup)


def _strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    return k.stride(0), k.stride(1), v.stride(0), v.stride(1)


def check_compression_inputs(k, v, w_k, w_v, pe, cu_seqlens, cfg) -> None:
    """What ``compress_kv`` (and the whole attention op, ``ops/attention.py``) needs of its inputs."""
    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    check_tensor("k", k, 3, KERNEL_DTYPES)
    check_tensor("v", v, 3, (k.dtype,), k.device)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    total, h_kv, d = k.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim d = {d} exceeds {MAX_HEAD_DIM}")
    l = cfg.kernel_size
    for name, t, shape in (("w_k", w_k, (h_kv, l * d, d)), ("w_v", w_v, (h_kv, l * d, d)), ("pe", pe, (h_kv, l, d))):
        check_tensor(name, t, 3, KERNEL_DTYPES, k.device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape [h_kv, l*d, d] / [h_kv, l, d] = {list(shape)}, got {tuple(t.shape)}")
    if w_v.dtype != w_k.dtype:
        raise TypeError(f"w_k and w_v must share one dtype, got {w_k.dtype} and {w_v.dtype}")
    check_cu_seqlens(cu_seqlens, total, k.device)


def compress_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    pe: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: NSAConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear compression with intra-block position embedding on keys (NSA Eq. 7), differentiable.

    k, v [total, h_kv, d] (keys before RoPE) in fp16/bf16/fp32; w_k, w_v [h_kv, l*d, d] and
    pe [h_kv, l, d] in any of those dtypes (cast to k's dtype for the MMA, e.g. fp32 master
    weights with bf16 activations). Returns k_cmp, v_cmp [total // s, h_kv, d] in k's dtype
    (rows past cu_seqlens_cmp[-1] are zero) and cu_seqlens_cmp int32 [batch + 1]. Gradients for
    k, v (k's dtype), w_k, w_v, pe (their dtypes); fp32 accumulation everywhere, no atomics.
    """
    check_compression_inputs(k, v, w_k, w_v, pe, cu_seqlens, cfg)
    l = cfg.kernel_size
    cu_cmp = compressed_offsets(cu_seqlens, l, cfg.kernel_stride)
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    w_k, w_v, pe = w_k.contiguous(), w_v.contiguous(), pe.contiguous()
    k_cmp, v_cmp = op_or("compress_kv", _CompressKV.apply)(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, l,
                                                           cfg.kernel_stride)[:2]
    return k_cmp, v_cmp, cu_cmp
