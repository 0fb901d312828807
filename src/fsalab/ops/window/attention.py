"""Sliding-window attention (NSA branch 3): query t attends keys (t - w, t] of its own sequence.

Backends:
- ``flash_attn``: ``flash_attn.flash_attn_varlen_func(causal=True, window_size=(w - 1, 0))``.
  flash-attn's window keeps keys [t - left, t + right], so left = w - 1 gives exactly w keys,
  matching the reference. (The official FSA code passes (512, -1), i.e. 513 keys.) Its lse is
  returned but carries no gradient (flash-attn's backward ignores it).
- ``triton``: fsalab's own kernel (``ops/flash.py``, mask "window"); lse is differentiable.
- ``auto``: flash_attn for fp16/bf16 CUDA tensors when flash-attn is importable, else triton.

Shapes: q [total, h, d], k/v [total, h_kv, d], cu_seqlens int32 [batch + 1]. Returns
o [total, h, d] in q.dtype and lse [total, h] fp32 (natural log).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ...checks import KERNEL_DTYPES, check_attention_inputs
from ..flash import flash_attention
from ..impls import WINDOW_IMPLS

BACKENDS = tuple(i for i in WINDOW_IMPLS if i != "reference")


# Whether flash-attn is installed, looked up once at import without importing it: the "auto"
# choice reads it while torch.compile traces, where an import statement of a missing package
# breaks the graph.
_FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None


@functools.cache
def flash_attn_varlen():
    """flash_attn.flash_attn_varlen_func, or None when flash-attn is not installed."""
    if not _FLASH_ATTN_INSTALLED:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def flash_attn_usable(q: torch.Tensor) -> bool:
    """Whether "auto" takes flash-attn's window for q: installed, CUDA, fp16/bf16."""
    return _FLASH_ATTN_INSTALLED and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window_size: int,
    scale: float | None = None,
    backend: str = "auto",
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window causal attention; returns (o [total, h, d], lse [total, h] fp32).

    max_seqlen (flash_attn only): the longest sequence, a host int. flash-attn sizes its grid
    from it; when omitted the total token count is used, an upper bound that needs no host sync
    but launches idle programs when the batch holds many sequences.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "flash_attn" if flash_attn_usable(q) else "triton"
    if backend == "triton":
        return flash_attention(q, k, v, cu_seqlens, mask="window", window_size=window_size, scale=scale)
    check_attention_inputs(q, k, v, cu_seqlens, KERNEL_DTYPES)
    if flash_attn_varlen() is None:
        raise ValueError("backend='flash_attn' needs the flash-attn package (pip install 'fsalab[flash]')")
    if not flash_attn_usable(q):
        raise ValueError(f"backend='flash_attn' needs fp16/bf16 CUDA tensors, got {q.dtype} on {q.device}")
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v must have one row per query row ({q.shape[0]}), got {k.shape[0]}")
    max_seqlen = max_seqlen if max_seqlen is not None else q.shape[0]
    o, lse, _ = flash_attn_varlen()(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        softmax_scale=scale, causal=True, window_size=(window_size - 1, 0), return_attn_probs=True,
    )
    return o, lse.t().contiguous()  # flash-attn's varlen lse is [h, total]
