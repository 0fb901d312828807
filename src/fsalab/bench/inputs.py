"""Benchmark inputs: random q/k/v and block indices from the real NSA compression path.

Selected-attention kernels are timed on the block lists NSA itself would produce: compress_kv
(random linear compression weights), compressed_attention and select_blocks on random N(0, 1)
q/k/v, through the Triton kernels of the compression branch (``fsalab.ops.compression_ops``).
Each result row records which (``inputs.indices_from``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from ..config import NSAConfig
from ..ops import CompressionOps, compression_ops
from ..varlen import local_positions
from .points import DTYPES, KernelPoint

# What result rows call the compression branch's implementations (``sources.compression``,
# ``inputs.indices_from``): the names every recorded row carries, kept so rows stay comparable.
COMPRESSION_SOURCES = {"triton": "fsalab.ops.compression", "reference": "fsalab.ops.reference"}


def compression_path(impl: str = "triton") -> tuple[CompressionOps, str]:
    """(the compression branch's ops, the name rows record for them) of ``impl``: "triton" (the
    kernels, interpreted on CPU) or "reference" (fp32 PyTorch)."""
    return compression_ops(impl, torch.device("cpu")), COMPRESSION_SOURCES[impl]


@dataclass
class Inputs:
    """Everything an op needs at one point.

    tensors: q [total, h, d], k/v [total, h_kv, d], w_k/w_v [h_kv, l*d, d], pe [h_kv, l, d],
    gate [total, h, 3] (gate logits); block_idx int32 [total, h_kv, topk]; cu_seqlens int32
    [batch + 1]. ``info`` describes where block_idx came from.
    """

    tensors: dict[str, torch.Tensor]
    block_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    cfg: NSAConfig
    max_seqlen: int
    info: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.tensors["q"].shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensors["q"].device

    def prefix(self, m: int) -> Inputs:
        """The first m tokens as one sequence. For causal ops outputs on these rows depend only
        on them, so a reference run on the prefix checks the full run's first m rows exactly."""
        per_token = {"q", "k", "v", "gate"}
        tensors = {n: (t[:m] if n in per_token else t) for n, t in self.tensors.items()}
        cu = torch.tensor([0, m], dtype=torch.int32, device=self.device)
        return replace(self, tensors=tensors, block_idx=self.block_idx[:m], cu_seqlens=cu, max_seqlen=m)

    def with_leaves(self, names: tuple[str, ...]) -> Inputs:
        """A copy whose ``names`` tensors are fresh leaves requiring grad."""
        tensors = dict(self.tensors)
        for n in names:
            tensors[n] = tensors[n].detach().clone().requires_grad_(True)
        return replace(self, tensors=tensors)


INPUT_KEYS = ("dtype", "kernel_size", "kernel_stride", "block_size", "topk", "init_blocks", "local_blocks",
              "window_size", "h_kv", "g", "d", "N", "batch", "seed")
# The last inputs built: points that differ only in impl or direction share them, and building
# block indices at 64K+ tokens costs more than timing a kernel.
_last: tuple[tuple, Inputs] | None = None


def input_key(p: Mapping, device: torch.device | str = "", need_indices: bool = True) -> tuple:
    """What make_inputs depends on: points with equal keys get identical inputs (a KernelPoint, or
    another runner's point with these parameters, which the sweep orders by the same key)."""
    return tuple(p.get(k) for k in INPUT_KEYS) + (str(device), need_indices)


def make_inputs(p: KernelPoint, device: torch.device, need_indices: bool = True) -> Inputs:
    """Random inputs of point ``p`` (seeded by ``p.seed``) and, with ``need_indices``, the
    top-k block indices from the compression path. The last result is reused for an equal key."""
    global _last
    key = input_key(p, device, need_indices)
    if _last is not None and _last[0] == key:
        return _last[1]
    _last = None  # free the previous inputs before allocating new ones
    _last = (key, _build_inputs(p, device, need_indices))
    return _last[1]


def compressed_branch(mod: CompressionOps, tensors: dict, cu_seqlens: torch.Tensor,
                      cfg: NSAConfig) -> tuple[torch.Tensor, ...]:
    """The compression branch of benchmark tensors (q, k, v, w_k, w_v, pe) through ``mod``
    (``compression_path``): (o_cmp, lse_cmp, k_cmp, v_cmp, cu_seqlens_cmp), what block
    selection and the gates take."""
    t = tensors
    k_cmp, v_cmp, cu_cmp = mod.compress_kv(t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], cu_seqlens, cfg)
    o_cmp, lse_cmp = mod.compressed_attention(t["q"], k_cmp, v_cmp, cu_seqlens, cu_cmp, cfg)
    return o_cmp, lse_cmp, k_cmp, v_cmp, cu_cmp


def device_randn(seed: int, device: torch.device, dtype: torch.dtype):
    """(generator, randn(*shape, std=1.0)): normal draws made on ``device`` in fp32 and cast to
    ``dtype``, seeded by ``seed`` (host draws of a 128K-token point took tens of seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    return gen, randn


def _build_inputs(p: KernelPoint, device: torch.device, need_indices: bool) -> Inputs:
    dtype = DTYPES[p.dtype]
    cfg = p.cfg
    h_kv, g, d, n, batch = p.h_kv, p.g, p.d, p.N, p.batch
    h, total, l = h_kv * g, n * batch, cfg.kernel_size
    _, randn = device_randn(p.seed, device, dtype)

    tensors = {
        "q": randn(total, h, d),
        "k": randn(total, h_kv, d),
        "v": randn(total, h_kv, d),
        # Xavier-like scale keeps compressed keys at unit variance, so block scores are not flat.
        "w_k": randn(h_kv, l * d, d, std=1 / math.sqrt(l * d)),
        "w_v": randn(h_kv, l * d, d, std=1 / math.sqrt(l * d)),
        "pe": randn(h_kv, l, d, std=0.02),
        "gate": randn(total, h, 3),
    }
    cu = torch.arange(0, total + 1, n, dtype=torch.int32, device=device)
    if not need_indices:
        none = torch.full((total, h_kv, cfg.topk), -1, dtype=torch.int32, device=device)
        return Inputs(tensors, none, cu, cfg, n, {"indices_from": "none (the op takes no block indices)"})
    mod, source = compression_path()
    with torch.no_grad():
        _, lse_cmp, k_cmp, _, cu_cmp = compressed_branch(mod, tensors, cu, cfg)
        block_idx = mod.select_blocks(tensors["q"], k_cmp, lse_cmp, cu, cu_cmp, cfg).to(torch.int32).contiguous()
    valid = (block_idx >= 0).sum(-1).float().mean().item()
    info = {
        "indices_from": f"compression path ({source}: compress_kv, compressed_attention, select_blocks) "
        f"on random N(0,1) q/k/v, seed {p.seed}",
        "compression_module": source,
        "mean_selected_blocks": valid,
    }
    return Inputs(tensors, block_idx, cu, cfg, n, info)


def attended_keys(inputs: Inputs) -> dict[str, float]:
    """Causally attended keys summed over tokens and query heads, per branch (for useful FLOPs).

    selected: full blocks before the own block count B keys, the own block pos % B + 1;
    window: min(pos + 1, w); full: pos + 1; compressed: visible compressed tokens
    floor((pos - l + 1) / s) + 1 for pos >= l - 1.
    """
    cfg, total = inputs.cfg, inputs.total
    h = inputs.tensors["q"].shape[1]
    g = h // inputs.tensors["k"].shape[1]
    pos = local_positions(inputs.cu_seqlens, total).double()
    own = torch.div(pos, cfg.block_size, rounding_mode="floor")[:, None, None]
    blk = inputs.block_idx.double()
    keys = torch.where(blk < 0, 0.0, torch.where(blk < own, float(cfg.block_size), (pos % cfg.block_size + 1)[:, None, None]))
    visible_cmp = torch.where(
        pos >= cfg.kernel_size - 1, torch.div(pos - cfg.kernel_size + 1, cfg.kernel_stride, rounding_mode="floor") + 1, 0.0
    )
    return {
        "selected": keys.sum().item() * g,
        "window": torch.clamp(pos + 1, max=cfg.window_size).sum().item() * h,
        "full_attention": (pos + 1).sum().item() * h,
        "compressed": visible_cmp.sum().item() * h,
    }
