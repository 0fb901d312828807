"""NSA ops. Each branch's implementation is chosen by name so the module can swap kernels.

- compression ops (compress_kv, compressed_attention, select_blocks): ``impls.COMPRESSION_IMPLS``
- selected attention: ``fsalab.ops.selection.IMPLS``
- sliding window: ``impls.WINDOW_IMPLS``
- gated sum of the three branches: ``impls.GATE_IMPLS`` ("triton" is the fused kernel, ``fsalab.ops.gate``)

"auto" picks the kernels on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from . import _triton  # noqa: F401  (applies the interpreter patch before any kernel runs)
from .impls import COMPRESSION_IMPLS, GATE_IMPLS, WINDOW_IMPLS


def compression_ops(impl: str, device: torch.device) -> ModuleType:
    """The module providing compress_kv / compressed_attention / select_blocks for ``impl``."""
    if impl not in COMPRESSION_IMPLS:
        raise ValueError(f"compression impl must be one of {COMPRESSION_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "reference"
    return importlib.import_module("fsalab.ops.reference" if impl == "reference" else "fsalab.ops.compression")


def window_op(impl: str, device: torch.device):
    """A callable (q, k, v, cu_seqlens, window_size, scale) -> (o, lse) for ``impl``."""
    if impl not in WINDOW_IMPLS:
        raise ValueError(f"window impl must be one of {WINDOW_IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        from .reference import window_attention

        return window_attention
    from .window import window_attention

    backend = impl

    def op(q, k, v, cu_seqlens, window_size, scale=None):
        return window_attention(q, k, v, cu_seqlens, window_size, scale, backend=backend)

    return op


def gate_op(impl: str, device: torch.device):
    """NSA's gated sum (o_cmp, o_slc, o_win, gate_logits) -> o for ``impl`` and tensors on ``device``.

    "reference" is torch's elementwise ops in the inputs' dtype (what the module ran before the
    fused kernel existed): the same sum rounded differently, which the convergence noise floor uses.
    """
    if impl not in GATE_IMPLS:
        raise ValueError(f"gate impl must be one of {GATE_IMPLS}, got {impl!r}")
    if impl == "triton" or (impl == "auto" and device.type == "cuda"):
        from .gate import gated_sum
    else:
        from .reference import gated_sum
    return gated_sum


def selection_default(device: torch.device) -> str:
    return "auto" if device.type == "cuda" else "reference"
