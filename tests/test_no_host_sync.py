"""The module's path from input to output queues GPU work only: no host synchronisation."""

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.testing import cu_seqlens_of


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["nsa", "fsa", "fsa_paper", "auto"])
def test_module_forward_backward_without_host_sync(selection, monkeypatch, tmp_path):
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    torch.manual_seed(0)
    module = NativeSparseAttention(
        512, 8, 2, config=NSAConfig(topk=8, window_size=256), selection_impl=selection,
        compression_impl="triton", window_impl="triton", device="cuda", dtype=torch.bfloat16,
    )
    cu = cu_seqlens_of([3000, 1000, 96], "cuda")
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module(x, cu).float().sum().backward()  # compile, autotune and (auto) profile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(x, cu)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
