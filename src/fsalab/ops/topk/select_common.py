"""What NSA's block-selection kernels share: the ranking keys and the running top-T (also the
decode step's, ``ops/decode/step.py``) and the prefill kernels' tile geometry
(``block_select``'s Triton kernel and ``block_select_gluon``'s Gluon one, which calls these
``@triton.jit`` helpers as well).

Keys: a block's score and index packed into one int32, so that "larger key" is "larger score,
then lower block" and a top-T is a top-T of integers; forced blocks rank on top (+inf score).
Tiles: BLOCK_T tokens of one sequence per program, never straddling sequences, and the score
loop's chunks in three ranges.
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
    Half the width of an (fp32 bits << 32 | ~block) int64 key, so each compare-exchange of the
    top-T merge, most of the selection's instructions, works on one register instead of two
    (docs/performance.md, "Top-T selection")."""
    bits = score.to(tl.int32, bitcast=True)
    e = bits >> 23
    v = tl.where(e < 103, 0, ((e - 103) << 23) | (bits & 0x7FFFFF))
    v = tl.where((e >= 255) | (v > 0x0FFFFFFF), 0x0FFFFFFF, v)
    return ((v >> (kb - 3)) << kb) | (((1 << kb) - 1) - blk)


@triton.jit
def forced_score(score, blk, own, INIT: tl.constexpr, LOCAL: tl.constexpr):
    """NSA's forced blocks ranked above every score: block blk's score, or +inf where blk is one of
    the INIT first blocks or of the LOCAL blocks ending at own (the token's own block). The
    forcing rule of prefill and decode alike."""
    return tl.where((blk < INIT) | (blk > own - LOCAL), float("inf"), score)


@triton.jit
def key_block(key, kb):
    """The block index a ``block_key`` key holds."""
    mask = (1 << kb) - 1
    return mask - (key & mask)


@triton.jit
def sequence_tile(pid, cu_ptr, cuc_ptr, batch, steps, BLOCK_T: tl.constexpr):
    """(start, n, t0, c_start, n_cmp) of program pid's tile: its sequence's first token and length,
    the tile's first local position, its sequence's first compressed row and their count.
    Sequence b owns tiles [b + cu[b] // BLOCK_T, b + 1 + cu[b+1] // BLOCK_T) (binary lifting over
    the batch; ``steps`` = ``_triton.search_steps(batch)``)."""
    lo = pid * 0
    for it in range(steps):
        cand = lo + (1 << (steps - 1 - it))
        ok = cand < batch
        go = ok & (cand + tl.load(cu_ptr + cand, mask=ok, other=0) // BLOCK_T <= pid)
        lo = tl.where(go, cand, lo)
    start = tl.load(cu_ptr + lo)
    n = tl.load(cu_ptr + lo + 1) - start
    t0 = (pid - lo - start // BLOCK_T) * BLOCK_T
    c_start = tl.load(cuc_ptr + lo)
    return start, n, t0, c_start, tl.load(cuc_ptr + lo + 1) - c_start


@triton.jit
def chunk_ranges(t0, n, BLOCK_T: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr, BLOCK_C: tl.constexpr,
                 L: tl.constexpr, S: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr):
    """(head_end, bulk_end, n_chunks) of the tile at t0: its score loop walks chunks [0, n_chunks)
    of BB blocks (BLOCK_C compressed tokens); [head_end, bulk_end) are those that every row of
    the tile sees whole and that hold no forced (init or local) and no future block, which run
    without masks: between the init blocks' chunks and those of the tile's diagonal."""
    last_own = (tl.minimum(t0 + BLOCK_T, n) - 1) // BS
    n_chunks = tl.where(t0 < n, last_own // BB + 1, 0)
    own0 = t0 // BS
    n_vis0 = tl.where(t0 >= L - 1, (t0 - (L - 1)) // S + 1, 0)
    head_end = tl.minimum((INIT + BB - 1) // BB, n_chunks)
    bulk_end = tl.maximum(head_end, tl.minimum(tl.minimum(n_vis0 // BLOCK_C, tl.maximum(own0 - LOCAL + 1, 0) // BB),
                                               n_chunks))
    return head_end, bulk_end, n_chunks


@triton.jit
def store_ascending(out, run, kb, ok, TOPK: tl.constexpr, T_P: tl.constexpr):
    """Rows' top TOPK blocks from their ascending key runs (run [rows, T_P], the top TOPK in the
    last columns, empty slots negative) to out [rows, 1] + [0, TOPK), ascending by block, -1
    after: a chosen block goes to slot (number of chosen blocks below it). Rows where ok is
    False are not written."""
    col = tl.arange(0, T_P)
    chosen = (col[None, :] >= T_P - TOPK) & (run >= 0)
    blocks = tl.where(chosen, key_block(run, kb), 0x7FFFFFFF)
    rank = tl.sum((blocks[:, None, :] < blocks[:, :, None]).to(tl.int32), axis=2)
    n_chosen = tl.sum(chosen.to(tl.int32), axis=1)
    tl.store(out + rank, blocks, mask=ok & chosen)
    pad = (col[None, :] >= n_chosen[:, None]) & (col[None, :] < TOPK)
    tl.store(out + col[None, :], tl.zeros_like(run) - 1, mask=ok & pad)


@triton.jit
def empty_run(ROWS: tl.constexpr, T_P: tl.constexpr):
    """[ROWS, T_P] ascending run of T_P distinct negative keys (empty slots, above KEY_NONE)."""
    col = tl.arange(0, T_P)
    return (col[None, :] - 2 - T_P) + tl.zeros([ROWS, T_P], dtype=tl.int32)


@triton.jit
def merge_topk(run, cand, T_P: tl.constexpr):
    """The T_P largest of run [rows, T_P] (ascending) and candidate keys [rows, BB], ascending.

    Branch-free, so a tile costs the same whatever its scores: the candidates' top T_P, sorted
    descending (``tl.topk``: a bitonic sort, or a bitonic top-k when BB > T_P), meet the ascending
    run element-wise; the larger of each pair form a bitonic row that holds the top T_P, which
    one bitonic merge sorts (``tl.bitonic_merge``: log2 T_P compare-exchange passes, where a
    second ``tl.sort`` took 1 + 2 + ... + log2 T_P). A data-dependent insertion loop and a
    hand-written bitonic merge of reshapes and permutes were both slower (docs/performance.md).
    """
    return tl.bitonic_merge(tl.maximum(run, tl.topk(cand, T_P)))
