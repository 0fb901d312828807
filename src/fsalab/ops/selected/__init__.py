"""Selected attention (NSA step 4): the paper's subject, in several loop orders.

``selected_attention(q, k, v, block_idx, cu_seqlens, block_size, impl=...)`` is the one entry
point. Implementations live in their own modules and are looked up by name:

- ``reference``: fp32 PyTorch (``reference.py``), any device.
- ``nsa``: NSA's query-outer Triton kernel (``nsa.py``).
- ``fsa_paper`` / ``fsa``: FSA's KV-block-outer kernels (``fsa.py``).
- ``auto``: the dispatcher's pick for the shape (``dispatch.py``).
- ``fla_nsa``: a peer baseline, fla-core's NSA kernels (``fla_nsa.py``; g = 16 only, needs the
  optional ``fla-core`` package, ``pip install 'fsalab[peers]'``).

Every implementation takes q [total, h, d], k/v [total, h_kv, d], block_idx int32
[total, h_kv, topk], cu_seqlens int32 [batch + 1] and returns (o [total, h, d] in q's dtype,
lse [total, h] fp32, natural log), differentiable in q, k, v.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

from ...checks import (
    KERNEL_DTYPES,
    REFERENCE_DTYPES,
    check_attention_inputs,
    check_block_idx,
    check_block_idx_values,
    check_block_size,
    check_scale,
)

# impl name -> (module, function name), imported on first use
IMPLS: dict[str, tuple[str, str]] = {
    "reference": ("fsalab.ops.selected.reference", "selected_attention_reference"),
    "nsa": ("fsalab.ops.selected.nsa", "selected_attention_nsa"),
    "fsa_paper": ("fsalab.ops.selected.fsa", "selected_attention_fsa_paper"),
    "fsa": ("fsalab.ops.selected.fsa", "selected_attention_fsa"),
    "auto": ("fsalab.ops.selected.dispatch", "selected_attention_auto"),
    "fla_nsa": ("fsalab.ops.selected.fla_nsa", "selected_attention_fla"),
}
# Peer kernels (other projects' code behind fsalab's contract): benchmarked, not swapped into models.
PEER_IMPLS = ("fla_nsa",)


def resolve(impl: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The function behind an impl name; a clear error for unknown or not-yet-available impls."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    module, name = IMPLS[impl]
    if torch.compiler.is_compiling():
        # Dynamo runs import statements while it traces, but not importlib: fsalab's own impls
        # are loaded here, and found below in sys.modules, whose lookup it traces.
        from . import dispatch, fsa, nsa, reference  # noqa: F401
    try:
        return getattr(sys.modules.get(module) or importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"selected-attention impl {impl!r} is not available: {exc}") from exc


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    impl: str = "reference",
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each token over its selected KV blocks (causal inside its own block).

    Returns (o [total, h, d] in q.dtype, lse [total, h] float32 natural log; -inf for empty rows).
    ``check_indices=False`` skips the value checks of block_idx (shapes are still checked): for
    indices from ``select_blocks``, whose output meets them (ascending, distinct, at or before
    the own block, -1 after), so a whole NSA attention call does not spend launches re-checking
    its own selection.
    """
    fn = resolve(impl)
    check_attention_inputs(q, k, v, cu_seqlens, REFERENCE_DTYPES if impl == "reference" else KERNEL_DTYPES)
    check_scale(scale)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v must have one row per token of q ({q.shape[0]}), got {k.shape[0]}")
    check_block_size(block_size, impl)
    check_block_idx(block_idx, q.shape[0], k.shape[1])
    if block_idx.device != q.device:
        raise ValueError(f"block_idx is on {block_idx.device}, expected {q.device}")
    if check_indices:
        check_block_idx_values(block_idx, cu_seqlens, block_size)
    return fn(q, k, v, block_idx, cu_seqlens, block_size, scale)
