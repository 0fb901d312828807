"""Host-side planning for the FSA kernels: work lists, head chunks, tile sizes.

Everything here is sized from shapes only (no host sync): work lists are built by the small
kernels of ``worklist`` from the CSR lists of ``index.build_selection_index`` (which also holds
the block table), one or two launches each, since short calls are bound by the host's launches.

Vocabulary (all counts in elements unless stated):
- row: one CSR row of the selection index, ``kv_head * block_capacity + global_block``; it
  lists the (token, slot) entries that selected that KV block.
- entry: one (token, KV head, slot) with a valid block; entry ``p`` is position p of token_ids.
- tile: BLOCK_M MMA rows = TOK tokens of one row x G query heads (token-major, heads inner); the
  backward's tiles hold one power-of-two part of the group's heads at a time (``head_parts``).
- item: the unit of one program of a work-list launch: up to ``per_item`` tokens of one row.
- chunk: a set of query heads whose partial buffers are alive at the same time (memory bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import cdiv, interpreting, next_pow2
from . import worklist
from .index import SelectionIndex

# Bytes of per-entry partial buffers (partial o / lse, or dq) alive at once, per query head of a
# group (the bound is max(g, MIN_BUDGET_HEADS) x this): heads are processed in chunks that fit.
# At 64K tokens, (64, 16), d = 128 a whole group fits for any g (fwd 272 MB, fp32 dq 512 MiB per
# head).
BUFFER_BUDGET_BYTES = 512 << 20
# At g = 1 the budget is that of two heads (1 GiB; index lists and outputs come on top): each
# chunk costs three launches, and short calls are bound by the host's launches. 32K runs in one
# chunk instead of two, 64K's forward in 2 instead of 4 and its fused backward in 1 instead of 2
# (tests/test_selection_fsa.py::test_head_chunks_budget). A larger budget still saves launches
# but holds several GB of partials for a few per cent of an eager call (docs/performance.md).
MIN_BUDGET_HEADS = 2
# Bytes of the fp32 dK/dV partials of rows split across several backward programs.
SPLIT_BUDGET_BYTES = 64 << 20
# Fewest tiles a backward program gets before long rows are split.
MIN_SPLIT_TILES = 16


@dataclass(frozen=True)
class WorkList:
    """Programs of a work-list launch, over all rows (any chunk takes a contiguous item range).

    first    int32 [rows + 1]: index of each row's first item (exclusive cumsum of item counts).
    item_row int32 [bound]: the row of each item.  item_sub int32 [bound]: its index in the row.
    slots    int32 [rows + 1] or None: first dK/dV partial slot of each row split over several
             items (``work_list(..., split_slots=True)``).
    per_item tokens per item.
    """

    first: torch.Tensor
    item_row: torch.Tensor
    item_sub: torch.Tensor
    slots: torch.Tensor | None
    per_item: int

    def grid(self, entries: int, rows: int) -> int:
        """Programs that cover every item of ``rows`` rows holding at most ``entries`` entries."""
        return cdiv(entries, self.per_item) + rows


def work_list(
    row_ptr: torch.Tensor, total_entries: int, per_item: int, min_one: bool, split_slots: bool = False
) -> WorkList:
    """Items of up to per_item tokens over all CSR rows (total_entries bounds row_ptr[-1]);
    with min_one, empty rows still get one item (to write zero dK/dV). Two launches.

    split_slots: also the dK/dV partial slots of rows split over several items (one per item, only
    for rows of more than one item); a chunk of rows holding E entries needs fewer than
    2 * E / per_item + 1 of them (each such row has len > per_item).
    """
    rule = worklist.ITEMS_MIN_ONE if min_one else worklist.ITEMS
    first, slots, _ = worklist.scan_rows(row_ptr, per_item, rule, worklist.SPLIT if split_slots else 0)
    bound = cdiv(total_entries, per_item) + row_ptr.numel() - 1
    item_row, item_sub = worklist.row_items(first, bound)
    return WorkList(first, item_row, item_sub, slots, per_item)


def max_rest_len(index: SelectionIndex) -> torch.Tensor:
    """0-d int32: longest row over non-sink blocks (local index >= 1). One launch.

    The paper's "no early return" ablation sizes its programs by this maximum (its grid runs the
    sink block in a launch of its own), so programs of every other row mask instead of returning.
    """
    return worklist.scan_rows(index.row_ptr, 1, local=index.block_local)[2]


@dataclass(frozen=True)
class Chunk:
    """Query heads hk * g + j0 + [0, heads) for hk in [hk0, hk0 + n_kv): either whole groups
    (j0 = 0, heads = g) of several KV heads, or part of one group (n_kv = 1)."""

    hk0: int
    n_kv: int
    j0: int
    heads: int


def head_chunks(h_kv: int, g: int, per_head_bytes: int, allow_partial_groups: bool = True) -> list[Chunk]:
    """Split the heads so that per_head_bytes * heads-in-chunk stays within
    max(g, MIN_BUDGET_HEADS) * BUFFER_BUDGET_BYTES.

    With allow_partial_groups=False a chunk always holds whole groups (at least one, even over
    budget): the fused backward needs every head of a group to finish a KV head's dK/dV.
    """
    fit = max(1, max(g, MIN_BUDGET_HEADS) * BUFFER_BUDGET_BYTES // max(1, per_head_bytes))
    if fit >= g or not allow_partial_groups:
        per = max(1, min(h_kv, fit // g))
        return [Chunk(hk, min(per, h_kv - hk), 0, g) for hk in range(0, h_kv, per)]
    parts = cdiv(g, fit)
    size = cdiv(g, parts)
    return [Chunk(hk, 1, j0, min(size, g - j0)) for hk in range(h_kv) for j0 in range(0, g, size)]


def head_parts(g: int) -> tuple[int, int]:
    """(g_hi, g_lo): a group's heads as its largest power of two and the rest (0 when g is one)."""
    g_hi = 1 << (g.bit_length() - 1)
    return g_hi, g - g_hi


def pow2_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Each chunk's heads as power-of-two parts over the same KV heads, largest first (5 = 4 + 1,
    7 = 4 + 2 + 1). A part's tiles map rows to (token, head) by shifts and hold no padding rows,
    and d = 128 gets the 128-row forward tile only at power-of-two head counts (``fwd_tiles``).
    At g = 3, 5, 6, 7 that beats one launch per chunk whose rows map to (token, head) by division
    (docs/performance.md, "Selected attention")."""
    out = []
    for c in chunks:
        j0, left = c.j0, c.heads
        while left:
            part, _ = head_parts(left)
            out.append(Chunk(c.hk0, c.n_kv, j0, part))
            j0, left = j0 + part, left - part
    return out


def partial_bytes(total: int, topk: int, d: int, itemsize: int, with_lse: bool) -> int:
    """Bytes of one query head's per-entry partials: total x topk entries of d elements of
    ``itemsize`` bytes, plus an fp32 lse each when ``with_lse`` (the forward's)."""
    return total * topk * (d * itemsize + (4 if with_lse else 0))


def fits_whole_groups(per_head_bytes: int) -> bool:
    """Whether a chunk of whole groups keeps within the budget (per query head)."""
    return per_head_bytes <= BUFFER_BUDGET_BYTES


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one kernel: BLOCK_M rows (TOK tokens x G heads), key sub-tiles of
    BLOCK_N, NUM_MT tiles per program (the paper's inner loop), warps and pipeline stages."""

    block_m: int
    tok: int
    block_n: int
    num_mt: int
    num_warps: int
    num_stages: int


def fwd_tiles(G: int, D: int, block_size: int, paper: bool, dq: bool = False, inner_loop: bool = True) -> Tiles:
    """Tiles of _partial_kernel (forward modes, or the dq mode when dq=True).

    The paper's kernel gathers B_Q queries of one head per batch (B_Q = 128 in its code, one of
    the (1, 64, 128) its profiling searches; 64 here from d = 128 on, where 128 exhausts shared
    memory) and runs 8 batches per program; ours gathers 64 rows of tokens x heads, 4 tiles per
    program; 128 rows (4 warps) at d = 128 with key sub-tiles at most 64 wide and g a power of
    two, the only case where 128 rows were faster (with 128-wide sub-tiles, at g = 5 and at d = 64
    they were slower; docs/performance.md, "Selected attention"). scripts/check_sm90_compile.py
    builds these plans for sm_90 on CPU.
    """
    num_mt = (8 if inner_loop else 1) if paper else 4
    block_n = block_size if block_size * D <= 16384 else max(16, 16384 // D)
    if interpreting():  # the interpreter pays per program: fewer, larger tiles; same loop structure
        block_m, num_mt, warps, stages = max(64, next_pow2(G)), min(num_mt, 2), 4, 1
    elif dq:
        block_m, warps, stages = (64, 8, 1) if D <= 128 else (32, 8, 1)
    elif paper:
        block_m, warps, stages = (128, 8, 2) if D <= 64 else (64, 4, 2) if D <= 128 else (32, 8, 1)
    else:
        wide = 64 < D <= 128 and block_n <= 64 and G == next_pow2(G)
        block_m, warps, stages = (128 if wide else 64, 4, 2) if D <= 128 else \
            (32, 4, 2) if block_size * D <= 16384 else (32, 8, 1)
    block_m = max(block_m, next_pow2(G))
    return Tiles(block_m, block_m // G, block_n, num_mt, warps, stages)


def bwd_tiles(G: int, D: int, block_size: int) -> Tiles:
    """dK/dV tiles: fp32 dK and dV accumulators of BLOCK_N x D each live in registers. 128 rows
    (tokens x heads) per tile up to D = 128, faster than 64 (and 64 than 32) at every g and both
    (B, T), 8 warps at d = 128, 4 at d = 64; 256 rows exceed an sm_90 block's shared memory at
    d = 128 (docs/performance.md, "Selected attention").
    The group's head parts (``head_parts``) walk the tile in turn; ``tok`` is the most tokens a
    tile of one part holds (BLOCK_M over the rest's padded head count where there is a rest), so
    items of whole tiles of it are whole tiles of either part."""
    block_n = min(block_size, 64)
    if interpreting():
        block_m, warps, stages = max(64, next_pow2(G)), 4, 1
    elif D <= 128:
        block_m, warps, stages = max(128, next_pow2(G)), (4 if D <= 64 else 8), 2
    else:
        block_m, warps, stages = max(32, next_pow2(G)), 8, 1
    g_hi, g_lo = head_parts(G)
    return Tiles(block_m, block_m // (next_pow2(g_lo) if g_lo else g_hi), block_n, 0, warps, stages)


def split_tiles(tok: int, entries: int, block_size: int, d: int) -> int:
    """Tiles per backward program: long rows (the sink block is selected by every token) are
    split so no program runs much longer than the rest, with fp32 partial dK/dV of the split
    rows within SPLIT_BUDGET_BYTES."""
    slot_bytes = block_size * d * 8
    min_tokens = cdiv(2 * entries * slot_bytes, SPLIT_BUDGET_BYTES)
    return max(MIN_SPLIT_TILES, cdiv(min_tokens, tok))
