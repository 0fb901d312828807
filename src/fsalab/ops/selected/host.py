"""The selected-attention kernels' host functions without autograd, one (forward, backward) pair
per kernel impl, for callers that own the autograd node (the whole NSA attention,
``ops/attention.py``) and pass each pair's ``saved`` tensors from its forward to its backward.

``forward(q, k, v, block_idx, cu_seqlens, block_size, scale, grad) -> (o, lse, saved)`` (``grad``:
whether a backward follows) and
``backward(do, q, k, v, o, lse, block_idx, cu_seqlens, saved, block_size, scale) -> (dq, dk,
dv)``, on contiguous inputs and a float scale, as the impls' own autograd Functions call them:
dq, dk and dv are new tensors whose every element the backward writes. ``fake_saved`` gives
``saved``'s shapes for a fake kernel. The fp32 reference and the peer ``fla_nsa`` have none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import dispatch, fsa, nsa
from .index import empty_index


@dataclass(frozen=True)
class HostPair:
    forward: Callable
    backward: Callable
    fake_saved: Callable  # (q, block_idx, cu_seqlens, block_size, grad) -> list[Tensor]


def _index_like(q, block_idx, cu_seqlens, block_size, grad):
    """fsa's saved tensors: its forward builds the index lists whether a backward follows or not."""
    return empty_index(block_idx, cu_seqlens, block_size).tensors()


def _index_if_grad(q, block_idx, cu_seqlens, block_size, grad):
    """auto's saved tensors: the index lists where a backward follows."""
    return _index_like(q, block_idx, cu_seqlens, block_size, grad) if grad else []


def _fsa_pair(paper: bool) -> HostPair:
    def forward(q, k, v, block_idx, cu_seqlens, block_size, scale, grad):
        return fsa._forward_indexed(q, k, v, block_idx, cu_seqlens, block_size, scale, paper, True, True)

    def backward(do, q, k, v, o, lse, block_idx, cu_seqlens, saved, block_size, scale):
        return fsa._backward_on(do, None, q, k, v, o, lse, saved, block_size, scale, paper, True, True)

    return HostPair(forward, backward, _index_like)


def _nsa_forward(q, k, v, block_idx, cu_seqlens, block_size, scale, grad):
    o, lse, tok_start = nsa._forward(q, k, v, block_idx, cu_seqlens, block_size, scale)
    return o, lse, [tok_start]


def _nsa_backward(do, q, k, v, o, lse, block_idx, cu_seqlens, saved, block_size, scale):
    return nsa._backward_on(do, None, q, k, v, o, lse, block_idx, cu_seqlens, saved[0], block_size, scale, [])


def _auto_forward(q, k, v, block_idx, cu_seqlens, block_size, scale, grad):
    return dispatch._forward_chosen(q, k, v, block_idx, cu_seqlens, block_size, scale, grad)


def _auto_backward(do, q, k, v, o, lse, block_idx, cu_seqlens, saved, block_size, scale):
    return dispatch._backward_chosen(do, None, q, k, v, o, lse, block_idx, cu_seqlens, saved, block_size, scale)


HOST_PAIRS: dict[str, HostPair] = {
    "fsa": _fsa_pair(False),
    "fsa_paper": _fsa_pair(True),
    "nsa": HostPair(_nsa_forward, _nsa_backward, lambda q, *_: [q.new_empty(q.shape[0], dtype=torch.int32)]),
    "auto": HostPair(_auto_forward, _auto_backward, _index_if_grad),
}
