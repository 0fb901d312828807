"""Input validation shared by the module and every op.

Shape, dtype and device checks never touch tensor values. Value checks (cu_seqlens ascending,
block indices in range) raise ``ValueError`` on CPU tensors; on CUDA they are queued as
device-side asserts (``torch._assert_async``) so the launch path keeps no host sync. The
setting ``value_checks`` (``fsalab.settings``) skips value checks entirely:
``with settings.override(value_checks=False): ...``.

A cu_seqlens tensor that passed its value checks is not checked again while it is unchanged
(the same tensor, its version counter as it was, the same token count): one NSA attention call
hands the same offsets to five ops, and a model to every layer, each of which checked them again
(three asserts and their comparisons each time). In-place
writes bump the counter, so changed offsets are checked again; under CUDA-graph capture,
``torch.compile`` and for inference tensors (no version counter) every call checks.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import weakref

import torch

from . import settings
from .varlen import local_positions

MAX_GROUP = 16
MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)


def _value_checks_enabled() -> bool:
    return settings.current.value_checks


@functools.cache
def _interpreting() -> bool:
    # Read at the first kernel call, once: by then Triton has defined the kernels under the same
    # variable, which a process sets before it imports triton (fsalab's command line does).
    return os.environ.get("TRITON_INTERPRET") == "1"


def _expect(cond: torch.Tensor, message: str) -> None:
    """Raise on CPU; enqueue a device-side assert elsewhere (no host sync), and on every device
    under ``torch.compile`` (a graph holds no Python branch on a tensor's value; on CPU the
    assert raises RuntimeError when the graph runs)."""
    if cond.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(cond):
            raise ValueError(message)
    else:
        torch._assert_async(cond, message)


def check_kernel_call(device: torch.device, block_size, kernel: str) -> None:
    """What the selected-attention kernels assume beyond ``check_attention_inputs``: block_size a
    power of two >= 16, and CUDA tensors unless the Triton interpreter runs them (TRITON_INTERPRET=1)."""
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"{kernel} need CUDA tensors (or TRITON_INTERPRET=1), got device {device}")


def check_scale(scale) -> None:
    """The softmax scale of an attention op: None (1 / sqrt(d)) or a positive finite real number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Type, rank, dtype and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")


# id(cu_seqlens) -> (weak reference, version counter, total_tokens) of offsets that passed.
_CHECKED_OFFSETS: dict[int, tuple] = {}
_CHECKED_OFFSETS_MAX = 16


def _offsets_key(cu_seqlens: torch.Tensor):
    """The memo's key of cu_seqlens, or None where it must be checked every time."""
    if torch.compiler.is_compiling() or cu_seqlens.is_inference():  # is_inference() is not traceable
        return None
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # a captured graph must hold the asserts its replays run
    return id(cu_seqlens)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, device: torch.device) -> None:
    """cu_seqlens: int32 [batch + 1], starting at 0, non-decreasing, ending at total_tokens."""
    check_tensor("cu_seqlens", cu_seqlens, 1, (torch.int32,), device)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold batch + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    if not _value_checks_enabled():
        return
    key = _offsets_key(cu_seqlens)
    if key is not None:
        seen = _CHECKED_OFFSETS.get(key)
        if seen is not None and seen[0]() is cu_seqlens and seen[1:] == (cu_seqlens._version, total_tokens):
            return
    _expect(cu_seqlens[0] == 0, "cu_seqlens[0] must be 0")
    _expect((cu_seqlens[1:] >= cu_seqlens[:-1]).all(), "cu_seqlens must be non-decreasing (ascending offsets)")
    _expect(cu_seqlens[-1] == total_tokens, f"cu_seqlens[-1] must equal total_tokens = {total_tokens}")
    if key is not None:
        if len(_CHECKED_OFFSETS) >= _CHECKED_OFFSETS_MAX:
            _CHECKED_OFFSETS.pop(next(iter(_CHECKED_OFFSETS)))
        _CHECKED_OFFSETS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, total_tokens)


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES,
) -> tuple[int, int, int, int]:
    """q [total, h, d], k/v [total_kv, h_kv, d] in one dtype on one device.

    Returns (h, h_kv, g, d). k/v may have another token count than q (compressed keys).
    """
    check_tensor("q", q, 3, dtypes)
    check_tensor("k", k, 3, dtypes, q.device)
    check_tensor("v", v, 3, dtypes, q.device)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _, h, d = q.shape
    h_kv = k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"k has head dim {k.shape[2]}, q has {d}; they must match")
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({h_kv})")
    g = h // h_kv
    if g > MAX_GROUP:
        raise ValueError(f"GQA group size g = h / h_kv = {g} exceeds {MAX_GROUP}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim d = {d} exceeds {MAX_HEAD_DIM}")
    check_cu_seqlens(cu_seqlens, q.shape[0], q.device)
    return h, h_kv, g, d


def check_lengths(lengths: torch.Tensor, batch: int, seq: int, device: torch.device) -> None:
    """Right-padding lengths of a padded batch: integer [batch], each in [0, seq] (value check)."""
    check_tensor("lengths", lengths, 1, (torch.int32, torch.int64), device=device)
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths must have shape [batch={batch}], got {tuple(lengths.shape)}")
    if _value_checks_enabled() and batch:
        _expect(((lengths >= 0) & (lengths <= seq)).all(), f"lengths must lie in [0, seq={seq}]")


def check_block_size(block_size, impl: str) -> None:
    """block_size a positive int; for the kernels (every impl but the reference) a power of two
    >= 16 (as ``check_kernel_call`` requires). Checked before the block indices, whose checks
    divide by it, so a bad block size is reported as such."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if impl != "reference" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two >= 16 for impl {impl!r}, got {block_size}")


def check_block_idx(block_idx: torch.Tensor, total_tokens: int, h_kv: int) -> None:
    """block_idx: int32 [total, h_kv, topk]; entries -1 or a block at or before the token's own."""
    check_tensor("block_idx", block_idx, 3, (torch.int32,))
    if block_idx.shape[0] != total_tokens or block_idx.shape[1] != h_kv:
        raise ValueError(
            f"block_idx must have shape [total_tokens={total_tokens}, h_kv={h_kv}, topk], got {tuple(block_idx.shape)}"
        )
    if block_idx.shape[2] < 1:
        raise ValueError("block_idx must hold topk >= 1 slots")


def check_block_idx_values(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> None:
    """Value check: entries in [0, own block] or -1, distinct, ascending, valid ones first."""
    if not _value_checks_enabled() or block_idx.numel() == 0:
        return
    total = block_idx.shape[0]
    positions = local_positions(cu_seqlens, total)
    own = (positions // block_size).to(torch.int32)[:, None, None]
    valid = block_idx >= 0
    in_range = (block_idx == -1) | (valid & (block_idx <= own))
    _expect(in_range.all(), "block_idx holds an index outside [0, own block] that is not the -1 padding")
    # Valid entries first, strictly ascending: kernels treat the list as a set and stop at the first -1.
    ordered = (~valid[..., 1:] | (valid[..., :-1] & (block_idx[..., 1:] > block_idx[..., :-1]))).all()
    _expect(ordered, "block_idx rows must list distinct blocks in ascending order, valid entries before -1")
