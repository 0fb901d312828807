"""fp32 PyTorch reference of the top-T block selection (DESIGN §4 step 3, NSA Eq. 8–12): the
block scores from the compressed attention's probabilities and ``select_blocks``, the source of
truth for ``block_select.py``, ``block_select_gluon.py`` and decode's top-T. Layout and
precision: ``ops/reference_common.py``."""

from __future__ import annotations

import math

import torch

from ...config import NSAConfig
from ...varlen import compressed_index, local_positions
from ..compression.reference import compressed_visibility
from ..reference_common import compute_dtype, query_chunks


def block_overlap_weights(cu_seqlens_cmp: torch.Tensor, rows: int, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """W [rows, num_blocks]: overlap of compressed token j with selection block b, in strides.

    |[j*s, j*s + l) ∩ [b*B, (b+1)*B)| / s — for l=32, s=16, B=64 the tokens 4b-1 .. 4b+3 with
    weights 1, 2, 2, 2, 1 (NSA Eq. 9, with the FSA code's offset). Padding rows are zero.
    """
    s, l, bs = cfg.kernel_stride, cfg.kernel_size, cfg.block_size
    r = torch.arange(rows, device=cu_seqlens_cmp.device)
    j = compressed_index(cu_seqlens_cmp, rows)
    b = torch.arange(num_blocks, device=r.device)
    lo = torch.maximum((j * s)[:, None], (b * bs)[None, :])
    hi = torch.minimum((j * s + l)[:, None], ((b + 1) * bs)[None, :])
    w = (hi - lo).clamp(min=0) // s
    return w * (r < cu_seqlens_cmp[-1])[:, None]


def _num_score_blocks(cu_seqlens: torch.Tensor, total: int, cfg: NSAConfig) -> int:
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if total else 0
    return max(cfg.num_blocks(max_len), cfg.topk)


def _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, num_blocks):
    """Yield (lo, hi, scores [hi - lo, h_kv, num_blocks]) with NSA's ranking rules applied:
    forced blocks +inf, blocks after the own block -inf, the rest the group-summed probabilities
    mapped to blocks by the overlap weights."""
    dt = compute_dtype(q)
    total, h, d = q.shape
    rows, h_kv, _ = k_cmp.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    weights = block_overlap_weights(cu_seqlens_cmp, rows, num_blocks, cfg).to(dt)
    own_all = local_positions(cu_seqlens, total) // cfg.block_size
    blocks = torch.arange(num_blocks, device=q.device)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k_cmp.to(dt).transpose(0, 1)
    lse_g = lse_cmp.to(dt).view(total, h_kv, g)
    for lo, hi in query_chunks(total, rows * h + num_blocks * h_kv):
        mask = compressed_visibility(cu_seqlens, cu_seqlens_cmp, total, rows, lo, hi, cfg)[:, None, None, :]
        logits = torch.einsum("chgd,hmd->chgm", qg[lo:hi], k_t) * scale
        lse = lse_g[lo:hi].unsqueeze(-1)
        p = torch.where(mask & torch.isfinite(lse), torch.exp(logits - lse), torch.zeros_like(logits))
        score = p.sum(2) @ weights  # [c, h_kv, num_blocks]
        yield lo, hi, ranked_scores(score, blocks, own_all[lo:hi, None, None], cfg.init_blocks, cfg.local_blocks)


def forced_blocks(blocks: torch.Tensor, own: torch.Tensor, init_blocks: int, local_blocks: int) -> torch.Tensor:
    """bool (blocks and own broadcast): NSA's forced blocks of a token whose own block is ``own``,
    the init_blocks first blocks and the local_blocks blocks ending at the own block (causal
    ones only). The torch twin of ``select_common.forced_score``."""
    return (blocks < init_blocks) | ((blocks > own - local_blocks) & (blocks <= own))


def ranked_scores(score: torch.Tensor, blocks: torch.Tensor, own: torch.Tensor, init_blocks: int,
                  local_blocks: int) -> torch.Tensor:
    """What the top-T ranks: ``score`` with the forced blocks at +inf and the blocks after the
    own block at -inf (prefill's and decode's references alike)."""
    score = torch.where(forced_blocks(blocks, own, init_blocks, local_blocks), float("inf"), score)
    return torch.where(blocks > own, float("-inf"), score)


@torch.no_grad()
def block_scores(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg: NSAConfig, scale: float | None = None) -> torch.Tensor:
    """The scores select_blocks ranks, [total, h_kv, num_blocks] (forced +inf, future -inf).

    Dense over blocks: meant for tests and checks at moderate sizes.
    """
    total = q.shape[0]
    nb = _num_score_blocks(cu_seqlens, total, cfg)
    parts = [s for _, _, s in _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, nb)]
    return torch.cat(parts) if parts else q.new_zeros((0, k_cmp.shape[1], nb), dtype=compute_dtype(q))


@torch.no_grad()
def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-T selection blocks per token and KV head (NSA Eq. 8–12), int32 [total, h_kv, topk].

    Scores: softmax over the visible compressed tokens (p = exp(q·k_cmp·scale - lse_cmp)), summed
    over the g query heads of a group in fp32, mapped to blocks with the overlap weights. Blocks
    < init_blocks and the local_blocks blocks ending at the own block are forced; blocks after the
    own block are never selected. Ties go to the lower block index. Output rows are ascending,
    valid entries first, -1 padding when fewer than topk blocks are causal.
    """
    total, h_kv = q.shape[0], k_cmp.shape[1]
    nb = _num_score_blocks(cu_seqlens, total, cfg)
    out = []
    for _, _, score in _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, nb):
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : cfg.topk]
        chosen = torch.where(torch.gather(score, -1, order) > float("-inf"), order, torch.full_like(order, nb))
        chosen = torch.sort(chosen, dim=-1).values
        out.append(torch.where(chosen == nb, torch.full_like(chosen, -1), chosen).to(torch.int32))
    return torch.cat(out) if out else q.new_zeros((0, h_kv, cfg.topk), dtype=torch.int32)
