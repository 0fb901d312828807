"""Tensor parallelism for prefill (FSA Appendix I, Tables 12-15): Megatron-style head and MLP
splits over the ranks of one host, through ``torch.distributed.tensor.parallel``.

Per decoder layer: q/k/v projections (and NSA's gate projection, whose output rows are
head-major) column-parallel, so each rank owns ``h / tp`` query heads and ``h_kv / tp`` KV heads
(a GQA group never straddles ranks); the output projection row-parallel (one all-reduce);
MLP gate/up column-parallel and down row-parallel (one all-reduce). NSA's per-KV-head
compression weights are sliced to the rank's KV heads. Embedding, final norm and LM head stay
replicated (prefill applies the head to one token). Works on meta models (shard, then
``to_empty`` + init) and on materialised ones (existing weights are split).

Launch, e.g. TP = 4:
    torchrun --nproc-per-node 4 -m fsalab.bench.prefill --model llama3-8b --impl fsa --N 32768 --parallel tp
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.patch import NSAAttentionAdapter, decoder_layers
from .fsdp import rank, world_size


def _plan(layer: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.split(".")[-2] if name.endswith(".proj") else name.split(".")[-1]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan[name] = ColwiseParallel()
        elif leaf in ("o_proj", "down_proj"):
            plan[name] = RowwiseParallel()
    return plan


def _split_adapter_heads(adapter: NSAAttentionAdapter, tp: int, r: int) -> None:
    """Local head counts and this rank's slice of the per-KV-head compression parameters."""
    nsa = adapter.nsa
    nsa.num_heads //= tp
    nsa.num_kv_heads //= tp
    n = nsa.num_kv_heads
    for name in ("compress_k", "compress_v", "compress_pe"):
        full = getattr(nsa, name)
        setattr(nsa, name, nn.Parameter(full.detach()[r * n : (r + 1) * n].clone(), requires_grad=full.requires_grad))


def apply_tensor_parallel(model: nn.Module) -> nn.Module:
    """Split every decoder layer of ``model`` (an HF causal LM, NSA-patched or not) over all
    ranks of the default process group, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    tp, r = world_size(), rank()
    config = model.config
    h, h_kv = config.num_attention_heads, config.num_key_value_heads
    if h % tp or h_kv % tp:
        raise ValueError(f"tensor parallelism {tp} must divide the query heads ({h}) and KV heads ({h_kv})")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, (tp,))
    for layer in decoder_layers(model):
        if isinstance(layer.self_attn, NSAAttentionAdapter):
            _split_adapter_heads(layer.self_attn, tp, r)
        parallelize_module(layer, mesh, _plan(layer))
    return model
