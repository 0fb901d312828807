"""NSA's top-T block selection (``block_select.select_blocks``) as a Gluon kernel for Hopper (sm_90),
with a token's candidate row in one thread.

The Triton kernel keeps the running top-T in the MMA's register layout, where a row is spread over
four threads and the bitonic network's compare-exchanges become shuffles and selects: at g = 1 those
are most of its loop (1984 SASS instructions per token and chunk at (64, 16)). Here the layouts are
explicit: per program 128 tokens of one sequence and one KV head (one warpgroup, 4 warps), or 64
tokens, each row in two threads, where that lets two programs share an SM or 128 tokens' q tiles
would not fit in shared memory (``tokens_per_program``); per chunk
of BB blocks (BB * r compressed tokens) the K chunk goes through shared memory into ``wgmma`` with
each of the group's g query heads in turn (their q tiles stay in shared memory), p = exp2(s·scale -
lse) is summed over the heads in the MMA layout, and one layout change gives each thread one token's
row: the overlap stencil, the spill's shift by one block, the keys and the bitonic merge then run in
that thread's registers (864 instructions per token and chunk in the unmasked loop at g = 1, (64, 16):
``scripts/sass_loop_count.py --kernel select_gluon --loops 2``). Programs of 64 tokens load the
next chunk's keys during this chunk's work (``prefetches``).

Same arithmetic, keys (``select_common``) and masks as the Triton kernel; the sum over heads runs in
head order, so at g > 1 near-ties may rank differently (as between the Triton kernel and the
reference). ``select_blocks`` runs it where ``preferred`` says so: an sm_90 GPU, fp16/bf16, chunks
of exactly T_P blocks (``block_select._chunk_blocks``: the paper's (64, 16) and (128, 8)), the
group's q tiles fitting in shared memory, and a group small enough that it is the faster kernel.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .._triton import LOG2E_C, interpreting, search_steps
from .select_common import KEY_NONE, block_key, chunk_ranges, forced_score, key_bits, key_block, sequence_tile

_SMEM_BUDGET = 227 * 1024  # bytes of shared memory an sm_90 block may use
_SM_SHARED = 228 * 1024  # an sm_90 SM's shared memory, shared by its resident blocks
# The largest group size at which ``auto`` picks this kernel: the largest timed, where it is still
# faster than the Triton kernel (its gain shrinks as g grows; docs/performance.md, "Top-T
# selection") and where tests/test_gpu_compression.py checks it against the reference. g = 9-12
# build but are not run on a GPU by the tests.
PREFERRED_MAX_G = 8


# --- bitonic network on [ROWS, N] with each row in one thread: register renames and min/max ----------

@gluon.jit
def _swap_bits(x, s: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    """Elements i and i ^ s of each row exchanged."""
    y = gl.permute(gl.reshape(x, [ROWS, N // (2 * s), 2, s]), [0, 1, 3, 2])
    a, b = gl.split(y)
    return gl.reshape(gl.permute(gl.join(b, a), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _cx(x, j: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    """Ascending compare-exchange of elements i and i + j in blocks of 2j."""
    y = gl.permute(gl.reshape(x, [ROWS, N // (2 * j), 2, j]), [0, 1, 3, 2])
    a, b = gl.split(y)
    return gl.reshape(gl.permute(gl.join(gl.minimum(a, b), gl.maximum(a, b)), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _flip_upper(x, s: gl.constexpr, k: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    """In each block of k elements, i and i ^ s exchanged in the upper half only."""
    y = gl.permute(gl.reshape(x, [ROWS, N // k, 2, k // 2]), [0, 1, 3, 2])
    lo, up = gl.split(y)
    up = gl.reshape(_swap_bits(gl.reshape(up, [ROWS, N // 2]), s, ROWS, N // 2), [ROWS, N // k, k // 2])
    up = gl.convert_layout(up, lo.type.layout)
    return gl.reshape(gl.permute(gl.join(lo, up), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _flip_cx(x, LK: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    """Compare-exchange of elements i and k - 1 - i in blocks of k = 2^LK (ascending): the upper half
    reversed, a compare-exchange at distance k / 2, reversed back."""
    k: gl.constexpr = 1 << LK
    for l in gl.static_range(LK - 1):
        x = _flip_upper(x, 1 << l, k, ROWS, N)
    x = _cx(x, k // 2, ROWS, N)
    for l in gl.static_range(LK - 1):
        x = _flip_upper(x, 1 << l, k, ROWS, N)
    return x


@gluon.jit
def _reverse(x, ROWS: gl.constexpr, N: gl.constexpr, LOG: gl.constexpr):
    for l in gl.static_range(LOG):
        x = _swap_bits(x, 1 << l, ROWS, N)
    return x


@gluon.jit
def _merge_run(run, cand, ROWS: gl.constexpr, N: gl.constexpr, LOG: gl.constexpr):
    """The N largest of run (ascending) and cand, ascending: cand sorted ascending (a bitonic sort),
    reversed and met element-wise with the run (a bitonic row holding the top N), then merged (log2 N
    compare-exchange passes), as ``select_common.merge_topk`` does with ``tl.topk``."""
    for lk in gl.static_range(1, LOG + 1):
        cand = _flip_cx(cand, lk, ROWS, N)
        for i in gl.static_range(lk - 1):
            cand = _cx(cand, 1 << (lk - 2 - i), ROWS, N)
    m = gl.maximum(run, _reverse(cand, ROWS, N, LOG))
    for i in gl.static_range(LOG):
        m = _cx(m, (N // 2) >> i, ROWS, N)
    return m


@gluon.jit
def _shift_one(x, carry, ROWS: gl.constexpr, N: gl.constexpr):
    """y[:, b] = x[:, b - 1], y[:, 0] = carry: y's even elements are x's odd ones shifted by one (the
    same problem at half the length), its odd elements x's even ones; register renames only."""
    if N == 1:
        return gl.convert_layout(gl.reshape(carry, [ROWS, 1]), x.type.layout)
    else:
        e, o = gl.split(gl.reshape(x, [ROWS, N // 2, 2]))
        y = _shift_one(o, carry, ROWS, N // 2)
        return gl.reshape(gl.join(gl.convert_layout(y, e.type.layout), e), [ROWS, N])


@gluon.jit
def _last(x, ROWS: gl.constexpr, N: gl.constexpr):
    """x[:, N - 1]."""
    if N == 1:
        return gl.reshape(x, [ROWS])
    else:
        _, o = gl.split(gl.reshape(x, [ROWS, N // 2, 2]))
        return _last(o, ROWS, N // 2)


# --- the kernel -------------------------------------------------------------------------------------

@gluon.jit
def _load_keys(ch, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, BLOCK_C: gl.constexpr, D: gl.constexpr,
               LD: gl.constexpr, MASKED: gl.constexpr):
    """Chunk ch's BLOCK_C compressed keys [BLOCK_C, D] of KV head kvh (MASKED: zeros past n_cmp)."""
    jj = ch * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, LD))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
    ptrs = kc_ptr + (c_start + jj).to(gl.int64)[:, None] * s_kt + kvh * s_kh + dd[None, :]
    if MASKED:
        return gl.load(ptrs, mask=(jj < n_cmp)[:, None], other=0.0)
    else:
        return gl.load(ptrs)


@gluon.jit
def _chunk(ch, run, carry, kt, q_smem, k_smem, lse_smem, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, qk_scale,
           t_ok, own, kb, t_row, nvis_row,
           G: gl.constexpr, BLOCK_T: gl.constexpr, BB: gl.constexpr, R: gl.constexpr, MP: gl.constexpr,
           D: gl.constexpr, INIT: gl.constexpr, LOCAL: gl.constexpr, T_P: gl.constexpr, LOG: gl.constexpr,
           LD: gl.constexpr, MMA: gl.constexpr, ROW: gl.constexpr, KEY: gl.constexpr, MASKED: gl.constexpr,
           PREFETCH: gl.constexpr):
    """Chunk ch (blocks ch*BB .. ch*BB + BB - 1) merged into the rows' running top-T; returns (run,
    carry) as ``block_select._merge_chunk``, whose MASKED contract it shares, and kt. PREFETCH: kt
    holds chunk ch's keys on entry and chunk ch + 1's on return (loaded during this chunk's MMAs
    and merge); else the chunk loads its own and kt passes through."""
    BLOCK_C: gl.constexpr = BB * R
    if not PREFETCH:
        kt = _load_keys(ch, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, BLOCK_C, D, LD, MASKED)
    gl.thread_barrier()  # the previous chunk's MMAs have read k_smem
    k_smem.store(kt)
    fence_async_shared()
    gl.thread_barrier()
    if PREFETCH:  # the next chunk may lie in another range or past the end: always masked
        kt = _load_keys(ch + 1, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, BLOCK_C, D, LD, True)
    zero = gl.zeros([BLOCK_T, BLOCK_C], gl.float32, MMA)
    k_t = k_smem.permute((1, 0))
    lse2 = lse_smem.index(0).load(gl.SliceLayout(1, MMA))  # dead rows: +inf, so p = 0
    p = gl.exp2(warpgroup_mma(q_smem.index(0), k_t, zero, use_acc=False) * qk_scale - lse2[:, None])
    for h in range(1, G):  # a loop, not unrolled: the heads' accumulators never live at once
        lse2 = lse_smem.index(h).load(gl.SliceLayout(1, MMA))
        p += gl.exp2(warpgroup_mma(q_smem.index(h), k_t, zero, use_acc=False) * qk_scale - lse2[:, None])
    p = gl.convert_layout(p, ROW)  # a token's row in one thread from here on
    if MASKED:
        jr = ch * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, ROW))
        p = gl.where(t_row[:, None] & (jr[None, :] < nvis_row[:, None]), p, 0.0)
    p3 = gl.reshape(p, [BLOCK_T, BB, R])
    L3: gl.constexpr = p3.type.layout
    i = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_own = gl.minimum(MP, R - i).to(gl.float32)  # cells of window bR+i inside block b
    w_spill = gl.maximum(i + MP - R, 0).to(gl.float32)  # ... inside block b+1
    own_part = gl.convert_layout(gl.sum(p3 * w_own[None, None, :], axis=2), KEY)
    spill = gl.convert_layout(gl.sum(p3 * w_spill[None, None, :], axis=2), KEY)
    score = own_part + _shift_one(spill, carry, BLOCK_T, BB)
    carry = gl.convert_layout(_last(spill, BLOCK_T, BB), gl.SliceLayout(1, KEY))
    blk = ch * BB + gl.arange(0, BB, layout=gl.SliceLayout(0, KEY))[None, :]
    if MASKED:
        score = forced_score(score, blk, own[:, None], INIT, LOCAL)
        key = gl.where(t_ok[:, None] & (blk <= own[:, None]), block_key(score, blk, kb), KEY_NONE)
    else:
        key = block_key(score, blk, kb)
    run = gl.convert_layout(_merge_run(run, key, BLOCK_T, T_P, LOG), KEY)
    return run, carry, kt


@gluon.jit
def select_kernel(
    q_ptr, kc_ptr, lse_ptr, cu_ptr, cuc_ptr, out_ptr,
    batch, steps, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_lh, s_ot, s_oh,
    G: gl.constexpr, D: gl.constexpr, L: gl.constexpr, S: gl.constexpr, BS: gl.constexpr, TOPK: gl.constexpr,
    T_P: gl.constexpr, LOG: gl.constexpr, BB: gl.constexpr, INIT: gl.constexpr, LOCAL: gl.constexpr,
    BLOCK_T: gl.constexpr, PREFETCH: gl.constexpr,
):
    """Grid (batch + total // BLOCK_T, h_kv), 4 warps; tiles never straddle sequences (as the Triton
    kernel's). BLOCK_T = 128: a token's row per thread; 64: each row in two threads (of warps w and
    w + 2), which compute the same values (the layouts below cover 128 rows)."""
    R: gl.constexpr = BS // S
    MP: gl.constexpr = L // S
    BLOCK_C: gl.constexpr = BB * R
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_C, 16])
    ROW: gl.constexpr = gl.BlockedLayout([1, BLOCK_C], [32, 1], [4, 1], [1, 0])
    KEY: gl.constexpr = gl.BlockedLayout([1, T_P], [32, 1], [4, 1], [1, 0])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    kvh = gl.program_id(1)
    start, n, t0, c_start, n_cmp = sequence_tile(gl.program_id(0), cu_ptr, cuc_ptr, batch, steps, BLOCK_T)

    # The group's q tiles [G][BLOCK_T, D] and lse rows (log2 units; dead rows +inf) to shared memory.
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [G, BLOCK_T, D], SMEM)
    k_smem = gl.allocate_shared_memory(kc_ptr.dtype.element_ty, [BLOCK_C, D], SMEM)
    lse_smem = gl.allocate_shared_memory(gl.float32, [G, BLOCK_T], FLAT)
    pos_ld = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, LD))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
    tok_ld = (start + pos_ld).to(gl.int64)
    pos_m = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, MMA))
    tok_m = (start + pos_m).to(gl.int64)
    for h in gl.static_range(G):
        head = kvh * G + h
        q_smem.index(h).store(gl.load(q_ptr + tok_ld[:, None] * s_qt + head * s_qh + dd[None, :],
                                      mask=(pos_ld < n)[:, None], other=0.0))
        lse = gl.load(lse_ptr + tok_m * s_lt + head * s_lh, mask=pos_m < n, other=float("-inf")).to(gl.float32)
        lse_smem.index(h).store(gl.where(lse > float("-inf"), lse * LOG2E_C, float("inf")))
    fence_async_shared()

    pos = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, KEY))
    t_ok = pos < n
    own = pos // BS
    kb = key_bits(own)[:, None]
    pos_r = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ROW))
    t_row = pos_r < n
    nvis_row = gl.where(pos_r >= L - 1, (pos_r - (L - 1)) // S + 1, 0)

    col = gl.arange(0, T_P, layout=gl.SliceLayout(0, KEY))
    run = (col[None, :] - 2 - T_P) + gl.zeros([BLOCK_T, T_P], gl.int32, KEY)  # select_common.empty_run
    carry = gl.zeros([BLOCK_T], gl.float32, gl.SliceLayout(1, KEY))

    # The chunk ranges of the Triton kernel: masked, unmasked (seen whole by every row, nothing
    # forced), masked.
    head_end, bulk_end, n_chunks = chunk_ranges(t0, n, BLOCK_T, BS, BB, BLOCK_C, L, S, INIT, LOCAL)
    if PREFETCH:
        kt = _load_keys(0, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, BLOCK_C, D, LD, True)
    else:
        kt = gl.zeros([BLOCK_C, D], kc_ptr.dtype.element_ty, LD)  # unused
    for ch in range(0, head_end):
        run, carry, kt = _chunk(ch, run, carry, kt, q_smem, k_smem, lse_smem, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh,
                            qk_scale, t_ok, own, kb, t_row, nvis_row, G, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P,
                            LOG, LD, MMA, ROW, KEY, True, PREFETCH)
    for ch in range(head_end, bulk_end):
        run, carry, kt = _chunk(ch, run, carry, kt, q_smem, k_smem, lse_smem, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh,
                            qk_scale, t_ok, own, kb, t_row, nvis_row, G, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P,
                            LOG, LD, MMA, ROW, KEY, False, PREFETCH)
    for ch in range(bulk_end, n_chunks):
        run, carry, kt = _chunk(ch, run, carry, kt, q_smem, k_smem, lse_smem, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh,
                            qk_scale, t_ok, own, kb, t_row, nvis_row, G, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P,
                            LOG, LD, MMA, ROW, KEY, True, PREFETCH)

    # The rows' top TOPK blocks, ascending by block, -1 after (select_common.store_ascending).
    L3: gl.constexpr = gl.BlockedLayout([1, T_P, T_P], [32, 1, 1], [4, 1, 1], [2, 1, 0])
    chosen = (col[None, :] >= T_P - TOPK) & (run >= 0)
    blocks = gl.where(chosen, key_block(run, kb), 0x7FFFFFFF)
    b_a = gl.convert_layout(blocks, gl.SliceLayout(1, L3))
    b_b = gl.convert_layout(blocks, gl.SliceLayout(2, L3))
    rank = gl.convert_layout(gl.sum((b_a[:, None, :] < b_b[:, :, None]).to(gl.int32), axis=2), KEY)
    n_chosen = gl.sum(chosen.to(gl.int32), axis=1)
    out = out_ptr + (start + pos).to(gl.int64)[:, None] * s_ot + kvh * s_oh
    gl.store(out + rank, blocks, mask=t_ok[:, None] & chosen)
    pad = (col[None, :] >= n_chosen[:, None]) & (col[None, :] < TOPK)
    gl.store(out + col[None, :], gl.zeros_like(run) - 1, mask=t_ok[:, None] & pad)


# --- host side ----------------------------------------------------------------------------------------

@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def shared_bytes(g: int, d: int, block_c: int, block_t: int) -> int:
    """Shared memory a program of block_t tokens holds: the g q tiles, the K chunk, the lse rows,
    and 16 bytes a token that the compiler adds for the layout changes (as the sm_90 builds ask:
    51712 bytes at g = 1, d = 128, 128 tokens; 150528 at g = 8, 64 tokens;
    ``scripts/sass_loop_count.py --kernel select_gluon`` prints them, tests/test_sass_loop_count.py
    checks two)."""
    return (g * block_t + block_c) * d * 2 + g * block_t * 4 + 16 * block_t


def programs_per_sm(g: int, d: int, block_c: int, block_t: int) -> int:
    """Programs of block_t tokens that share an sm_90 SM by shared memory (each block also reserves
    1 KiB of the SM's 228 KiB)."""
    return _SM_SHARED // (shared_bytes(g, d, block_c, block_t) + 1024)


def tokens_per_program(g: int, d: int, block_c: int) -> int:
    """128 (a token per thread of the warpgroup) where two such programs share an SM, else 64 where
    two do (each token's row then in two threads, which do the same work), else the larger that
    fits alone, else 0. At d = 128: 128 for g = 1, 2, 6; 64 for g = 3-5 and 7-12. Two 64-token
    programs an SM beat one 128-token program (g = 4, 5): one warpgroup alone leaves the tensor
    cores idle during its exp2 and merge; where 128-token programs already share an SM (g = 1, 2),
    64 tokens are slower (docs/performance.md, "Top-T selection")."""
    for share in (2, 1):
        for t in (128, 64):
            if shared_bytes(g, d, block_c, t) <= _SMEM_BUDGET and programs_per_sm(g, d, block_c, t) >= share:
                return t
    return 0


def prefetches(block_t: int) -> bool:
    """Whether a program of block_t tokens loads the next chunk's keys during this chunk's MMAs and
    merge (PREFETCH): at 64 tokens, where the keys cost a thread 16 registers and the prefetch pays.
    At 128 tokens they cost 32 that the program needs elsewhere: 45 more registers at g = 1 (two
    programs an SM resident instead of three) and a spill at g = 2, for no gain."""
    return block_t == 64


def runs(q: torch.Tensor, g: int, cfg, t_pad: int, bb: int) -> bool:
    """Whether this kernel can run the selection: an sm_90 GPU (``wgmma``; not the interpreter),
    fp16/bf16, d in {64, 128, 256}, chunks of exactly T_P blocks (bb == t_pad, so a chunk's
    candidates are the merge's width) of 16..256 compressed tokens (the MMA's N), and a program's
    q tiles within an sm_90 block's shared memory (``tokens_per_program``: g <= 12 at d = 128,
    g <= 5 at d = 256)."""
    block_c = bb * cfg.block_size // cfg.kernel_stride
    return (not interpreting() and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[2] in (64, 128, 256) and bb == t_pad and 16 <= block_c <= 256
            and tokens_per_program(g, q.shape[2], block_c) > 0 and _is_sm90(q.device.index or 0))


def preferred(q: torch.Tensor, g: int, cfg, t_pad: int, bb: int) -> bool:
    """Whether ``select_blocks``'s ``auto`` picks this kernel: it runs, and g <= PREFERRED_MAX_G."""
    return g <= PREFERRED_MAX_G and runs(q, g, cfg, t_pad, bb)


def launch(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, cfg, g: int, t_pad: int, bb: int,
           qk_scale: float) -> None:
    """Fill out [total, h_kv, topk] (int32) with the selection of ``select_blocks``'s validated inputs;
    qk_scale = softmax scale · log2(e)."""
    total, batch = q.shape[0], cu_seqlens.numel() - 1
    block_c = bb * cfg.block_size // cfg.kernel_stride
    block_t = tokens_per_program(g, q.shape[2], block_c)
    select_kernel[(batch + total // block_t, k_cmp.shape[1])](
        q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, batch, search_steps(batch), qk_scale,
        q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse_cmp.stride(0), lse_cmp.stride(1),
        out.stride(0), out.stride(1),
        G=g, D=q.shape[2], L=cfg.kernel_size, S=cfg.kernel_stride, BS=cfg.block_size, TOPK=cfg.topk, T_P=t_pad,
        LOG=t_pad.bit_length() - 1, BB=bb, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, BLOCK_T=block_t,
        PREFETCH=prefetches(block_t), num_warps=4,
    )
