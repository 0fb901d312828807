"""What torch.compile sees of fsalab's kernels: ``torch.library`` custom ops (namespace ``fsalab``).

Each kernel module registers, beside its autograd Function, one op per host function it exposes
(the tile and grid arithmetic, autotuning, the selection dispatcher's profiling and cache,
allocations and launches), with a fake kernel giving the outputs' shapes, dtypes and strides from
the inputs' metadata alone, and, for a differentiable op, the Function's ``setup`` and
``backward`` as its autograd. Dynamo records such an op as one opaque node and traces none of its
host side. Non-tensor arguments cross a schema as ints, floats, bools and strings: an
``NSAConfig`` as ``cfg.as_ints()``, a ``SelectionIndex`` as its ``tensors()``. docs/DESIGN.md,
"torch.compile", lists the ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake


def op_or(name: str, impl: Callable, probe: torch.Tensor | None = None) -> Callable:
    """``torch.ops.fsalab.<name>`` while torch.compile traces the caller, else ``impl``.

    The op takes ``impl``'s arguments and runs the same host function. Eager calls take ``impl``
    (an autograd Function's ``apply`` whose ``setup`` and ``backward`` are the op's autograd, or
    the host function itself): a custom op's Python dispatch costs several times the call's own
    host time, and short eager calls are bound by host time. ``probe``: a tensor argument of a
    backward's call; when it is fake, the op as well (AOTAutograd traces a backward on fake
    tensors outside dynamo, where ``is_compiling()`` can be False, and a kernel cannot launch on
    them).
    """
    if torch.compiler.is_compiling() or (probe is not None and is_fake(probe)):
        return getattr(torch.ops.fsalab, name).default
    return impl


def lse_like(q: torch.Tensor) -> torch.Tensor:
    """A fake kernel's lse: [total, h] fp32 of q [total, h, d]."""
    return q.new_empty(q.shape[:2], dtype=torch.float32)


def grads_like(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A fake kernel's gradients of ``inputs``: contiguous tensors of their shapes and dtypes."""
    return tuple(x.new_empty(x.shape) for x in inputs)
