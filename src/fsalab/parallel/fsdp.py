"""FSDP2 for the end-to-end training benchmark, under torchrun.

``setup_device()`` starts the process group when torchrun launched this process (NCCL on
CUDA, gloo on CPU) and returns this rank's device; ``shard_causal_lm(root)`` applies
``fully_shard`` to every decoder layer and then to the root module (embedding, final norm and
LM head stay in the root's group), the layout FSDP2's documentation recommends. Build the
model on the meta device, shard, then ``to_empty`` + init (``fsalab.bench.model_build``): each rank
only ever allocates its shards.

Launch, e.g. 8 GPUs, full depth:
    torchrun --nproc-per-node 8 -m fsalab.bench.train --experiment train_fsdp --all
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def launched_by_torchrun() -> bool:
    """True under torchrun, one rank included (``--nproc-per-node 1`` is the TP = 1 row of
    Tables 12-15 and must run the same sharded code path as the larger groups)."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def setup_device() -> torch.device:
    """This process's device; starts the process group first when launched by torchrun.

    Without CUDA the Triton interpreter is selected (before anything imports triton).
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if launched_by_torchrun() and not is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def shard_causal_lm(root: nn.Module) -> nn.Module:
    """FSDP2-shard ``root`` (a module holding an HF causal LM) over all ranks, in place:
    one ``fully_shard`` unit per decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..models.patch import decoder_layers

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, (world_size(),))
    lm = getattr(root, "lm", root)
    for layer in decoder_layers(lm):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return root


def local_fraction(module: nn.Module) -> float:
    """Elements this rank stores / elements of the model (1 / world size when fully sharded)."""
    from torch.distributed.tensor import DTensor

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())
    return local / max(1, sum(p.numel() for p in module.parameters()))


def max_over_ranks(value: float | None) -> float | None:
    """The maximum of ``value`` over ranks (None stays None)."""
    if value is None or not is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def teardown() -> None:
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()
