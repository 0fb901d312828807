"""NSA decode (DESIGN §9): one new token per sequence over an ``NSADecodeCache``.

``cache.py``: the cache a prefill fills; ``step.py``: the step's Triton kernels (``append_token``,
``nsa_decode``); ``reference.py``: their fp32 PyTorch twin, same names and signatures.
``decode_ops(impl, device)`` picks one by name (``DECODE_IMPLS``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..impls import DECODE_IMPLS
from .cache import NSADecodeCache, compression_window
from .step import append_token, decode_splits, nsa_decode

__all__ = ["DECODE_IMPLS", "NSADecodeCache", "append_token", "compression_window", "decode_ops", "decode_splits",
           "nsa_decode"]


def decode_ops(impl: str, device: torch.device) -> ModuleType:
    """The module providing ``append_token`` and ``nsa_decode`` for ``impl`` on ``device``:
    ``step`` (the kernels) or ``reference``; "auto" is the kernels on CUDA, the reference elsewhere."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode impl must be one of {DECODE_IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        from . import reference

        return reference
    from . import step

    return step
