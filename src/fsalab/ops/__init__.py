"""NSA ops, one folder per op, each with its kernels, its autograd and its fp32 PyTorch reference
(``<op>/reference.py``); the module picks each branch's implementation by name:

- compression branch (``compression/``: compress_kv, compressed_attention; ``topk/``:
  select_blocks): ``compression_ops(impl, device)``, names ``impls.COMPRESSION_IMPLS``
- selected attention (``selected/``): ``fsalab.ops.selected.selected_attention(..., impl=...)``,
  names ``fsalab.ops.selected.IMPLS``
- sliding window (``window/``): ``window_op``, names ``impls.WINDOW_IMPLS``
- gated sum of the three branches (``gate/``): ``gate_op``, names ``impls.GATE_IMPLS``
- decode step (``decode/``): ``fsalab.ops.decode.decode_ops``, names ``impls.DECODE_IMPLS``

Shared: ``_triton.py`` (the kernels' Triton toolbox), ``flash.py`` (the FlashAttention kernels of
the compressed, window and full attentions), ``reference_common.py`` (the references' plumbing),
``full.py`` (the full-attention baselines).

"auto" picks the kernels on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _triton  # noqa: F401  (applies the interpreter patch before any kernel runs)
from .impls import COMPRESSION_IMPLS, DECODE_IMPLS, GATE_IMPLS, WINDOW_IMPLS


@dataclass(frozen=True)
class CompressionOps:
    """The compression branch's three ops of one implementation, with the signatures of
    ``compression.reference.compress_kv`` / ``compressed_attention`` and
    ``topk.reference.select_blocks``."""

    compress_kv: Callable
    compressed_attention: Callable
    select_blocks: Callable


def compression_ops(impl: str, device: torch.device) -> CompressionOps:
    """compress_kv / compressed_attention / select_blocks for ``impl`` ("reference": the fp32
    PyTorch references; "triton": the kernels; "auto": the kernels on CUDA)."""
    if impl not in COMPRESSION_IMPLS:
        raise ValueError(f"compression impl must be one of {COMPRESSION_IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        from .compression import reference as compression
        from .topk import reference as topk
    else:
        from . import compression, topk
    return CompressionOps(compression.compress_kv, compression.compressed_attention, topk.select_blocks)


def window_op(impl: str, device: torch.device):
    """A callable (q, k, v, cu_seqlens, window_size, scale) -> (o, lse) for ``impl``."""
    if impl not in WINDOW_IMPLS:
        raise ValueError(f"window impl must be one of {WINDOW_IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        from .window.reference import window_attention

        return window_attention
    from .window import window_attention

    backend = impl

    def op(q, k, v, cu_seqlens, window_size, scale=None):
        return window_attention(q, k, v, cu_seqlens, window_size, scale, backend=backend)

    return op


def gate_op(impl: str, device: torch.device):
    """NSA's gated sum (o_cmp, o_slc, o_win, gate_logits) -> o for ``impl`` and tensors on ``device``.

    "reference" is torch's elementwise ops in the inputs' dtype: the same sum as the fused kernel,
    rounded differently, which the convergence noise floor uses.
    """
    if impl not in GATE_IMPLS:
        raise ValueError(f"gate impl must be one of {GATE_IMPLS}, got {impl!r}")
    if impl == "triton" or (impl == "auto" and device.type == "cuda"):
        from .gate import gated_sum
    else:
        from .gate.reference import gated_sum
    return gated_sum


def selection_default(device: torch.device) -> str:
    return "auto" if device.type == "cuda" else "reference"


__all__ = ["COMPRESSION_IMPLS", "DECODE_IMPLS", "GATE_IMPLS", "WINDOW_IMPLS", "CompressionOps", "compression_ops",
           "gate_op", "selection_default", "window_op"]
