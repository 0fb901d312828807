"""The module's path from input to output queues GPU work only: no host synchronisation."""

import pytest
import torch

from fsalab import settings
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.testing import cu_seqlens_of
from host_reads import HostReads


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


@pytest.mark.slow(25)
@pytest.mark.parametrize("selection", ["nsa", "fsa", "fsa_paper"])
def test_module_path_reads_no_device_values(selection):
    """CPU stand-in for the GPU test above: with value checks off (on CUDA they are asynchronous
    device asserts) the module's forward and backward read no tensor value to the host (no aten op
    such as item() or nonzero, no tolist/numpy/cpu from fsalab's code)."""
    settings.configure(value_checks=False)
    torch.manual_seed(0)
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4, window_size=32)
    module = NativeSparseAttention(64, 4, 2, config=cfg, selection_impl=selection, compression_impl="triton",
                                   window_impl="triton", dtype=torch.float16)
    # 5 blocks (> topk) and twice the window in the longest sequence: every branch of the module's
    # path runs, in few interpreter programs (nsa's kernels run one per token).
    x = torch.randn(103, 64, dtype=torch.float16, requires_grad=True)
    with HostReads() as reads:
        module(x, cu_seqlens_of([70, 30, 3], "cpu")).float().sum().backward()
    assert not reads.seen, f"host reads on the module path: {sorted(set(reads.seen))}"


def test_module_buffers_live_on_the_requested_device():
    """A buffer left on the CPU would be copied to the GPU (synchronously) on every call."""
    module = NativeSparseAttention(64, 4, 2, device="meta", dtype=torch.float16)
    assert {t.device.type for t in (*module.parameters(), *module.buffers())} == {"meta"}


def test_host_reads_sees_copies_from_fsalab_code_only():
    """The recorder flags a value copy made by fsalab's code (tolist, numpy, cpu, item, which on a
    CPU tensor dispatch no aten op) and host-reading aten ops from anywhere, but not the copies
    the Triton interpreter or a test makes."""
    fsalab_code = {"__name__": "fsalab.ops.example"}
    exec("def read(t):\n    return t.tolist(), t.numpy(), t.cpu(), t[0].item()", fsalab_code)
    t = torch.arange(3.0)
    with HostReads() as reads:
        fsalab_code["read"](t)
        t.tolist(), t.numpy()  # this test's own copies
    assert [s.split(" in ")[0] for s in reads.seen if s.startswith("Tensor.")] == \
        ["Tensor.tolist", "Tensor.numpy", "Tensor.cpu", "Tensor.item"]
    assert all(s.endswith("fsalab.ops.example:2") for s in reads.seen if s.startswith("Tensor."))
    assert "aten._local_scalar_dense.default" in reads.seen  # item() reads through an aten op too
    with HostReads() as reads:
        int(t[1]), torch.nonzero(t)
    assert reads.seen == ["aten._local_scalar_dense.default", "aten.nonzero.default"]
    assert "tolist" not in vars(torch.Tensor) and "__array__" in vars(torch.Tensor)  # restored as they were
