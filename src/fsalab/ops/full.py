"""Full causal attention baselines behind one signature (the FSA paper's "Full Attention").

``full_attention(q, k, v, cu_seqlens, max_seqlen=None, scale=None, impl=...) -> o``

impl:
- ``flash_attn``: ``flash_attn.flash_attn_varlen_func(causal=True)`` (FlashAttention-2), CUDA only.
- ``sdpa_flash`` / ``sdpa_cudnn``: torch SDPA restricted to its FlashAttention or cuDNN backend,
  CUDA fp16/bf16 only. ``sdpa_math``: SDPA's plain math backend, any device (a CPU check).
- ``triton``: fsalab's kernel (``ops/flash.py``, window mask wider than any sequence).

SDPA has no varlen interface. A single sequence is viewed as [1, h, N, d]; several sequences of
one length (``max_seqlen * batch == total``) as [B, h, N, d]; otherwise they are scattered into a
zero-padded [B, max_seqlen, h, d] batch (causal masking keeps real queries off the padding, and
padded rows are dropped). ``max_seqlen`` is a host int: pass it to avoid reading cu_seqlens on
the host (one sync). GQA uses SDPA's ``enable_gqa`` where the backend supports it (flash/math from
torch 2.5, cuDNN from torch 2.8), else k/v heads are repeated.

Shapes: q [total, h, d], k/v [total, h_kv, d], cu_seqlens int32 [batch + 1]; o [total, h, d].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checks import KERNEL_DTYPES, check_attention_inputs, check_scale
from ..varlen import local_positions, sequence_ids
from .flash import NO_WINDOW, flash_attention
from .impls import FULL_ATTENTION_IMPLS
from .window import flash_attn_varlen

IMPLS = FULL_ATTENTION_IMPLS
_SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}
# torch version from which each SDPA backend accepts k/v with fewer heads (enable_gqa=True).
_GQA_SINCE = {"sdpa_flash": (2, 5), "sdpa_math": (2, 5), "sdpa_cudnn": (2, 8)}


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _max_seqlen(cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None) -> int:
    if max_seqlen is not None:
        if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
            raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
        return max_seqlen
    if cu_seqlens.numel() == 2:
        return total
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # host sync; pass max_seqlen to avoid it


def _sdpa(q, k, v, cu_seqlens, max_seqlen, scale, impl):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    total, h, d = q.shape
    h_kv = k.shape[1]
    batch = cu_seqlens.numel() - 1
    n = _max_seqlen(cu_seqlens, total, max_seqlen)
    gqa = h != h_kv and _torch_version() >= _GQA_SINCE[impl]
    if h != h_kv and not gqa:
        k, v = k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1)
    if n * batch == total:
        # Every sequence has length n (each is <= n and they sum to n * batch): a plain view.
        def to_batch(x):
            return x.view(batch, n, x.shape[1], d)

        def from_batch(o):
            return o.reshape(total, h, d)
    else:
        if n * batch < total:
            raise ValueError(f"max_seqlen ({n}) is smaller than the longest sequence (total {total}, batch {batch})")
        seq, pos = sequence_ids(cu_seqlens, total), local_positions(cu_seqlens, total)

        def to_batch(x):
            padded = x.new_zeros((batch, n, x.shape[1], d))
            padded[seq, pos] = x
            return padded

        def from_batch(o):
            return o[seq, pos]

    qb, kb, vb = (to_batch(x).transpose(1, 2) for x in (q, k, v))  # [B, heads, N, d]
    kwargs = {"enable_gqa": True} if gqa else {}
    try:
        with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[impl])):
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, **kwargs)
    except RuntimeError as exc:
        raise RuntimeError(
            f"impl={impl!r}: torch SDPA's {_SDPA_BACKENDS[impl]} backend cannot run this input "
            f"(dtype {q.dtype}, d={d}, device {q.device}): {exc}"
        ) from exc
    return from_batch(o.transpose(1, 2))


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    scale: float | None = None,
    impl: str = "sdpa_flash",
) -> torch.Tensor:
    """Causal attention of every sequence over itself; returns o [total, h, d] in q.dtype.

    max_seqlen: the longest sequence as a host int (optional; see the module doc).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    check_attention_inputs(q, k, v, cu_seqlens, KERNEL_DTYPES)
    check_scale(scale)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v must have one row per query row ({q.shape[0]}), got {k.shape[0]}")
    total = q.shape[0]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[2])
    if impl == "triton":
        return flash_attention(q, k, v, cu_seqlens, mask="window", window_size=NO_WINDOW, scale=scale)[0]
    if impl != "sdpa_math" and not q.is_cuda:
        raise ValueError(f"impl={impl!r} needs a CUDA device; on {q.device} use impl='triton' or 'sdpa_math'")
    if impl in ("sdpa_flash", "sdpa_cudnn", "flash_attn") and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"impl={impl!r} supports fp16 and bf16 only, got {q.dtype}")
    if impl == "flash_attn":
        fn = flash_attn_varlen()
        if fn is None:
            raise ValueError("impl='flash_attn' needs the flash-attn package (pip install 'fsalab[flash]')")
        n = max_seqlen if max_seqlen is not None else total  # an upper bound needs no host sync
        return fn(q, k, v, cu_seqlens, cu_seqlens, n, n, softmax_scale=scale, causal=True)
    if total == 0:
        return q.new_zeros(q.shape)
    return _sdpa(q, k, v, cu_seqlens, max_seqlen, scale, impl)
