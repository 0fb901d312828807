"""Scratch buffers of one op call, carved from one allocation planned once per shape.

An eager call's host time is its launches and its allocations (docs/performance.md, "Whole NSA
attention"). The buffers that never leave a call (partial outputs, work lists, sort keys, row
statistics) come from ``empty`` here: inside a ``planned(key, device)`` scope, the first call
of a key allocates each buffer on its own and records their sizes; later calls of that key
allocate the recorded total once and hand out aligned views of it in request order. A request
past the planned total gets its own allocation, and the plan grows to what the call used, so a
key whose requests change costs allocations, never a wrong buffer. Scopes nest: an inner scope
inside an outer one hands out the outer one's buffer; a ``suspended`` block (the dispatcher's
profiling of every candidate) allocates its own.

Outputs and tensors saved for the backward never come from here: a saved view would keep the
whole scratch alive, and a custom op's outputs may not alias each other. Every size is a function
of shapes (the kernels' host paths read no device values), so a key of shapes and settings
names one plan.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Hashable, Iterator

import torch

# Start of each buffer in the planned allocation: the widest vector load's alignment and more.
ALIGN = 256
# Plans kept at most: a run over many shapes (varlen batches of new totals) starts over when full.
MAX_PLANS = 1024

_plans: dict[Hashable, int] = {}  # key -> bytes of its scratch
_current: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("fsalab_scratch", default=None)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def handed_out(t: torch.Tensor) -> torch.Tensor:
    """Each buffer on its way out (tests poison it: an element no kernel writes then shows)."""
    return t


class _Scope:
    def __init__(self, key: Hashable, device: torch.device):
        self.key, self.device = key, torch.device(device)
        planned_bytes = _plans.get(key, 0)
        self.buffer = torch.empty(planned_bytes, dtype=torch.uint8, device=device) if planned_bytes else None
        self.used = 0  # bytes requested so far (aligned), planned or not

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start, self.used = self.used, self.used + _aligned(nbytes)
        if self.buffer is None or self.used > self.buffer.numel():
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        if self.used > _plans.get(self.key, 0):
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[self.key] = self.used


@contextlib.contextmanager
def planned(key: Hashable, device: torch.device) -> Iterator[None]:
    """The scope of one call's scratch on ``device``; ``key`` names its shapes and settings. Inside
    another scope it adds nothing (the outer one plans the buffers)."""
    if _current.get() is not None:
        yield
        return
    scope = _Scope(key, device)
    token = _current.set(scope)
    try:
        yield
    finally:
        _current.reset(token)
        scope.close()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No scope inside the block: its buffers are its own (the dispatcher's profiling runs of
    every candidate, which a plan must not add up)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def shapes(*tensors: torch.Tensor) -> tuple:
    """The shapes and dtypes of ``tensors``: what of a plan's key they give."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised scratch tensor: a view of the scope's planned buffer, or torch.empty
    outside a scope (and for another device than the scope's)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    scope = _current.get()
    if scope is None or scope.device != torch.device(device):
        return handed_out(torch.empty(shape, dtype=dtype, device=device))
    return handed_out(scope.empty(shape, dtype))
