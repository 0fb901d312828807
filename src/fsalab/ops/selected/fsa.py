"""FSA selected attention (KV-block-outer loop order), forward and backward, two variants.

``selected_attention_fsa_paper`` follows the FSA paper (§3.1-3.2, App. E):
  forward  (i) softmax statistics: per (token, block) entry the block's log-sum-exp (no V),
           merged per token into its lse;  (ii) the main kernel: one program per (query head,
           KV block, range of selecting tokens), K/V loaded once, tokens gathered in batches of
           B_Q through the index lists, partials already normalised by the precomputed lse and
           written to a compact buffer with one row per (token, block) entry;  (iii) a
           reduction that sums each token's T partials, without atomics.  ``inner_loop`` (8
           query batches per program, else one) and ``early_return`` switch the paper's two
           optimisations for its ablation (Fig. 9).
  backward dq partials (same grid and switches) + reduction; dK/dV block-major without atomics
           (the paper's code reuses NSA-ref's kernel, one program per (query head, block); here
           one per (KV head, block) for all g heads, long rows split, as in ``fsa``);
           delta = rowsum(o * dO) - dlse.

``selected_attention_fsa`` keeps the loop order and removes what the paper pays for: each
entry stores its block's own (normalised o, lse) and the reduction merges them by log-sum-exp
(no statistics pass); the g heads of a group share each K/V load (MMA rows = tokens x heads);
programs come from a work list (no idle programs); the backward computes dK/dV and the dq
partials in one pass, splitting long rows (the sink block) over several programs.

Both take q [total, h, d], k/v [total, h_kv, d] (fp16/bf16/fp32, d <= 256, h / h_kv <= 16),
block_idx int32 [total, h_kv, topk] (local block ids, ascending, -1 padding), cu_seqlens int32
[batch + 1], block_size a power of two >= 16 (inputs are validated by
``selected.selected_attention``, as for the NSA kernel), and return o [total, h, d]
(q's dtype) and lse [total, h] (fp32, natural log; -inf for tokens with no selected block).
Partial outputs are kept in q's dtype (normalised, so bounded by max |v|), as are the fused
backward's dq partials (summed in fp32 by the merge); the dq partials of the paper's backward
and of the over-budget fallback (``_dq_by_chunks``), and the dK/dV accumulators, in fp32.
Heads are processed in chunks whose partial buffers fit max(g, ``fsa_plan.MIN_BUDGET_HEADS``) x
``fsa_plan.BUFFER_BUDGET_BYTES``.
No host synchronisation: every grid and buffer is sized from shapes and the index lists are
built on device once per forward and reused by the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...checks import check_kernel_call
from .. import scratch
from .._triton import LOG2E, cdiv, next_pow2
from ..library import grads_like, lse_like, op_or
from . import fsa_plan as plan
from .fsa_bwd import _delta_kernel, _dkdv_kernel, _dkdv_merge_kernel
from .fsa_partials import (
    DQ,
    FAST,
    LSE,
    LSE_ONLY,
    PAPER,
    STATS,
    SUM,
    _merge_kernel,
    _nonfinite_blocks_kernel,
    _partial_kernel,
)
from .index import SelectionIndex, build_selection_index, empty_index


@dataclass
class _Problem:
    """Inputs of one call (contiguous) plus everything derived from shapes and the index."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    index: SelectionIndex
    block_size: int
    scale: float

    @property
    def total(self) -> int:
        return self.q.shape[0]

    @property
    def h(self) -> int:
        return self.q.shape[1]

    @property
    def h_kv(self) -> int:
        return self.k.shape[1]

    @property
    def g(self) -> int:
        return self.h // self.h_kv

    @property
    def d(self) -> int:
        return self.q.shape[2]

    @property
    def D(self) -> int:
        return max(16, next_pow2(self.d))

    @property
    def topk(self) -> int:
        return self.index.slot_pos.shape[2]

    @property
    def cap(self) -> int:
        return self.index.block_capacity

    @property
    def prec(self) -> str:
        return "ieee" if self.q.dtype == torch.float32 else "tf32"

    def entries(self, n_kv: int) -> int:
        """Upper bound on the entries of n_kv KV heads."""
        return self.total * self.topk * n_kv

    def partial_bytes(self, itemsize: int, with_lse: bool) -> int:
        """Bytes of one query head's partial buffer (``fsa_plan.partial_bytes``)."""
        return plan.partial_bytes(self.total, self.topk, self.d, itemsize, with_lse)


def _strides(pb: _Problem) -> tuple[int, ...]:
    return pb.q.stride(0), pb.q.stride(1), pb.k.stride(0), pb.k.stride(1), pb.h


def _nonfinite_blocks(pb: _Problem) -> torch.Tensor:
    """int32 [h_kv * cap]: 1 for the CSR rows (KV head, block) whose values hold a NaN or Inf."""
    flags = scratch.empty(pb.h_kv * pb.cap, torch.int32, pb.q.device)
    _nonfinite_blocks_kernel[(pb.cap, pb.h_kv)](
        pb.v, pb.index.block_start, pb.index.block_len, flags, pb.cap, pb.v.stride(0), pb.v.stride(1), pb.d,
        BLOCK_N=min(64, pb.block_size), D=pb.D,
    )
    return flags


def _launch_partial(pb, chunk, tiles, mode, obuf, lbuf, *, work=None, paper_switches=None, do=None, lse=None, delta=None,
                    v_bad_rows=None):
    """Run _partial_kernel over one chunk: from a work list, or on the paper's grid. PAPER and
    FAST take ``v_bad_rows`` (``_nonfinite_blocks``) and launch twice: plain, then the containing
    pass over the flagged rows, on a grid of rows x head programs (not the plain grid)."""
    ix = pb.index
    G = tiles.block_m // tiles.tok
    r_begin, r_end = chunk.hk0 * pb.cap, (chunk.hk0 + chunk.n_kv) * pb.cap
    if work is not None:
        grid, n_sub, hp, early = work.grid(pb.entries(chunk.n_kv), r_end - r_begin), 1, 1, True
        first, item_row, item_sub, max_rest = work.first, work.item_row, work.item_sub, ix.row_ptr
    else:
        early, max_rest = paper_switches
        n_sub = cdiv(pb.total, tiles.tok * tiles.num_mt)
        hp = chunk.heads // G
        grid = (r_end - r_begin) * hp * n_sub
        first = item_row = item_sub = ix.row_ptr
    dummy = pb.q
    for contain in (False, True) if v_bad_rows is not None else (False,):
        if contain:  # one program per (row, head program), walking the row's token ranges itself
            grid = (r_end - r_begin) * hp
        _partial_kernel[(grid,)](
            pb.q, pb.k, pb.v, dummy if do is None else do, dummy if lse is None else lse,
            dummy if delta is None else delta, dummy if obuf is None else obuf, dummy if lbuf is None else lbuf,
            dummy if v_bad_rows is None else v_bad_rows,
            ix.row_ptr, ix.token_ids, ix.block_start, ix.block_len, ix.block_local,
            first, item_row, item_sub, max_rest,
            *_strides(pb),
            r_begin, r_end, pb.cap, pb.g, chunk.j0, chunk.heads, n_sub, pb.d, pb.scale * LOG2E, pb.scale,
            HP=hp, G=G, TOK=tiles.tok, BLOCK_M=tiles.block_m, NUM_MT=tiles.num_mt,
            BLOCK_N=tiles.block_n, NUM_KT=cdiv(pb.block_size, tiles.block_n), D=pb.D,
            MODE=mode, TABLE=work is not None, EARLY_RETURN=early, PREC=pb.prec, CONTAIN=contain,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )


def _launch_merge(pb, chunk, mode, obuf, lbuf, out, lse_out):
    """Merge the chunk's partials per (token, head) into out [total, h, d] and/or lse_out [total, h]
    (LSE_ONLY: lse_out, and out [total, h] fp32 gets the same log-sum-exp in log2 units)."""
    G = chunk.heads
    # Rows (token-major x G heads) per program, 4 warps, the fastest of the merge tiles timed alone
    # (docs/performance.md, "FSA's partials and merge"): 128 rows for 2 <= G < 8, where the dq SUM
    # and the forward's LSE merge both gain over 64; 64 at G = 1 and 32 from G = 8 on, where 128
    # rows take up to twice as long in the dq merge.
    block_r = 64 if G == 1 else 128 if G < 8 else max(32, next_pow2(G))
    tok = block_r // G
    dummy = pb.q
    _merge_kernel[(cdiv(pb.total, tok), chunk.n_kv)](
        dummy if obuf is None else obuf, dummy if lbuf is None else lbuf, pb.index.slot_pos, pb.index.row_ptr,
        dummy if out is None else out, dummy if lse_out is None else lse_out,
        pb.total, pb.h_kv, pb.topk, chunk.hk0, chunk.hk0 * pb.cap, pb.g, chunk.j0, pb.d,
        pb.q.stride(0), pb.q.stride(1), pb.h,
        G=G, TOK=tok, BLOCK_R=block_r, TOPK_P=next_pow2(pb.topk), D=pb.D, MODE=mode, num_warps=4,
    )


def _chunk_buffers(pb, chunks, dtype, with_lse: bool):
    """Partial buffers ([rows, d] in dtype, and [rows] fp32 lse) sized for the largest chunk
    (rows = entries x heads), reused by every chunk."""
    rows = max(pb.entries(c.n_kv) * c.heads for c in chunks)
    obuf = scratch.empty(rows * pb.d, dtype, pb.q.device)
    lbuf = scratch.empty(rows, torch.float32, pb.q.device) if with_lse else None
    return obuf, lbuf


def _work(pb: _Problem, tiles: plan.Tiles, cache: dict) -> plan.WorkList:
    """The work list of NUM_MT tiles per item (chunks with the same item size share one)."""
    per_item = tiles.tok * tiles.num_mt
    if per_item not in cache:
        cache[per_item] = plan.work_list(pb.index.row_ptr, pb.entries(pb.h_kv), per_item, min_one=False)
    return cache[per_item]


def _forward_fast(pb: _Problem):
    o = torch.empty_like(pb.q)
    lse = torch.empty(pb.total, pb.h, dtype=torch.float32, device=pb.q.device)
    chunks = plan.pow2_chunks(plan.head_chunks(pb.h_kv, pb.g, pb.partial_bytes(pb.q.element_size(), True)))
    obuf, lbuf = _chunk_buffers(pb, chunks, pb.q.dtype, True)
    works: dict = {}
    v_bad_rows = _nonfinite_blocks(pb)
    for c in chunks:
        tiles = plan.fwd_tiles(c.heads, pb.D, pb.block_size, paper=False)
        _launch_partial(pb, c, tiles, FAST, obuf, lbuf, work=_work(pb, tiles, works), v_bad_rows=v_bad_rows)
        _launch_merge(pb, c, LSE, obuf, lbuf, o, lse)
    return o, lse


def _paper_switches(pb: _Problem, early_return: bool):
    """(EARLY_RETURN, pointer to the masked range's end) of the paper's grid launches."""
    if early_return:
        return True, pb.index.row_ptr
    return False, plan.max_rest_len(pb.index)


def _forward_paper(pb: _Problem, inner_loop: bool, early_return: bool):
    o = torch.empty_like(pb.q)
    lse = torch.empty(pb.total, pb.h, dtype=torch.float32, device=pb.q.device)
    chunks = plan.head_chunks(pb.h_kv, pb.g, pb.partial_bytes(pb.q.element_size(), True))
    obuf, lbuf = _chunk_buffers(pb, chunks, pb.q.dtype, True)
    switches = _paper_switches(pb, early_return)
    tiles = plan.fwd_tiles(1, pb.D, pb.block_size, paper=True, inner_loop=inner_loop)
    v_bad_rows = _nonfinite_blocks(pb)
    # The PAPER pass reads the statistics' log-sum-exp in log2 units, as the merge computed it:
    # through the natural-log lse it would carry two more roundings of a value as large as the
    # largest logit into every p, and through o's error into delta and the gradients
    # (test_fsa_large_logits at FSALAB_SEED=1674444779 exceeds the fp32 dq bound without it).
    lse2 = scratch.empty(lse.shape, lse.dtype, lse.device)
    for c in chunks:
        _launch_partial(pb, c, tiles, STATS, None, lbuf, paper_switches=switches)
        _launch_merge(pb, c, LSE_ONLY, None, lbuf, lse2, lse)
        _launch_partial(pb, c, tiles, PAPER, obuf, None, paper_switches=switches, lse=lse2, v_bad_rows=v_bad_rows)
        _launch_merge(pb, c, SUM, obuf, None, o, None)
    return o, lse


def _delta(o, do, dlse):
    """delta [total, h] fp32 = rowsum(o * dO) - dlse."""
    total, h, d = o.shape
    delta = scratch.empty((total, h), torch.float32, o.device)
    _delta_kernel[(cdiv(total * h, 64),)](
        o, do, delta if dlse is None else dlse, delta, total * h, d,
        HAS_DLSE=dlse is not None, BLOCK=64, D=max(16, next_pow2(d)), num_warps=4,
    )
    return delta


def _launch_dkdv(pb, chunk, tiles, do, lse, delta, dk, dv, work, dkp, dvp, dqbuf=None):
    """dK/dV of the chunk's KV heads (all g heads of each group) from the split-row work list,
    then the merge of split rows. With dqbuf, also the chunk's dq partials (fused)."""
    ix = pb.index
    r_begin, r_end = chunk.hk0 * pb.cap, (chunk.hk0 + chunk.n_kv) * pb.cap
    num_kt = cdiv(pb.block_size, tiles.block_n)
    kt_programs = 1 if dqbuf is not None else num_kt  # dK/dV alone: one program per key sub-tile
    g_hi, g_lo = plan.head_parts(pb.g)
    _dkdv_kernel[(work.grid(pb.entries(chunk.n_kv), r_end - r_begin), kt_programs)](
        pb.q, pb.k, pb.v, do, lse, delta, dk, dv, pb.q if dqbuf is None else dqbuf, dkp, dvp,
        ix.row_ptr, ix.token_ids, ix.block_start, ix.block_len,
        work.first, work.item_row, work.item_sub, work.slots,
        *_strides(pb),
        r_begin, r_end, pb.cap, pb.g, pb.d, pb.block_size, pb.scale * LOG2E, pb.scale,
        G=pb.g, G_HI=g_hi, G_LO=g_lo, G_LO_P=next_pow2(g_lo), PER_ITEM=work.per_item,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, NUM_KT=num_kt, D=pb.D, FUSED_DQ=dqbuf is not None, PREC=pb.prec,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    _dkdv_merge_kernel[(r_end - r_begin, num_kt)](
        dkp, dvp, dk, dv, ix.row_ptr, work.slots, ix.block_start, ix.block_len,
        pb.k.stride(0), pb.k.stride(1), r_begin, pb.cap, work.per_item, pb.block_size, pb.d,
        BLOCK_N=tiles.block_n, D=pb.D, num_warps=4,
    )


def _split_work(pb, chunks, tiles):
    """Work list splitting long rows for dK/dV (with its slot offsets) and fp32 slot buffers."""
    n_kv = max(c.n_kv for c in chunks)
    per_item = tiles.tok * plan.split_tiles(tiles.tok, pb.entries(n_kv), pb.block_size, pb.d)
    work = plan.work_list(pb.index.row_ptr, pb.entries(pb.h_kv), per_item, min_one=True, split_slots=True)
    n_slots = 2 * pb.entries(n_kv) // per_item + 1
    dkp = scratch.empty(n_slots * pb.block_size * pb.d, torch.float32, pb.q.device)
    return work, dkp, scratch.empty(dkp.shape, dkp.dtype, dkp.device)


def _dkdv_all_heads(pb, do, lse, delta, dk, dv):
    """dK/dV alone, every KV head in one launch (no dq buffer to bound)."""
    everything = [plan.Chunk(0, pb.h_kv, 0, pb.g)]
    tiles = plan.bwd_tiles(pb.g, pb.D, pb.block_size)
    _launch_dkdv(pb, everything[0], tiles, do, lse, delta, dk, dv, *_split_work(pb, everything, tiles))


def _dq_by_chunks(pb, do, lse, delta, dq, paper_switches=None, inner_loop=True):
    """dq partials (_partial_kernel, DQ mode) and their sum, by head chunks: the paper's grid
    (one query head per program) with paper_switches, else work lists over grouped heads."""
    chunks = plan.head_chunks(pb.h_kv, pb.g, pb.partial_bytes(4, False))
    dqbuf, _ = _chunk_buffers(pb, chunks, torch.float32, False)
    works: dict = {}
    for c in chunks:
        if paper_switches is not None:
            tiles = plan.fwd_tiles(1, pb.D, pb.block_size, paper=True, dq=True, inner_loop=inner_loop)
            _launch_partial(pb, c, tiles, DQ, dqbuf, None, paper_switches=paper_switches, do=do, lse=lse, delta=delta)
        else:
            tiles = plan.fwd_tiles(c.heads, pb.D, pb.block_size, paper=False, dq=True)
            _launch_partial(pb, c, tiles, DQ, dqbuf, None, work=_work(pb, tiles, works), do=do, lse=lse, delta=delta)
        _launch_merge(pb, c, SUM, dqbuf, None, dq, None)


def _fused_dq_dtype(pb: _Problem) -> torch.dtype:
    """Element type of the fused backward's dq partials: q's own. Each partial is rounded once to
    the dtype dq is returned in (error <= u * sum_t |dq_t| against u * |sum_t dq_t| for the final
    rounding; the merge sums in fp32), which halves the bytes the dK/dV pass writes and the merge
    reads at fp16/bf16 (N·h·T·d·2 bytes instead of N·h·T·d·4)."""
    return pb.q.dtype


def _backward_fast(pb: _Problem, o, lse, do, dlse):
    delta = _delta(o, do, dlse)
    dq, dk, dv = torch.empty_like(pb.q), torch.empty_like(pb.k), torch.empty_like(pb.v)
    dq_dtype = _fused_dq_dtype(pb)
    per_head = pb.partial_bytes(dq_dtype.itemsize, False)
    if not plan.fits_whole_groups(per_head):
        # A group's dq partials exceed the budget: dK/dV for all heads at once, dq by head chunks.
        _dkdv_all_heads(pb, do, lse, delta, dk, dv)
        _dq_by_chunks(pb, do, lse, delta, dq)
        return dq, dk, dv
    # One pass: dK/dV of whole KV heads and the dq partials of all their heads.
    chunks = plan.head_chunks(pb.h_kv, pb.g, per_head, allow_partial_groups=False)
    dqbuf, _ = _chunk_buffers(pb, chunks, dq_dtype, False)
    tiles = plan.bwd_tiles(pb.g, pb.D, pb.block_size)
    split = _split_work(pb, chunks, tiles)
    for c in chunks:
        _launch_dkdv(pb, c, tiles, do, lse, delta, dk, dv, *split, dqbuf=dqbuf)
        _launch_merge(pb, c, SUM, dqbuf, None, dq, None)
    return dq, dk, dv


def _backward_paper(pb: _Problem, o, lse, do, dlse, inner_loop: bool, early_return: bool):
    """dq partials on the paper's grid (with its switches) + reduction; dK/dV block-major. (The
    paper's code reuses NSA-ref's dK/dV kernel, one program per (query head, block) walking all
    of the block's tokens; here all g heads share a program and long rows are split, as in fsa.)"""
    delta = _delta(o, do, dlse)
    dq, dk, dv = torch.empty_like(pb.q), torch.empty_like(pb.k), torch.empty_like(pb.v)
    _dq_by_chunks(pb, do, lse, delta, dq, _paper_switches(pb, early_return), inner_loop)
    _dkdv_all_heads(pb, do, lse, delta, dk, dv)
    return dq, dk, dv


def forward_pass(q, k, v, block_idx, cu_seqlens, block_size, scale, index):
    """(o, lse) of the fast FSA forward, no autograd; contiguous inputs, float ``scale``,
    ``index`` = ``build_selection_index(block_idx, cu_seqlens, block_size)`` (the signature
    ``dispatch`` composes across impls)."""
    return _forward_fast(_Problem(q, k, v, index, block_size, scale))


def backward_pass(q, k, v, o, lse, do, dlse, block_idx, cu_seqlens, block_size, scale, index):
    """(dq, dk, dv) of the fast FSA backward for any forward's (o, lse); dlse [total, h] fp32
    or None."""
    return _backward_fast(_Problem(q, k, v, index, block_size, scale), o, lse, do, dlse)


def _forward_indexed(q, k, v, block_idx, cu_seqlens, block_size, scale, paper, inner_loop, early_return):
    """(o, lse, ``SelectionIndex.tensors()``): the index lists, then the forward of the paper's
    kernels (with their switches) or the fast ones; contiguous inputs, float ``scale`` (the
    arguments of the op ``fsalab::selected_attention_fsa``)."""
    key = ("fsa.forward", *scratch.shapes(q, k, block_idx, cu_seqlens), block_size, paper, inner_loop, early_return)
    with scratch.planned(key, q.device):
        pb = _Problem(q, k, v, build_selection_index(block_idx, cu_seqlens, block_size), block_size, scale)
        o, lse = _forward_paper(pb, inner_loop, early_return) if paper else _forward_fast(pb)
    return o, lse, pb.index.tensors()


def _backward_on(do, dlse, q, k, v, o, lse, index, block_size, scale, paper, inner_loop, early_return):
    """(dq, dk, dv) of the backward of the forward's kind, on its ``SelectionIndex.tensors()``
    (the arguments of the op ``fsalab::selected_attention_fsa_backward``)."""
    pb = _Problem(q, k, v, SelectionIndex.from_tensors(index), block_size, scale)
    key = ("fsa.backward", *scratch.shapes(q, k, index[2], index[1]), dlse is None, block_size, paper, inner_loop,
           early_return)
    with scratch.planned(key, q.device):
        if paper:
            return _backward_paper(pb, o, lse, do, dlse, inner_loop, early_return)
        return _backward_fast(pb, o, lse, do, dlse)


class _FSAFunction(torch.autograd.Function):
    """(q, k, v, block_idx, cu_seqlens, block_size, scale, paper, inner_loop, early_return) ->
    (o, lse). Its ``setup`` and ``backward`` are also the autograd of the op
    ``fsalab::selected_attention_fsa`` below, which torch.compile sees in its place and which
    returns the index's tensors as well."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_indexed(*inputs)
        _FSAFunction.setup(ctx, inputs, output)
        return output[:2]

    @staticmethod
    def setup(ctx, inputs, output):
        q, k, v, _, _, *args = inputs
        o, lse, index = output
        # The index tensors are neither inputs nor outputs of the autograd graph: saved beside them.
        ctx.save_for_backward(q, k, v, o, lse, *index)
        ctx.args = args
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse, *_):  # _: the op's index outputs' gradients (None)
        q, k, v, o, lse, *index = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dlse = None if dlse is None else dlse.contiguous().float()
        dq, dk, dv = op_or("selected_attention_fsa_backward", _backward_on, do)(do, dlse, q, k, v, o, lse, index, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


# torch.compile's view of the kernels (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::selected_attention_fsa", mutates_args=())
def _selected_attention_fsa_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor,
    block_size: int, scale: float, paper: bool, inner_loop: bool, early_return: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(o, lse, the index's tensors)."""
    return _forward_indexed(q, k, v, block_idx, cu_seqlens, block_size, scale, paper, inner_loop, early_return)


@_selected_attention_fsa_op.register_fake
def _(q, k, v, block_idx, cu_seqlens, block_size, scale, paper, inner_loop, early_return):
    return q.new_empty(q.shape), lse_like(q), empty_index(block_idx, cu_seqlens, block_size).tensors()


@torch.library.custom_op("fsalab::selected_attention_fsa_backward", mutates_args=())
def _selected_attention_fsa_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, index: list[torch.Tensor], block_size: int, scale: float, paper: bool, inner_loop: bool,
    early_return: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_on(do, dlse, q, k, v, o, lse, index, block_size, scale, paper, inner_loop, early_return)


@_selected_attention_fsa_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, index, block_size, scale, paper, inner_loop, early_return):
    return grads_like(q, k, v)


_selected_attention_fsa_op.register_autograd(_FSAFunction.backward, setup_context=_FSAFunction.setup)


def _apply(q, k, v, block_idx, cu_seqlens, block_size, scale, paper: bool, inner_loop: bool, early_return: bool):
    # Shapes, dtypes and values are validated by selected.selected_attention (as for the NSA
    # kernel); only what the kernels themselves assume is checked here.
    check_kernel_call(q.device, block_size, "the FSA kernels")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse = op_or("selected_attention_fsa", _FSAFunction.apply)(q, k, v, block_idx, cu_seqlens, block_size, scale,
                                                                 paper, inner_loop, early_return)[:2]
    return o, lse


def selected_attention_fsa_paper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    inner_loop: bool = True,
    early_return: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FSA paper's kernels (statistics, main, reduction); see the module docstring.

    inner_loop=False: one program per query batch; early_return=False: programs run the
    longest row's range, masked (the paper's Fig. 9 ablation). Returns (o, lse).
    """
    return _apply(q, k, v, block_idx, cu_seqlens, block_size, scale, True, bool(inner_loop), bool(early_return))


def selected_attention_fsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FSA loop order with log-sum-exp merged partials, grouped heads and a fused backward."""
    return _apply(q, k, v, block_idx, cu_seqlens, block_size, scale, False, True, True)
