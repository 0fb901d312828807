"""Compression branch of NSA (DESIGN §4 steps 1–3): linear KV compression and block selection.

``compress_kv`` — compressed token j of a sequence is a linear map of its raw window
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
- dpe = w_k @ sum_r dk_cmp[r] (pe is added to every window), one small einsum.
``scripts/gpu/check_compression.py`` times it against the torch formulation.

``select_blocks`` — top-T selection blocks per token and KV head (NSA Eq. 8–12). One program per
(tile of one sequence's tokens, KV head): the tile's (token, head) rows are the MMA's M dimension
(a power-of-two part of the g heads, and for g = 3, 5, 6, 9, ... a second product for the rest,
so no row is padding where splitting saves rows), the loop walks the visible compressed tokens
in chunks of BB blocks, computes p = exp(q·k_cmp·scale - lse_cmp), sums the g heads in fp32,
maps the chunk to block scores with the fixed overlap stencil (own block: weights
min(l/s, B/s - i); the last l/s - 1 tokens of a block also spill into the next block) and merges
the chunk into a running top-T held in registers. Candidates are int64 keys (score bits << 32 |
~block), unique, so "larger key" is "larger score, then lower block" (the reference's stable tie
rule); the merge is branch-free (``_merge_topk``). Nothing of size N x N/s or N x N/B is ever
stored: memory is the [total, h_kv, T] output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..checks import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_cu_seqlens,
    check_tensor,
)
from ..config import NSAConfig
from ..varlen import compressed_capacity
from ._triton import LOG2E as _LOG2E
from ._triton import LOG2E_C
from ._triton import autotune as _autotune
from ._triton import dot_precision as _dot_precision
from ._triton import interpreter_meta as _meta
from ._triton import next_pow2 as _next_pow2
from ._triton import search_steps as _search_steps


def _cfg(warps: int, stages: int, **tiles) -> triton.Config:
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


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
    out = torch.empty_like(cu_seqlens)
    _cu_cmp_kernel[(1,)](cu_seqlens, out, cu_seqlens.numel() - 1, L=kernel_size, S=kernel_stride, BLOCK=_CU_BLOCK)
    return out


# ----------------------------------------------------------------------------------------------
# compress_kv kernels. A grid axis carries (head, k-or-v): one launch serves both k and v.
# The forward also writes a window table tab int32 [3, rows] = (first raw token or -1 for
# padding rows, local index j, is-last-of-sequence) that the backward kernels read.
# ----------------------------------------------------------------------------------------------

_FWD_CONFIGS = [_cfg(4, 3, BLOCK_R=64, BLOCK_N=64, BLOCK_K=64), _cfg(4, 3, BLOCK_R=64, BLOCK_N=128, BLOCK_K=64),
                _cfg(8, 3, BLOCK_R=128, BLOCK_N=128, BLOCK_K=64), _cfg(4, 4, BLOCK_R=32, BLOCK_N=128, BLOCK_K=128)]
_DX_CONFIGS = [_cfg(4, 3, BLOCK_R=64, BLOCK_Y=128, BLOCK_K=64), _cfg(8, 3, BLOCK_R=128, BLOCK_Y=128, BLOCK_K=64),
               _cfg(4, 3, BLOCK_R=64, BLOCK_Y=64, BLOCK_K=64)]
_DW_CONFIGS = [_cfg(4, 3, BLOCK_X=64, BLOCK_R=64, BLOCK_N=128), _cfg(8, 3, BLOCK_X=128, BLOCK_R=64, BLOCK_N=128),
               _cfg(4, 3, BLOCK_X=64, BLOCK_R=128, BLOCK_N=64)]


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


@_autotune(_DX_CONFIGS, key=["HEAD_DIM", "L", "S", "size_bucket"])
@triton.jit
def _compress_dx_kernel(
    dkc_ptr, dvc_ptr, wk_ptr, wv_ptr, dk_ptr, dv_ptr, tab_ptr,
    s_gt, s_gh, s_wh, s_wx, s_xt, s_xh,
    rows, size_bucket,
    HEAD_DIM: tl.constexpr, L: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Y: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Gradient of the raw tokens of each window's cells (s tokens), summed over their windows.

    Cell b of window r holds tokens start_r + b*s + i; with y = i*d + n (token in the cell,
    channel), dx[r, b, y] = sum_{a=b}^{l/s-1} dout[r - (a - b)] @ w[a*s*d + y]^T: one GEMM over
    (a, c) per tile of y. Cell 0 of every window is written by its own row; cells b >= 1 only by
    the last window of a sequence (the others are cell 0 of a later window): each token once.
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
            tl.store(out, acc.to(x_ptr.dtype.element_ty), mask=dst_ok[:, None] & y_ok[None, :])


def _tiles(d: int, cfg: NSAConfig, dtype: torch.dtype, rows: int) -> dict:
    return {"HEAD_DIM": d, "L": cfg.kernel_size, "S": cfg.kernel_stride, "DOT_PREC": _dot_precision(dtype),
            "size_bucket": rows.bit_length()}


class _CompressKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, cfg):
        total, h_kv, d = k.shape
        rows = compressed_capacity(total, cfg.kernel_stride)
        k_cmp = k.new_empty((rows, h_kv, d))
        v_cmp = v.new_empty((rows, h_kv, d))
        tab = torch.empty((3, rows), dtype=torch.int32, device=k.device)
        if rows:
            batch = cu_seqlens.numel() - 1
            grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), h_kv, 2 * triton.cdiv(d, meta["BLOCK_N"]))
            _compress_fwd_kernel[grid](
                k, v, w_k, w_v, pe, k_cmp, v_cmp, cu_seqlens, cu_cmp, tab, *_strides(k, v), w_k.stride(0), w_k.stride(1),
                pe.stride(0), k_cmp.stride(0), k_cmp.stride(1), rows, batch, _search_steps(batch),
                **_tiles(d, cfg, k.dtype, rows), **_meta(BLOCK_R=64, BLOCK_N=_next_pow2(max(d, 16)), BLOCK_K=512),
            )
        ctx.save_for_backward(k, v, w_k, w_v, pe, cu_cmp, tab)
        ctx.cfg = cfg
        return k_cmp, v_cmp

    @staticmethod
    def backward(ctx, dk_cmp, dv_cmp):
        k, v, w_k, w_v, pe, cu_cmp, tab = ctx.saved_tensors
        cfg = ctx.cfg
        _, h_kv, d = k.shape
        rows = dk_cmp.shape[0]
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dk_cmp, dv_cmp = dk_cmp.contiguous(), dv_cmp.contiguous()
        # Tokens no window covers keep a zero gradient; the kernel writes every covered one once.
        dk = torch.zeros_like(k, memory_format=torch.contiguous_format) if need_x else None
        dv = torch.zeros_like(v, memory_format=torch.contiguous_format) if need_x else None
        new_dw = torch.empty_like if rows else torch.zeros_like  # the dw kernel writes every element
        dw_k = new_dw(w_k) if need_w else None
        dw_v = new_dw(w_v) if need_w else None
        tiles = _tiles(d, cfg, k.dtype, rows)
        if need_x and rows:
            grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), 2 * h_kv, triton.cdiv(cfg.kernel_stride * d, meta["BLOCK_Y"]))
            _compress_dx_kernel[grid](
                dk_cmp, dv_cmp, w_k, w_v, dk, dv, tab, dk_cmp.stride(0), dk_cmp.stride(1), w_k.stride(0), w_k.stride(1),
                dk.stride(0), dk.stride(1), rows, **tiles, **_meta(BLOCK_R=64, BLOCK_Y=1024, BLOCK_K=_next_pow2(max(d, 16))),
            )
        if need_w and rows:
            lx = cfg.kernel_size * d
            grid = lambda meta: (triton.cdiv(lx, meta["BLOCK_X"]), triton.cdiv(d, meta["BLOCK_N"]), 2 * h_kv)
            _compress_dw_kernel[grid](
                k, v, pe, dk_cmp, dv_cmp, dw_k, dw_v, tab, *_strides(k, v), pe.stride(0), dk_cmp.stride(0),
                dk_cmp.stride(1), dw_k.stride(0), dw_k.stride(1), rows, **tiles,
                **_meta(BLOCK_X=1024, BLOCK_R=64, BLOCK_N=_next_pow2(max(d, 16))),
            )
        dpe = None
        if ctx.needs_input_grad[4]:
            # pe is added to every valid window: dpe[h] = w_k[h] @ sum_r dk_cmp[r, h].
            valid = torch.arange(rows, device=k.device) < cu_cmp[-1]
            dsum = (dk_cmp.float() * valid[:, None, None]).sum(0)
            dpe = torch.einsum("hxn,hn->hx", w_k.float(), dsum).view_as(pe).to(pe.dtype)
        return dk, dv, dw_k, dw_v, dpe, None, None, None


def _strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    return k.stride(0), k.stride(1), v.stride(0), v.stride(1)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    cu_cmp = compressed_offsets(cu_seqlens, l, cfg.kernel_stride)
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    w_k, w_v, pe = w_k.contiguous(), w_v.contiguous(), pe.contiguous()
    k_cmp, v_cmp = _CompressKV.apply(k, v, w_k, w_v, pe, cu_seqlens, cu_cmp, cfg)
    return k_cmp, v_cmp, cu_cmp


# ----------------------------------------------------------------------------------------------
# select_blocks kernel
# ----------------------------------------------------------------------------------------------

_SELECT_CONFIGS = [_cfg(4, 2, BLOCK_M=64), _cfg(8, 2, BLOCK_M=128)]
_KEY_NONE = tl.constexpr(-(2**62))  # below every candidate and every empty slot: never kept


@triton.jit
def _merge_topk(run, cand, ROWS: tl.constexpr, T_P: tl.constexpr, BB: tl.constexpr):
    """The T_P largest of run [ROWS, T_P] (ascending) and candidate keys [ROWS, BB], ascending.

    Branch-free, so a tile costs the same whatever its scores: the candidates sorted descending
    and cut to their top T_P meet the ascending run element-wise; the larger of each pair form a
    bitonic row that holds the top T_P, sorted once more. (A data-dependent insertion loop was
    1.5-1.8x slower on the H200, a hand-written bitonic merge for the second sort 1.3-1.9x:
    docs/perf-log.md.)
    """
    top = tl.sort(cand, descending=True)
    if BB > T_P:  # a descending row's first T_P dominate every later group of T_P element-wise
        top = tl.max(tl.reshape(top, (ROWS, BB // T_P, T_P)), axis=1)
    return tl.sort(tl.maximum(run, top))


@triton.jit
def _select_rows(q_ptr, lse_ptr, start, n, t0, head0, n_heads, s_qt, s_qh, s_lt, s_lh, dd, d_ok,
                 BLOCK_T: tl.constexpr, GP: tl.constexpr):
    """q [BLOCK_T * GP, D_PAD], lse in log2 units and the live mask of heads head0 .. head0 + n_heads
    of the tile's tokens, GP rows per token (rows past n_heads idle); dead rows see nothing."""
    m = tl.arange(0, BLOCK_T * GP)
    row_tok = t0 + m // GP
    row_head = head0 + m % GP
    row_ok = (row_tok < n) & (m % GP < n_heads)
    tok = (start + row_tok).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + row_head[:, None] * s_qh + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + tok * s_lt + row_head * s_lh, mask=row_ok, other=float("-inf")).to(tl.float32)
    live = row_ok & (lse > float("-inf"))  # heads that see nothing contribute p = 0
    return q, tl.where(live, lse * LOG2E_C, 0.0), live


def _prune_select(configs, named_args, **kwargs):
    """Configs whose tile leaves the second head part at least 16 rows (the smallest MMA)."""
    g_hi, g_lo = kwargs["G_HI"], kwargs["G_LO_P"]
    keep = [c for c in configs if g_lo == 0 or c.kwargs["BLOCK_M"] // g_hi * g_lo >= 16]
    return keep or configs[-1:]


def _head_parts(g: int) -> tuple[int, int]:
    """(G_HI, G_LO_P): a group's g query heads as a power-of-two part and, for g not a power of
    two, a second part of g - G_HI heads padded to a power of two (g = 5 -> 4 + 1, 6 -> 4 + 2).
    One padded part when splitting saves no rows (g = 7 -> 8 + 0)."""
    g_p = _next_pow2(g)
    if g == g_p:
        return g, 0
    g_hi = g_p // 2
    g_lo = _next_pow2(g - g_hi)
    return (g_hi, g_lo) if g_hi + g_lo < g_p else (g_p, 0)


@_autotune(_SELECT_CONFIGS, key=["G_HI", "G_LO_P", "HEAD_DIM", "BS", "TOPK"], prune=_prune_select)
@triton.jit
def _select_kernel(
    q_ptr, kc_ptr, lse_ptr, cu_ptr, cuc_ptr, out_ptr,
    batch, steps, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_lh, s_ot, s_oh,
    G: tl.constexpr, G_HI: tl.constexpr, G_LO_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    L: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, T_P: tl.constexpr,
    BB: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    R: tl.constexpr = BS // S  # compressed tokens starting in one block
    MP: tl.constexpr = L // S  # blocks of s tokens in one window
    BLOCK_C: tl.constexpr = BB * R
    BLOCK_T: tl.constexpr = BLOCK_M // G_HI
    kvh = tl.program_id(1)
    # Tiles never straddle sequences: sequence b owns tiles [b + cu[b] // BLOCK_T, b + 1 + cu[b+1] // BLOCK_T).
    pid = tl.program_id(0)
    lo = pid * 0
    for it in range(steps):
        cand = lo + (1 << (steps - 1 - it))
        ok = cand < batch
        go = ok & (cand + tl.load(cu_ptr + cand, mask=ok, other=0) // BLOCK_T <= pid)
        lo = tl.where(go, cand, lo)
    start = tl.load(cu_ptr + lo)
    n = tl.load(cu_ptr + lo + 1) - start
    t0 = (pid - lo - start // BLOCK_T) * BLOCK_T
    c_start = tl.load(cuc_ptr + lo)
    n_cmp = tl.load(cuc_ptr + lo + 1) - c_start

    pos = t0 + tl.arange(0, BLOCK_T)
    t_ok = pos < n
    own = pos // BS
    n_vis = tl.where(pos >= L - 1, (pos - (L - 1)) // S + 1, 0)
    # (token, head) rows of the QK products: the first G_HI heads of a group as G_HI consecutive
    # rows per token (padded when G_HI > g), the other g - G_HI heads (if any) likewise in a
    # second, smaller product, so that g = 5 costs 5 rows per token instead of 8.
    dd = tl.arange(0, D_PAD)
    d_ok = dd < HEAD_DIM
    q, lse2, live = _select_rows(q_ptr, lse_ptr, start, n, t0, kvh * G, G, s_qt, s_qh, s_lt, s_lh, dd, d_ok,
                                 BLOCK_T, G_HI)
    if G_LO_P > 0:
        q_lo, lse2_lo, live_lo = _select_rows(q_ptr, lse_ptr, start, n, t0, kvh * G + G_HI, G - G_HI, s_qt, s_qh,
                                              s_lt, s_lh, dd, d_ok, BLOCK_T, G_LO_P)

    i = tl.arange(0, R)
    w_own = tl.minimum(MP, R - i).to(tl.float32)  # cells of window bR+i inside block b
    w_spill = tl.maximum(i + MP - R, 0).to(tl.float32)  # ... inside block b+1
    bb = tl.arange(0, BB)
    prev = tl.maximum(bb - 1, 0)[None, :] + tl.zeros([BLOCK_T, BB], dtype=tl.int32)
    col = tl.arange(0, T_P)
    # Ascending run of T_P distinct negative keys (empty slots); its last TOPK columns are the top TOPK.
    run = (col[None, :] - 2 - T_P).to(tl.int64) + tl.zeros([BLOCK_T, T_P], dtype=tl.int64)
    top_col = col >= T_P - TOPK

    last_own = (tl.minimum(t0 + BLOCK_T, n) - 1) // BS
    n_chunks = tl.where(t0 < n, last_own // BB + 1, 0)
    carry = tl.zeros([BLOCK_T], dtype=tl.float32)
    for ch in range(n_chunks):
        jj = ch * BLOCK_C + tl.arange(0, BLOCK_C)
        kt = tl.load(kc_ptr + (c_start + jj).to(tl.int64)[None, :] * s_kt + kvh * s_kh + dd[:, None],
                     mask=(jj < n_cmp)[None, :] & d_ok[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale - lse2[:, None])
        p = tl.where(live[:, None], p, 0.0)
        ps = tl.sum(tl.reshape(p, (BLOCK_T, G_HI, BLOCK_C)), axis=1)
        if G_LO_P > 0:
            p_lo = tl.exp2(tl.dot(q_lo, kt, input_precision=DOT_PREC) * qk_scale - lse2_lo[:, None])
            p_lo = tl.where(live_lo[:, None], p_lo, 0.0)
            ps += tl.sum(tl.reshape(p_lo, (BLOCK_T, G_LO_P, BLOCK_C)), axis=1)
        ps = tl.where(t_ok[:, None] & (jj[None, :] < n_vis[:, None]), ps, 0.0)
        p3 = tl.reshape(ps, (BLOCK_T, BB, R))
        own_part = tl.sum(p3 * w_own[None, None, :], axis=2)
        spill = tl.sum(p3 * w_spill[None, None, :], axis=2)
        score = own_part + tl.where(bb[None, :] == 0, carry[:, None], tl.gather(spill, prev, axis=1))
        carry = tl.sum(tl.where(bb[None, :] == BB - 1, spill, 0.0), axis=1)
        blk = ch * BB + bb[None, :]
        forced = (blk < INIT) | (blk > own[:, None] - LOCAL)
        score = tl.where(forced, float("inf"), score)
        # Scores are >= +0 (sums of exp and +0), so their fp32 bits order like the values.
        key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)
        key = tl.where(t_ok[:, None] & (blk <= own[:, None]), key, _KEY_NONE)
        run = _merge_topk(run, key, BLOCK_T, T_P, BB)

    # Ascending output: a chosen block goes to slot (number of chosen blocks below it); -1 after.
    chosen = top_col[None, :] & (run >= 0)
    blocks = tl.where(chosen, 0x7FFFFFFF - (run & 0x7FFFFFFF), 0x7FFFFFFF).to(tl.int32)
    rank = tl.sum((blocks[:, None, :] < blocks[:, :, None]).to(tl.int32), axis=2)
    n_chosen = tl.sum(chosen.to(tl.int32), axis=1)
    out = out_ptr + (start + pos).to(tl.int64)[:, None] * s_ot + kvh * s_oh
    tl.store(out + rank, blocks, mask=t_ok[:, None] & chosen)
    pad = (col[None, :] >= n_chosen[:, None]) & (col[None, :] < TOPK)
    tl.store(out + col[None, :], tl.full([BLOCK_T, T_P], -1, dtype=tl.int32), mask=t_ok[:, None] & pad)


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-T selection blocks per token and KV head (NSA Eq. 8–12), int32 [total, h_kv, topk].

    q [total, h, d] and k_cmp [total // s, h_kv, d] in one dtype (fp16/bf16/fp32); lse_cmp
    [total, h] (natural log, -inf for queries that see no compressed token) from compressed
    attention; cu_seqlens / cu_seqlens_cmp int32 [batch + 1]. Query t sees compressed j of its
    sequence iff t >= j*s + l - 1. Scores p = exp(q·k_cmp·scale - lse_cmp) are summed over the g
    heads of a group in fp32 and mapped to blocks with the overlap weights; blocks < init_blocks
    and the local_blocks blocks ending at the own block are forced, later blocks never chosen,
    ties go to the lower block. Rows ascending, valid first, -1 padding. Same as
    ``reference.select_blocks`` up to fp32 summation order (near-ties may order differently).
    """
    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    h, h_kv, g, d = check_attention_inputs(q, k_cmp, k_cmp, cu_seqlens)
    total, rows = q.shape[0], k_cmp.shape[0]
    if rows != compressed_capacity(total, cfg.kernel_stride):
        raise ValueError(f"k_cmp must have total // kernel_stride = {compressed_capacity(total, cfg.kernel_stride)} rows, got {rows}")
    check_tensor("lse_cmp", lse_cmp, 2, (torch.float32, torch.float16, torch.bfloat16), q.device)
    if tuple(lse_cmp.shape) != (total, h):
        raise ValueError(f"lse_cmp must have shape [total, h] = [{total}, {h}], got {tuple(lse_cmp.shape)}")
    check_tensor("cu_seqlens_cmp", cu_seqlens_cmp, 1, (torch.int32,), q.device)
    if cu_seqlens_cmp.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cmp must have shape {tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_cmp.shape)}")

    out = torch.empty((total, h_kv, cfg.topk), dtype=torch.int32, device=q.device)
    if total == 0:
        return out
    q, k_cmp = _unit_last_stride(q), _unit_last_stride(k_cmp)
    if rows == 0:  # no compressed token at all: keep a valid pointer, every load is masked
        k_cmp = k_cmp.new_zeros((1, h_kv, d))
    g_hi, g_lo = _head_parts(g)
    r = cfg.block_size // cfg.kernel_stride
    t_pad = max(2, _next_pow2(cfg.topk))
    batch = cu_seqlens.numel() - 1
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    grid = lambda meta: (batch + total // (meta["BLOCK_M"] // g_hi), h_kv)
    _select_kernel[grid](
        q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, batch, _search_steps(batch), scale * _LOG2E,
        q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse_cmp.stride(0), lse_cmp.stride(1),
        out.stride(0), out.stride(1),
        G=g, G_HI=g_hi, G_LO_P=g_lo, HEAD_DIM=d, D_PAD=max(16, _next_pow2(d)), L=cfg.kernel_size, S=cfg.kernel_stride,
        BS=cfg.block_size, TOPK=cfg.topk, T_P=t_pad, BB=max(t_pad, triton.cdiv(16, r)),
        INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, DOT_PREC=_dot_precision(q.dtype),
        **_meta(BLOCK_M=16 * g_hi),
    )
    return out


# ==============================================================================================
# Compressed attention (NSA step 2): the generic FlashAttention kernels of ``flash.py`` with the
# "compressed" mask. (Section owned by the flash/window/full helper; keep it last in the file.)
# ==============================================================================================


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the compressed tokens it may see; differentiable in q, k_cmp, v_cmp.

    q [total, h, d]; k_cmp, v_cmp [rows, h_kv, d] in the layout of ``compress_kv`` (rows =
    total // kernel_stride; sequence b's compressed tokens at cu_seqlens_cmp[b]..[b+1], rows past
    cu_seqlens_cmp[-1] are padding: never read, zero gradient). Query t (local position) sees
    compressed j iff t >= j * kernel_stride + kernel_size - 1. Returns o [total, h, d] in q.dtype
    and lse [total, h] fp32 (natural log); queries that see nothing give o = 0, lse = -inf.
    """
    from .flash import flash_attention

    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    return flash_attention(
        q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, mask="compressed",
        kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride, scale=scale,
    )
