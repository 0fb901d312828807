"""Peer baselines: fla-core's NSA kernels behind fsalab's selected-attention contract (impl fla_nsa).

The layout conversion, the shape constraints and the benchmark's "unsupported" rows are checked
without fla-core. With fla-core installed (``pip install 'fsalab[peers]'``), o, lse, dq, dk and
dv are compared with the fp32 reference at a tiny shape; on CPU fla's Triton kernels run through
the interpreter, where Triton's autotuner cannot benchmark, so each fla autotuner is cut to its
first config for the test.
"""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import torch
from fsalab.bench import grid, kernel
from fsalab.ops.selected import fla_nsa, selected_attention
from fsalab.testing import check_selected_attention, make_batch, random_block_idx

ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize("topk", [1, 3, 4, 5, 8])
def test_block_indices_conversion(topk, gen):
    cu = torch.tensor([0, 37, 200], dtype=torch.int32)
    block_idx = random_block_idx(cu, 2, topk, 16, gen, p_drop=0.3)
    out = fla_nsa.to_fla_block_indices(block_idx)
    s = 1 << (topk - 1).bit_length()
    assert out.shape == (1, 200, 2, s) and out.dtype == torch.int32 and out.is_contiguous()
    assert torch.equal(out[0, ..., :topk], block_idx)
    assert bool((out[0, ..., topk:] == -1).all())  # padding slots: skipped by fla like fsalab's -1
    if s == topk:
        assert out.data_ptr() == block_idx.data_ptr()  # the benchmark's topk: a view, no copy


@pytest.mark.parametrize("g, block_size", [(1, 64), (8, 64), (12, 64), (16, 48)])
def test_unsupported_shapes_raise_value_error(g, block_size):
    """g must be a power of two >= 16 and block_size a power of two; checked before fla is imported."""
    batch = make_batch([64], g, 1, 16)
    block_idx = torch.zeros(64, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fla_nsa"):
        selected_attention(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, block_size, impl="fla_nsa")


def test_missing_package_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.nsa.parallel", None)  # import of it raises ImportError
    batch = make_batch([64], 16, 1, 16)
    block_idx = torch.zeros(64, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fla-core"):
        selected_attention(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, impl="fla_nsa")


def _bench_row(g: int, direction: str, device: torch.device) -> dict:
    """One tiny selected-attention point of impl fla_nsa through the kernel runner."""
    exp = grid.validate(
        {"experiment": "unit", "description": "unit test", "feeds": ["none"], "runner": "kernel",
         "grid": [{"op": ["selected"], "impl": ["fla_nsa"], "direction": [direction], "N": [64], "g": [g],
                   "h_kv": [1], "d": [16], "kernel_size": [16], "kernel_stride": [16], "block_size": [16],
                   "topk": [4], "window_size": [32], "dtype": ["float16"]}],
         "timing": {"method": "wallclock", "warmup": 0, "repeats": 1, "memory": False}},
        grid.load_schema("experiment"), "unit",
    )
    return kernel.run_point(grid.expand(exp)[0], exp, device, platform="unit")


def test_benchmark_row_is_unsupported_for_small_groups():
    row = _bench_row(2, "fwd", torch.device("cpu"))
    assert row["status"] == "unsupported" and "fla" in row["message"], row["message"]


@pytest.fixture
def fla_kernels(monkeypatch):
    """fla-core's NSA ops, each autotuned kernel cut to its first config under the interpreter."""
    pytest.importorskip("fla")
    importlib.import_module("fla.ops.nsa.parallel")
    if not ON_GPU:
        from triton.runtime.autotuner import Autotuner

        for name, module in list(sys.modules.items()):
            if not name.startswith("fla.") or module is None:
                continue
            for obj in list(vars(module).values()):
                # @triton.heuristics wraps the Autotuner: follow .fn down to it.
                while obj is not None and not isinstance(obj, Autotuner):
                    obj = getattr(obj, "fn", None) if hasattr(obj, "run") else None
                if obj is not None and len(obj.configs) > 1:
                    monkeypatch.setattr(obj, "configs", obj.configs[:1])


# fla divides 0/0 in rows that select nothing (the interpreter warns); the adapter zeroes them.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype, lengths, p_drop", [
    (torch.float32, [256], 0.0),
    (torch.float16, [37, 130, 89], 0.3),  # varlen, and rows that select nothing
])
def test_fla_nsa_matches_reference(fla_kernels, dtype, lengths, p_drop, seed, gen, device):
    h_kv, g, d, block_size, topk = 1, 16, 64, 32, 3
    batch = make_batch(lengths, h_kv * g, h_kv, d, dtype=dtype, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, h_kv, topk, block_size, gen, p_drop=p_drop)
    check_selected_attention(functools.partial(selected_attention, impl="fla_nsa"), batch, block_idx, block_size)


def test_fla_nsa_rejects_a_loss_on_lse(fla_kernels, device):
    batch = make_batch([64], 16, 1, 16, device=device, seed=0)
    block_idx = torch.zeros(64, 1, 1, dtype=torch.int32, device=device)
    q = batch.q.clone().requires_grad_()
    _, lse = selected_attention(q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, impl="fla_nsa")
    with pytest.raises(NotImplementedError, match="lse"):
        lse.sum().backward()


def test_benchmark_row_at_g16(fla_kernels, device):
    """The runner's path (no zeroing pass; indices from the compression path) passes its check."""
    row = _bench_row(16, "bwd", device)
    assert row["status"] == "ok", row["message"]
    assert row["check"]["status"] == "pass" and set(row["check"]["outputs"]) == {"o", "dq", "dk", "dv"}
