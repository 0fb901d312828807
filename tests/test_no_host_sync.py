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


# Ops that read a device value back to the host (item(), bool(), nonzero, ...). On CPU they
# cost nothing, but the same call on CUDA would block the host until the GPU catches up.
_SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                "aten._unique2.default", "aten.unique_consecutive.default"}


@pytest.mark.slow(25)
@pytest.mark.parametrize("selection", ["nsa", "fsa", "fsa_paper"])
def test_module_path_reads_no_device_values(selection, monkeypatch):
    """CPU stand-in for the GPU test above: with value checks off (on CUDA they are asynchronous
    device asserts) the module's forward and backward call no op that reads values to the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setenv("FSALAB_VALUE_CHECKS", "0")
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in _SYNCING_OPS:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4, window_size=32)
    module = NativeSparseAttention(64, 4, 2, config=cfg, selection_impl=selection, compression_impl="triton",
                                   window_impl="triton", dtype=torch.float16)
    # 5 blocks (> topk) and twice the window in the longest sequence: every branch of the module's
    # path runs, in few interpreter programs (nsa's kernels run one per token).
    x = torch.randn(103, 64, dtype=torch.float16, requires_grad=True)
    with Recorder():
        module(x, cu_seqlens_of([70, 30, 3], "cpu")).float().sum().backward()
    assert not seen, f"host-reading ops on the module path: {sorted(set(seen))}"


def test_module_buffers_live_on_the_requested_device():
    """A buffer left on the CPU would be copied to the GPU (synchronously) on every call."""
    module = NativeSparseAttention(64, 4, 2, device="meta", dtype=torch.float16)
    assert {t.device.type for t in (*module.parameters(), *module.buffers())} == {"meta"}
