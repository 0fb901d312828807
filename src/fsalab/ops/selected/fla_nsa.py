"""Peer baseline: fla-core's NSA selected-attention kernels behind fsalab's contract (impl ``fla_nsa``).

fla-core (PyPI ``fla-core``, import ``fla``; ``pip install 'fsalab[peers]'``) ships a Triton NSA in
``fla.ops.nsa.parallel``. Its selected-attention branch is the pair ``parallel_nsa_fwd`` /
``parallel_nsa_bwd``; this module runs that pair in an autograd function of its own rather than
through fla's ``parallel_nsa``, which mean-pools k and v for its compression branch on every call
(work fsalab's selected op does not do) and returns o only (its lse stays inside the autograd
context). The kernels are fla's; only the layout glue is here.

Layout: fla takes q [B, T, HQ, K], k/v [B, T, H, K], block_indices [B, T, H, S] and, for packed
sequences, B = 1 plus cu_seqlens. fsalab's packed q/k/v are that with B = 1 (views, no copy).
Block ids are local to each sequence in both (fla offsets k/v by the sequence start).

Semantics match fsalab's (checked against ``fsalab.ops.selected.reference`` in tests/test_peers.py): fla
skips negative ids (fsalab's -1 padding), masks keys after the token (so inside its own block the
token sees keys <= t) and keys past the sequence end, and takes the selection as a set.

Constraints of fla-core 0.6.0's kernels, checked here so they fail with a ValueError (the
benchmark's "unsupported") instead of a Triton compile error:
- g = h / h_kv a power of two >= 16: the g query heads of a KV head are the M side of every
  tl.dot (``parallel_nsa`` asserts it). With fsalab's g <= 16 that leaves g = 16.
- block_size a power of two (tl.arange over a block's keys).
- S a power of two: handled by padding (``to_fla_block_indices``).
- d <= 256 (one key tile); fla caps it at 128 on GPUs with less shared memory than Hopper.

Differences: fla's backward has no lse term, so a loss that uses lse raises in backward. A row
that selects nothing comes out of fla as o = 0/0 = NaN (lse -inf); ``zero_empty_rows`` zeroes it
as fsalab's contract says, at the cost of one pass over o.

Shapes: q [total, h, d], k/v [total, h_kv, d], block_idx int32 [total, h_kv, topk] (local block
ids, ascending, -1 padding), cu_seqlens int32 [batch + 1]. Returns o [total, h, d] in q.dtype and
lse [total, h] fp32, natural log.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .._triton import next_pow2

MIN_GROUP = 16


def to_fla_block_indices(block_idx: torch.Tensor) -> torch.Tensor:
    """fsalab's block_idx int32 [total, h_kv, topk] -> fla's block_indices int32 [1, total, h_kv, S].

    S = topk rounded up to a power of two, because fla's dk/dv pass builds its block -> query
    lists over ``tl.arange(0, S)`` slots; the added slots hold -1, which fla skips as fsalab does.
    int32 is what fla's own top-k kernel writes. A view (no copy) when topk is a power of two,
    as in the benchmark's grids (topk 8 and 16).
    """
    if block_idx.dim() != 3:
        raise ValueError(f"block_idx must be [total, h_kv, topk], got shape {tuple(block_idx.shape)}")
    topk = block_idx.shape[2]
    s = next_pow2(topk)
    idx = block_idx if s == topk else F.pad(block_idx, (0, s - topk), value=-1)
    return idx.to(torch.int32).contiguous().unsqueeze(0)


def check_supported(h: int, h_kv: int, d: int, block_size: int) -> None:
    """ValueError for shapes fla-core's NSA kernels cannot run (see the module doc)."""
    g = h // h_kv
    if g < MIN_GROUP or g & (g - 1):
        raise ValueError(
            f"impl 'fla_nsa': fla-core's NSA kernels need a GQA group g = h / h_kv that is a power of two "
            f">= {MIN_GROUP} (the group is the M side of their MMA tiles); got g = {g}"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"impl 'fla_nsa': block_size must be a power of two >= 16, got {block_size}")
    if d > 256:
        raise ValueError(f"impl 'fla_nsa': head dim d must be <= 256 (one key tile in fla), got {d}")


def _fla_ops():
    """(parallel_nsa_fwd, parallel_nsa_bwd, prepare_token_indices) from fla-core."""
    try:
        parallel = importlib.import_module("fla.ops.nsa.parallel")
        utils = importlib.import_module("fla.ops.utils")
    except ImportError as exc:
        raise ValueError(
            f"impl 'fla_nsa' needs the fla-core package (pip install 'fsalab[peers]'): {exc}"
        ) from exc
    return parallel.parallel_nsa_fwd, parallel.parallel_nsa_bwd, utils.prepare_token_indices


class _FlaSelected(torch.autograd.Function):
    """o, lse = fla's selected attention on [1, T, ...] tensors; gradients of o only."""

    @staticmethod
    def forward(ctx, q, k, v, indices, cu_seqlens, block_size, scale, zero_empty_rows):
        fwd, _, token_indices_of = _fla_ops()
        token_indices = token_indices_of(cu_seqlens)
        o, lse = fwd(
            q=q, k=k, v=v, block_indices=indices, block_counts=indices.shape[-1], block_size=block_size,
            scale=scale, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, token_indices_q=token_indices,
        )
        if zero_empty_rows:
            # Valid ids come first, so slot 0 < 0 marks a row with nothing selected ([1, T, h_kv]).
            empty = indices[..., 0] < 0
            o.view(*empty.shape, -1, o.shape[-1]).masked_fill_(empty[..., None, None], 0)
        ctx.save_for_backward(q, k, v, o, lse, indices, cu_seqlens, token_indices)
        ctx.block_size, ctx.scale = block_size, scale
        # Unused outputs then get None instead of zeros, which is how backward tells a loss on lse.
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if dlse is not None or do is None:
            raise NotImplementedError("impl 'fla_nsa': fla's backward has no lse term; only o is differentiable")
        q, k, v, o, lse, indices, cu_seqlens, token_indices = ctx.saved_tensors
        _, bwd, _ = _fla_ops()
        dq, dk, dv = bwd(
            q=q, k=k, v=v, o=o, lse=lse, do=do.contiguous(), block_indices=indices, block_counts=indices.shape[-1],
            block_size=ctx.block_size, scale=ctx.scale, cu_seqlens=cu_seqlens, token_indices=token_indices,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def selected_attention_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    zero_empty_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fsalab's selected attention computed by fla-core's kernels; (o [total, h, d], lse [total, h] fp32).

    zero_empty_rows=False leaves fla's NaN in rows that select nothing (saves one pass over o; the
    benchmark uses it, its block indices always include the token's own block).
    """
    _, h, d = q.shape
    check_supported(h, k.shape[1], d, block_size)
    _fla_ops()  # the missing-package error before any work
    scale = scale if scale is not None else d**-0.5
    q4, k4, v4 = (x.contiguous().unsqueeze(0) for x in (q, k, v))
    o, lse = _FlaSelected.apply(
        q4, k4, v4, to_fla_block_indices(block_idx), cu_seqlens, block_size, scale, zero_empty_rows
    )
    return o.squeeze(0), lse.squeeze(0)
