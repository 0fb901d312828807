"""Prototype: NSA's top-T block selection (ops/block_select.select_blocks) as a Gluon kernel whose
top-T runs with one token's row in one thread (no shuffles in the bitonic network), for g = 1 and
chunks of BB = T_P blocks (the paper's (64, 16) and (128, 8)).
Same arithmetic and keys as the Triton kernel, so the selections should be identical; the A/B
(ab_select_gluon.py) checks that on the H200 and times both.

Per program: 128 tokens of one sequence and one KV head (4 warps, one warpgroup). Per chunk of BB
blocks (BB * r compressed tokens): the K chunk goes to shared memory, QK on wgmma into an MMA
layout, p = exp2(s * scale - lse) there, then one layout change to a row per thread: the overlap
stencil, the spill's shift by one block (split/join), the keys and the merge all stay in that
thread's registers.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

# (the ranking keys moved from ops/block_select.py to ops/select_common.py after this prototype ran)
from fsalab.ops.select_common import KEY_NONE as _KEY_NONE, block_key as _block_key, key_bits as _key_bits, key_block as _key_block


# --- bitonic network on [ROWS, N] with a row in one thread ------------------------------------

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
    """Compare-exchange of elements i and k - 1 - i in blocks of k = 2^LK (ascending)."""
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
    """The N largest of run (ascending) and cand, ascending: cand sorted ascending, reversed, met
    element-wise with the run (a bitonic row holding the top N), merged."""
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


# --- the kernel -------------------------------------------------------------------------------

@gluon.jit
def _chunk(ch, run, carry, q_smem, k_smem, lse2, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, qk_scale,
           t_ok, n_vis, own, kb, t_row, nvis_row,
           BLOCK_T: gl.constexpr, BB: gl.constexpr, R: gl.constexpr, MP: gl.constexpr, D: gl.constexpr,
           INIT: gl.constexpr, LOCAL: gl.constexpr, T_P: gl.constexpr, LOG: gl.constexpr,
           LD: gl.constexpr, MMA: gl.constexpr, ROW: gl.constexpr, KEY: gl.constexpr, MASKED: gl.constexpr):
    BLOCK_C: gl.constexpr = BB * R
    # K chunk [BLOCK_C, D] -> shared memory (the previous chunk's MMA has completed: it is synchronous)
    jj = ch * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, LD))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
    ptrs = kc_ptr + (c_start + jj).to(gl.int64)[:, None] * s_kt + kvh * s_kh + dd[None, :]
    if MASKED:
        kt = gl.load(ptrs, mask=(jj < n_cmp)[:, None], other=0.0)
    else:
        kt = gl.load(ptrs)
    gl.thread_barrier()
    k_smem.store(kt)
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([BLOCK_T, BLOCK_C], gl.float32, MMA), use_acc=False)
    p = gl.exp2(acc * qk_scale - lse2[:, None])  # dead rows: lse2 = +inf
    p = gl.convert_layout(p, ROW)  # a token's row in one thread from here on
    if MASKED:
        jr = ch * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, ROW))
        p = gl.where(t_row[:, None] & (jr[None, :] < nvis_row[:, None]), p, 0.0)
    p3 = gl.reshape(p, [BLOCK_T, BB, R])
    L3: gl.constexpr = p3.type.layout
    i = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_own = gl.minimum(MP, R - i).to(gl.float32)
    w_spill = gl.maximum(i + MP - R, 0).to(gl.float32)
    own_part = gl.convert_layout(gl.sum(p3 * w_own[None, None, :], axis=2), KEY)
    spill = gl.convert_layout(gl.sum(p3 * w_spill[None, None, :], axis=2), KEY)
    score = own_part + _shift_one(spill, carry, BLOCK_T, BB)
    carry = gl.convert_layout(_last(spill, BLOCK_T, BB), gl.SliceLayout(1, KEY))
    blk = ch * BB + gl.arange(0, BB, layout=gl.SliceLayout(0, KEY))[None, :]
    if MASKED:
        forced = (blk < INIT) | (blk > own[:, None] - LOCAL)
        score = gl.where(forced, float("inf"), score)
        key = gl.where(t_ok[:, None] & (blk <= own[:, None]), _block_key(score, blk, kb), _KEY_NONE)
    else:
        key = _block_key(score, blk, kb)
    run = gl.convert_layout(_merge_run(run, key, BLOCK_T, T_P, LOG), KEY)
    return run, carry


@gluon.jit
def select_kernel_gl(
    q_ptr, kc_ptr, lse_ptr, cu_ptr, cuc_ptr, out_ptr,
    batch, steps, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_lh, s_ot, s_oh,
    G: gl.constexpr, D: gl.constexpr, L: gl.constexpr, S: gl.constexpr, BS: gl.constexpr, TOPK: gl.constexpr,
    T_P: gl.constexpr, LOG: gl.constexpr, BB: gl.constexpr, INIT: gl.constexpr, LOCAL: gl.constexpr,
    BLOCK_T: gl.constexpr,
):
    """g = 1 only (one query head per KV head): BLOCK_T = 128 tokens per program, 4 warps."""
    gl.static_assert(G == 1)
    R: gl.constexpr = BS // S
    MP: gl.constexpr = L // S
    BLOCK_C: gl.constexpr = BB * R
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_C, 16])
    ROW: gl.constexpr = gl.BlockedLayout([1, BLOCK_C], [32, 1], [4, 1], [1, 0])
    KEY: gl.constexpr = gl.BlockedLayout([1, T_P], [32, 1], [4, 1], [1, 0])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    kvh = gl.program_id(1)
    pid = gl.program_id(0)
    lo = pid * 0
    for it in range(steps):
        cand = lo + (1 << (steps - 1 - it))
        ok = cand < batch
        go = ok & (cand + gl.load(cu_ptr + cand, mask=ok, other=0) // BLOCK_T <= pid)
        lo = gl.where(go, cand, lo)
    start = gl.load(cu_ptr + lo)
    n = gl.load(cu_ptr + lo + 1) - start
    t0 = (pid - lo - start // BLOCK_T) * BLOCK_T
    c_start = gl.load(cuc_ptr + lo)
    n_cmp = gl.load(cuc_ptr + lo + 1) - c_start

    # q tile [BLOCK_T, D] -> shared memory; lse in the MMA's row layout
    pos_ld = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, LD))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
    q = gl.load(q_ptr + (start + pos_ld).to(gl.int64)[:, None] * s_qt + (kvh * G) * s_qh + dd[None, :],
                mask=(pos_ld < n)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_T, D], SMEM, q)
    k_smem = gl.allocate_shared_memory(kc_ptr.dtype.element_ty, [BLOCK_C, D], SMEM)
    pos_m = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, MMA))
    lse = gl.load(lse_ptr + (start + pos_m).to(gl.int64) * s_lt + (kvh * G) * s_lh, mask=pos_m < n,
                  other=float("-inf")).to(gl.float32)
    lse2 = gl.where(lse > float("-inf"), lse * 1.4426950408889634, float("inf"))

    pos = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, KEY))
    t_ok = pos < n
    own = pos // BS
    kb = _key_bits(own)[:, None]
    n_vis = gl.where(pos >= L - 1, (pos - (L - 1)) // S + 1, 0)
    pos_r = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ROW))
    t_row = pos_r < n
    nvis_row = gl.where(pos_r >= L - 1, (pos_r - (L - 1)) // S + 1, 0)

    col = gl.arange(0, T_P, layout=gl.SliceLayout(0, KEY))
    run = (col[None, :] - 2 - T_P) + gl.zeros([BLOCK_T, T_P], gl.int32, KEY)
    carry = gl.zeros([BLOCK_T], gl.float32, gl.SliceLayout(1, KEY))

    last_own = (gl.minimum(t0 + BLOCK_T, n) - 1) // BS
    n_chunks = gl.where(t0 < n, last_own // BB + 1, 0)
    own0 = t0 // BS
    n_vis0 = gl.where(t0 >= L - 1, (t0 - (L - 1)) // S + 1, 0)
    head_end = gl.minimum((INIT + BB - 1) // BB, n_chunks)
    bulk_end = gl.maximum(head_end, gl.minimum(gl.minimum(n_vis0 // BLOCK_C, gl.maximum(own0 - LOCAL + 1, 0) // BB),
                                               n_chunks))
    for ch in range(0, head_end):
        run, carry = _chunk(ch, run, carry, q_smem, k_smem, lse2, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, qk_scale,
                            t_ok, n_vis, own, kb, t_row, nvis_row, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P, LOG,
                            LD, MMA, ROW, KEY, True)
    for ch in range(head_end, bulk_end):
        run, carry = _chunk(ch, run, carry, q_smem, k_smem, lse2, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, qk_scale,
                            t_ok, n_vis, own, kb, t_row, nvis_row, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P, LOG,
                            LD, MMA, ROW, KEY, False)
    for ch in range(bulk_end, n_chunks):
        run, carry = _chunk(ch, run, carry, q_smem, k_smem, lse2, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, qk_scale,
                            t_ok, n_vis, own, kb, t_row, nvis_row, BLOCK_T, BB, R, MP, D, INIT, LOCAL, T_P, LOG,
                            LD, MMA, ROW, KEY, True)

    # rows' top TOPK blocks, ascending by block, -1 after (as block_select._store_ascending)
    L3: gl.constexpr = gl.BlockedLayout([1, T_P, T_P], [32, 1, 1], [4, 1, 1], [2, 1, 0])
    chosen = (col[None, :] >= T_P - TOPK) & (run >= 0)
    blocks = gl.where(chosen, _key_block(run, kb), 0x7FFFFFFF)
    b_a = gl.convert_layout(blocks, gl.SliceLayout(1, L3))
    b_b = gl.convert_layout(blocks, gl.SliceLayout(2, L3))
    rank = gl.convert_layout(gl.sum((b_a[:, None, :] < b_b[:, :, None]).to(gl.int32), axis=2), KEY)
    n_chosen = gl.sum(chosen.to(gl.int32), axis=1)
    out = out_ptr + (start + pos).to(gl.int64)[:, None] * s_ot + kvh * s_oh
    gl.store(out + rank, blocks, mask=t_ok[:, None] & chosen)
    pad = (col[None, :] >= n_chosen[:, None]) & (col[None, :] < TOPK)
    gl.store(out + col[None, :], gl.zeros_like(run) - 1, mask=t_ok[:, None] & pad)


def select_blocks_gluon(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale=None):
    """select_blocks's contract for g = 1, bf16/fp16, d in {64, 128, 256}, chunks of BB = T_P blocks
    (the paper's (64, 16) and (128, 8) with s = 16: BB = 16 and 8, 64 compressed tokens a chunk)."""
    import math

    import torch

    from fsalab.ops._triton import LOG2E, next_pow2, search_steps
    from fsalab.ops.block_select import _chunk_blocks

    h, h_kv, d = q.shape[1], k_cmp.shape[1], q.shape[2]
    t_pad = max(2, next_pow2(cfg.topk))
    bb = _chunk_blocks(t_pad, cfg.block_size // cfg.kernel_stride)
    assert h == h_kv and bb == t_pad and bb * cfg.block_size // cfg.kernel_stride >= 16
    total, batch = q.shape[0], cu_seqlens.numel() - 1
    out = torch.empty((total, h_kv, cfg.topk), dtype=torch.int32, device=q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    block_t = 128
    select_kernel_gl[(batch + total // block_t, h_kv)](
        q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, batch, search_steps(batch), scale * LOG2E,
        q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse_cmp.stride(0), lse_cmp.stride(1),
        out.stride(0), out.stride(1),
        G=1, D=d, L=cfg.kernel_size, S=cfg.kernel_stride, BS=cfg.block_size, TOPK=cfg.topk, T_P=t_pad, LOG=t_pad.bit_length() - 1,
        BB=bb, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, BLOCK_T=block_t, num_warps=4,
    )
    return out
