"""What every op's fp32 PyTorch reference shares (``ops/<op>/reference.py``).

Packed varlen layout: q [total, h, d], k/v [total, h_kv, d], cu_seqlens int32 [batch + 1].
Compressed keys/values live in a buffer of ``total // kernel_stride`` rows with per-sequence
offsets ``cu_seqlens_cmp``; rows past ``cu_seqlens_cmp[-1]`` are zero padding.

The references compute in float32 (float64 when the inputs are float64, for gradcheck;
the inputs' own dtype under ``native_precision``) and return that precision. Work is split into
chunks of query tokens, each a few dense tensor ops, so memory stays bounded at long sequence
lengths without a Python loop over tokens.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

# Elements of the largest intermediate a chunk may build (2**26 fp32 = 256 MiB).
CHUNK_BUDGET = 1 << 26


_NATIVE_PRECISION = contextvars.ContextVar("fsalab_reference_native_precision", default=False)


@contextlib.contextmanager
def native_precision():
    """Compute in the inputs' own dtype instead of fp32: what plain PyTorch would do in fp16/bf16.

    Tests use it to measure PyTorch's own error in a dtype and bound kernels' error by a multiple of it.
    """
    token = _NATIVE_PRECISION.set(True)
    try:
        yield
    finally:
        _NATIVE_PRECISION.reset(token)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    if _NATIVE_PRECISION.get() or t.dtype == torch.float64:
        return t.dtype
    return torch.float32


def query_chunks(total: int, per_token: int):
    """Query-token ranges whose intermediates stay under the chunk budget."""
    step = max(1, CHUNK_BUDGET // max(1, per_token))
    for start in range(0, total, step):
        yield start, min(total, start + step)


def finite_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v with non-finite entries zeroed, bool [..., m] True where a key's value is not finite);
    v [..., m, d]. Computed once on the keys, before any per-query gather."""
    finite = torch.isfinite(v)
    return torch.where(finite, v, torch.zeros_like(v)), ~finite.all(-1)


def softmax_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of grouped queries.

    q [c, h_kv, g, d]; k and v (finite: ``finite_values``) either shared [h_kv, m, d] or per
    query [c, h_kv, m, d]; ``bad`` [h_kv, m] or [c, h_kv, m] marks keys whose value was not
    finite; mask broadcastable to [c, h_kv, 1, m]. Returns o [c, h_kv, g, d] and lse [c, h_kv, g]
    (natural log); rows that see no key give o = 0 and lse = -inf with finite gradients.

    Masked keys are left out by selection, never by multiplying with 0: a NaN/Inf in a key or
    value a query cannot see (a later token, another sequence, padding) does not reach it; a
    query that sees a non-finite value gets NaN.
    """
    kv = "hmd" if k.dim() == 3 else "chmd"
    s = torch.einsum(f"chgd,{kv}->chgm", q, k) * scale
    if s.shape[-1] == 0:  # no keys at all (no sequence long enough to compress): o = 0, still in the graph
        return torch.einsum(f"chgm,{kv}->chgd", s, v), s.new_full(s.shape[:3], float("-inf"))
    s = s.masked_fill(~mask, float("-inf"))
    # Shift by the row max for stability; the shift is a constant of the softmax, so detaching it is exact.
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    o = torch.einsum(f"chgm,{kv}->chgd", e, v)
    o = o / torch.where(denom > 0, denom, torch.ones_like(denom))
    sees_bad = (mask & bad.unsqueeze(-2)).any(-1, keepdim=True)  # [c, h_kv, 1, 1]
    o = o.masked_fill(sees_bad, float("nan"))
    lse = (torch.log(denom) + m).squeeze(-1)
    return o, lse


def cat_chunks(parts: list[torch.Tensor], empty_shape: tuple[int, ...], like: torch.Tensor,
               dt: torch.dtype) -> torch.Tensor:
    """The chunks' results end to end, or zeros of ``empty_shape`` in ``dt`` when there was no chunk."""
    return torch.cat(parts) if parts else like.new_zeros(empty_shape, dtype=dt)
