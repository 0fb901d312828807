"""torch.compile of the NSA module and of a patched decoder layer on the GPU (the ops of ops/library.py).

``mode="reduce-overhead"`` (Inductor, steps replayed from CUDA graphs) compiles forward and
backward into one graph (``fullgraph=True``), skips no CUDA graph, and its replays match the eager
step; Inductor's own kernels for torch's ops around fsalab's (RoPE's cos/sin, RMSNorm) round
differently from eager's, so they are compared at bf16 rounding, as the CUDA-graph capture tests
do. The ``aot_eager`` backend (dynamo and AOTAutograd on the eager kernels) matches the eager
step to the bit. The CPU tests (tests/test_custom_ops.py) check the ops themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.testing import cu_seqlens_of, step_outputs
from patched_layer import tiny_patched_layer

pytestmark = pytest.mark.gpu

CFG = NSAConfig(topk=8, window_size=256)


def _check(fn, params, x, *args, **kwargs) -> None:
    """Three reduce-overhead steps (warm-up, recording, replay) against an eager one, and the
    aot_eager step to the bit."""
    eager = step_outputs(fn, params, x, *args, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    # Rounded to bf16 between fused ops as eager rounds: a near-tie of the block selection then
    # resolves as in eager.
    with inductor_config.patch(emulate_precision_casts=True):
        steps = [step_outputs(compiled, params, x, *args, **kwargs) for _ in range(3)]
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    for step in steps[1:]:
        for i, (got, want) in enumerate(zip(step, eager)):
            err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
            assert err <= 1e-2, f"tensor {i} of a replayed step differs from eager: relative error {err:.2e}"
    torch._dynamo.reset()
    exact = step_outputs(torch.compile(fn, fullgraph=True, backend="aot_eager"), params, x, *args, **kwargs)
    differ = [i for i, (a, b) in enumerate(zip(exact, eager)) if not torch.equal(a, b)]
    assert not differ, f"the aot_eager step differs from eager in tensors {differ}"


@pytest.mark.parametrize("selection", ["auto", "fsa", "nsa"])
def test_module_compiles_with_cuda_graphs(selection, monkeypatch, tmp_path):
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    torch.manual_seed(0)
    module = NativeSparseAttention(
        640, 10, 2, config=CFG, selection_impl=selection, compression_impl="triton", window_impl="triton",
        gate_impl="triton", device="cuda", dtype=torch.bfloat16,
    )  # g = 5: both head parts of the selection kernel
    x = torch.randn(4096, 640, device="cuda", dtype=torch.bfloat16)
    _check(module, list(module.parameters()), x, cu_seqlens_of([3000, 1000, 96], "cuda"))


@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-14b"])
def test_patched_decoder_layer_compiles_with_cuda_graphs(model, monkeypatch, tmp_path):
    """One decoder layer of the patched architecture (tiny widths, the model's g and head dim)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    net, layer, hidden = tiny_patched_layer(model, "auto", CFG)
    x = torch.randn(1, 2048, hidden, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(2048, device="cuda")[None]
    _check(layer, list(layer.parameters()), x, position_embeddings=net.model.rotary_emb(x, positions))
