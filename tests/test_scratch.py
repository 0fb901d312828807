"""The ops' scratch buffers (``fsalab.ops.scratch``): planned once per shape, one allocation per
call after the first, views that never overlap, and the whole attention's calls allocating their
scratch in one piece with results equal to the bit."""

from __future__ import annotations

import collections

import pytest
import torch

from fsalab import settings
from fsalab.bench.kernel import nsa_attention_calls
from fsalab.ops import scratch
from fsalab.testing import LaunchCounter

ALLOCATING_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros", "zeros_like",
                  "new_zeros", "full", "full_like"}


class AllocationCounter(LaunchCounter):
    """``allocations``: the tensors the block allocates (aten factory ops outside Triton's
    interpreter), by op name."""

    def __init__(self):
        super().__init__()
        self.allocations: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_kernel and name in ALLOCATING_OPS:
            self.allocations[name] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def allocated(self) -> int:
        return sum(self.allocations.values())


REQUESTS = [((3, 5), torch.float32), ((7,), torch.int32), ((), torch.int64), ((2, 0), torch.float16),
            ((4, 3), torch.bfloat16)]


def _call(key="k", requests=REQUESTS):
    with scratch.planned(key, torch.device("cpu")):
        return [scratch.empty(shape, dtype, torch.device("cpu")) for shape, dtype in requests]


def test_a_shape_is_planned_on_its_first_call_and_allocated_once_after():
    key = ("test", object())  # a key no other call has planned
    with AllocationCounter() as first:
        _call(key)
    with AllocationCounter() as second:
        views = _call(key)
    assert first.allocated == len(REQUESTS) and second.allocated == 1, (first.allocations, second.allocations)
    assert [(tuple(v.shape), v.dtype) for v in views] == [(tuple(s), d) for s, d in REQUESTS]
    base = views[0].untyped_storage().data_ptr()
    # Byte offsets in the shared buffer (data_ptr() of an empty tensor is 0: not used).
    spans = sorted((v.storage_offset() * v.element_size(), (v.storage_offset() + v.numel()) * v.element_size())
                   for v in views)
    assert all(start % scratch.ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans  # no two views overlap
    assert all(v.untyped_storage().data_ptr() == base for v in views)
    for i, v in enumerate(views):  # each view is writable on its own
        v.fill_(i)
    assert all(bool((v == i).all()) for i, v in enumerate(views))


def test_a_request_past_the_plan_gets_its_own_buffer_and_grows_the_plan():
    key = ("test", object())
    _call(key, REQUESTS[:2])
    with AllocationCounter() as grown:
        views = _call(key)  # three more requests than planned
    assert grown.allocated == 1 + 3, grown.allocations
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1 + 3
    with AllocationCounter() as planned:
        _call(key)
    assert planned.allocated == 1


def test_inner_scopes_share_the_outer_buffer_and_suspended_blocks_allocate_their_own():
    key = ("test", object())
    for _ in range(2):
        with AllocationCounter() as counter, scratch.planned(key, torch.device("cpu")):
            a = scratch.empty(4, torch.float32, torch.device("cpu"))
            with scratch.planned(("inner", object()), torch.device("cpu")):
                b = scratch.empty(4, torch.float32, torch.device("cpu"))
            with scratch.suspended():
                c = scratch.empty(4, torch.float32, torch.device("cpu"))
    assert counter.allocated == 2, counter.allocations  # the planned buffer, and c
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()


def test_outside_a_scope_scratch_is_a_plain_allocation():
    with AllocationCounter() as counter:
        t = scratch.empty((2, 3), torch.float16, torch.device("cpu"))
    assert counter.allocated == 1 and t.shape == (2, 3) and t.dtype == torch.float16 and t.is_contiguous()


# Whole NSA attention at 128 tokens (test_launch_count's shape): tensors allocated per call, the
# planned scratch included. Before scratch was planned: fsa 27 forward / 22 backward, nsa 13 / 28
# (the rest are the outputs and the tensors saved for the backward, which a plan may not hold).
NSA_ATTENTION_ALLOCATIONS = {"fsa": (21, 10), "nsa": (13, 10)}


@pytest.mark.parametrize("impl", sorted(NSA_ATTENTION_ALLOCATIONS))
def test_the_whole_attention_allocates_its_scratch_once_per_call(impl, device):
    """After a shape's first call, each direction allocates at most the counts above, and gives
    the first call's results to the bit."""
    settings.configure(value_checks=False)
    calls = nsa_attention_calls(impl, 128, 1, 1, 16, 32, 4, device=device)
    for fn, limit in zip(calls, NSA_ATTENTION_ALLOCATIONS[impl]):
        first = fn()  # outside the count: the shape's first call plans its scratch
        with AllocationCounter() as counter:
            again = fn()
        assert counter.allocated <= limit, dict(counter.allocations)
        flat = lambda out: [t for t in (out if isinstance(out, (tuple, list)) else [out]) if t is not None]  # noqa: E731
        assert all(torch.equal(a, b) for a, b in zip(flat(first), flat(again), strict=True))
