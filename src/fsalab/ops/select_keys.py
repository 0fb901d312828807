"""Ranking keys of NSA's top-T block selection, shared by the prefill selection kernels
(``block_select``'s Triton kernel, ``block_select_gluon``'s Gluon one) and decode's (``decode``):
a block's score and index packed into one int32, so that "larger key" is "larger score, then
lower block" and a top-T is a top-T of integers.
"""

from __future__ import annotations

import triton
import triton.language as tl

KEY_NONE = tl.constexpr(-(2**30))  # below every key and every empty slot: never kept


@triton.jit
def key_bits(own):
    """KB, the bits a ranking key gives the block index: bit_length(own), at least 3 (read from
    own's fp32 exponent; own < 2^24). Keys depend on a token's position only, so prefill and decode
    rank alike, and nothing recompiles per length."""
    return tl.maximum((own.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 3)


@triton.jit
def block_key(score, blk, kb):
    """int32 ranking key of block blk (0 <= blk < 2^kb) with score >= +0: larger key = larger score,
    then lower block. The score's fp32 exponent window [2^-24, 2^8) as 5 bits (below: 0; inf, NaN
    and above: the top value, which forced blocks' +inf use) and its 23 mantissa bits, shifted
    right by kb - 3, then 2^kb - 1 - blk in the low kb bits. A score keeps 26 - kb mantissa bits
    (64K tokens in blocks of 64: 16 bits, relative step 1.5e-5); scores closer than that tie and
    the lower block wins. Block scores are sums of at most g * l/s probabilities, far below 2^8.
    Half the width of an (fp32 bits << 32 | ~block) int64 key: the top-T merge, most of the
    selection's instructions, ran 10 % faster at 64K on the H200 (docs/perf-log.md)."""
    bits = score.to(tl.int32, bitcast=True)
    e = bits >> 23
    v = tl.where(e < 103, 0, ((e - 103) << 23) | (bits & 0x7FFFFF))
    v = tl.where((e >= 255) | (v > 0x0FFFFFFF), 0x0FFFFFFF, v)
    return ((v >> (kb - 3)) << kb) | (((1 << kb) - 1) - blk)


@triton.jit
def key_block(key, kb):
    """The block index a ``block_key`` key holds."""
    mask = (1 << kb) - 1
    return mask - (key & mask)
