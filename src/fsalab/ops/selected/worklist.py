"""Work lists over CSR rows, built by two small Triton kernels (no torch op chains, no host sync).

A work list gives each CSR row of a ``SelectionIndex`` a number of items (programs of a later
launch) from its length: ``first`` [rows + 1] is the exclusive scan of the item counts and
``item_row`` / ``item_sub`` map every item to its row and its index in the row, so a launch of
one program per item has no idle programs. Both FSA (work lists, split-row slots, the paper's
longest row) and NSA (the extra segments of long rows) plan their KV-block-outer launches with:

- ``scan_rows``: one program scans the rows in chunks (the row counts are small: h_kv x blocks)
  and writes up to two exclusive scans of per-row counts and the longest non-sink row;
- ``row_items``: item -> row by a binary search per item in ``first`` (and its index in the row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import scratch
from .._triton import cdiv, search_steps
from ._search import count_below

# Per-row counts of scan_rows, for a row of len entries and items of per_item entries:
NONE = tl.constexpr(0)  # no scan
ITEMS = tl.constexpr(1)  # ceil(len / per_item): the row's items (0 for an empty row)
ITEMS_MIN_ONE = tl.constexpr(2)  # max(ceil(len / per_item), 1): empty rows still get one item
SPLIT = tl.constexpr(3)  # ceil(len / per_item) where > 1, else 0: one slot per item of split rows
EXTRA = tl.constexpr(4)  # max(ceil(len / per_item) - 1, 0): the items beyond a row's first

_SCAN_BLOCK = 1024
_ITEM_BLOCK = 1024


@triton.jit
def _row_count(lens, mask, per_item, RULE: tl.constexpr):
    n = (lens + per_item - 1) // per_item
    if RULE == ITEMS_MIN_ONE:
        n = tl.maximum(n, 1)
    if RULE == SPLIT:
        n = tl.where(n > 1, n, 0)
    if RULE == EXTRA:
        n = tl.maximum(n - 1, 0)
    return tl.where(mask, n, 0)


@triton.jit
def _row_scan_kernel(
    row_ptr, rows, per_item, first, second, blk_local, cap, max_rest,
    FIRST: tl.constexpr, SECOND: tl.constexpr, MAX_REST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: first / second [rows + 1] = exclusive scans of the FIRST / SECOND counts;
    max_rest [] = longest row whose block is not its sequence's first (MAX_REST)."""
    carry1 = tl.zeros([], tl.int32)
    carry2 = tl.zeros([], tl.int32)
    best = tl.zeros([], tl.int32)
    for r0 in range(0, rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        mask = r < rows
        lens = tl.load(row_ptr + r + 1, mask=mask, other=0) - tl.load(row_ptr + r, mask=mask, other=0)
        if FIRST != NONE:
            n1 = _row_count(lens, mask, per_item, FIRST)
            tl.store(first + r, carry1 + tl.cumsum(n1, 0) - n1, mask=mask)
            carry1 += tl.sum(n1, 0)
        if SECOND != NONE:
            n2 = _row_count(lens, mask, per_item, SECOND)
            tl.store(second + r, carry2 + tl.cumsum(n2, 0) - n2, mask=mask)
            carry2 += tl.sum(n2, 0)
        if MAX_REST:
            local = tl.load(blk_local + r % cap, mask=mask, other=0)
            best = tl.maximum(best, tl.max(tl.where(local >= 1, lens, 0), 0))
    if FIRST != NONE:
        tl.store(first + rows, carry1)
    if SECOND != NONE:
        tl.store(second + rows, carry2)
    if MAX_REST:
        tl.store(max_rest, best)


@triton.jit
def _items_kernel(first, rows, n_items, steps, item_row, item_sub, WITH_SUB: tl.constexpr, BLOCK: tl.constexpr):
    """item_row[i] = rows r with first[r + 1] <= i (rows for items past the last row's);
    item_sub[i] = i - first[item_row[i]] (WITH_SUB)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n_items
    row = count_below(first + 1, rows, i, steps, True)
    tl.store(item_row + i, row, mask=mask)
    if WITH_SUB:
        sub = i - tl.load(first + tl.maximum(tl.minimum(row, rows - 1), 0), mask=mask, other=0)
        tl.store(item_sub + i, sub, mask=mask)


def scan_rows(
    row_ptr: torch.Tensor,
    per_item: int,
    first: int = 0,
    second: int = 0,
    local: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(first, second, max_rest) from one launch; first/second int32 [rows + 1] are the exclusive
    scans of the per-row counts named by the rule constants (0: not computed, None returned);
    with ``local`` (int32 [capacity], block index of each global block in its sequence; rows are
    head * capacity + block), max_rest int32 [] is the longest row over non-sink blocks."""
    rows = row_ptr.numel() - 1
    device = row_ptr.device
    out1 = scratch.empty(rows + 1, torch.int32, device) if first else None
    out2 = scratch.empty(rows + 1, torch.int32, device) if second else None
    best = scratch.empty((), torch.int32, device) if local is not None else None
    dummy = row_ptr  # never touched: the matching switch is off
    cap = 1 if local is None else max(local.numel(), 1)
    _row_scan_kernel[(1,)](
        row_ptr, rows, per_item, dummy if out1 is None else out1, dummy if out2 is None else out2,
        dummy if local is None else local, cap, dummy if best is None else best,
        FIRST=first, SECOND=second, MAX_REST=local is not None, BLOCK=_SCAN_BLOCK, num_warps=8,
    )  # fmt: skip
    return out1, out2, best


def row_items(first: torch.Tensor, n_items: int, with_sub: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(item_row, item_sub) int32 [n_items] of the scan ``first`` [rows + 1]; items past
    first[rows] get row = rows (and an unused sub)."""
    rows = first.numel() - 1
    item_row = scratch.empty(n_items, torch.int32, first.device)
    item_sub = scratch.empty(n_items, torch.int32, first.device) if with_sub else None
    if n_items > 0:
        _items_kernel[(cdiv(n_items, _ITEM_BLOCK),)](
            first, rows, n_items, search_steps(rows), item_row, item_row if item_sub is None else item_sub,
            WITH_SUB=with_sub, BLOCK=_ITEM_BLOCK, num_warps=4,
        )
    return item_row, item_sub
