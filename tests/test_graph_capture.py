"""The NSA module and the patched decoder layer capture in a CUDA graph, forward and backward.

A captured step replays with no launch path at all (the host enqueues one graph), which is what
makes short sequences fast (docs/performance.md, "Whole NSA attention"). Capture needs static shapes and no
host synchronisation anywhere on the path, backward included. The replay, on inputs written into
the captured buffers after the capture, must reproduce an eager step on the same inputs (to
rounding: cuBLAS may pick another GEMM algorithm inside a capture); a replay that read stale
inputs or skipped a kernel would differ by O(1).
"""

from __future__ import annotations

import pytest
import torch

from fsalab.bench.timing import capture_graph
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.testing import cu_seqlens_of
from patched_layer import tiny_patched_layer


def _replay_matches_eager(params, x, forward):
    """Capture forward + backward of ``forward(x)`` into static buffers; replay on new x values
    and compare output and gradients with an eager step on the same values."""
    do = torch.randn_like(forward(x))
    out, grads = {}, {}

    def step():
        for p in params:
            p.grad = None
        y = forward(x)
        y.backward(do)
        out["y"] = y
        grads["g"] = [p.grad for p in params]

    graph = capture_graph(step, torch.device("cuda"), warmup=3)
    assert graph.ok, graph.status
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    got_y, got_g = out["y"].clone(), [g.clone() for g in grads["g"]]
    for p in params:
        p.grad = None
    y = forward(x)
    y.backward(do)
    for name, got, want in [("output", got_y, y)] + [(f"grad {i}", g, p.grad) for i, (p, g) in enumerate(zip(params, got_g))]:
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))
        assert err <= 1e-2, f"replayed {name} differs from the eager step: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["fsa", "nsa", "auto"])
def test_module_captures_forward_and_backward(selection, monkeypatch, tmp_path):
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    torch.manual_seed(0)
    module = NativeSparseAttention(
        640, 10, 2, config=NSAConfig(topk=8, window_size=256), selection_impl=selection,
        compression_impl="triton", window_impl="triton", gate_impl="triton", device="cuda", dtype=torch.bfloat16,
    )  # g = 5: both head parts of the selection kernel
    cu = cu_seqlens_of([3000, 1000, 96], "cuda")
    x = torch.randn(4096, 640, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [x, *module.parameters()]
    _replay_matches_eager(params, x, lambda t: module(t, cu))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-14b"])
def test_patched_decoder_layer_captures(model, monkeypatch, tmp_path):
    """One decoder layer of the patched architecture (tiny widths, the model's g and head dim),
    as the end-to-end runners build it: attention with NSA (fsa), RoPE from HF, the MLP."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    net, layer, hidden = tiny_patched_layer(model, "fsa", NSAConfig(topk=8, window_size=256))
    base = net.model
    seq = 2048
    x = torch.randn(1, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq, device="cuda")[None]
    cos_sin = base.rotary_emb(x, positions)

    def forward(t):
        out = layer(t, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    _replay_matches_eager([x, *layer.parameters()], x, forward)
