"""Vectorised binary search for the planning kernels (one search per lane, no host sync).

``count_below(ptr, n, x, steps, INCLUSIVE)`` = #{i < n : ptr[i] < x} (``<=`` with INCLUSIVE) over
a non-decreasing int32 array, i.e. torch.searchsorted(ptr[:n], x, right=INCLUSIVE). ``steps``
must be at least ``_triton.search_steps(n)``: every step halves the open interval [lo, hi) of a lane, so
n.bit_length() steps close it for any n. The step count is a runtime argument (a loop with a
scalar bound), so new sizes never recompile a kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def count_below(ptr, n, x, steps, INCLUSIVE: tl.constexpr):
    lo = tl.zeros_like(x)
    hi = lo + n
    for _ in range(steps):
        active = lo < hi
        mid = lo + (hi - lo) // 2  # lo + hi could overflow int32 for n >= 2**30
        v = tl.load(ptr + mid, mask=active, other=0)
        if INCLUSIVE:
            right = v <= x
            left = v > x
        else:
            right = v < x
            left = v >= x
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & left, mid, hi)
    return lo
