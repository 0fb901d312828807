"""Multi-process paths on CPU (gloo): FSDP2 training and tensor-parallel prefill, tiny models."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 256, "bos_token_id": None, "eos_token_id": None}
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


# 4 ranks: Qwen2.5-32B's biases (the model that needs a 4-GPU host) with 4 KV heads, so NSA's
# per-KV-head compression weights (dim 0 = KV heads) split evenly, as 8 KV heads do on 4 or 8 GPUs.
FSDP_CASES = [(2, "qwen3-14b", TINY),
              (4, "qwen2.5-32b", {**TINY, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16})]


@pytest.mark.slow(30)
@pytest.mark.parametrize("ranks, model, shape", FSDP_CASES, ids=["fsdp2", "fsdp4"])
def test_fsdp2_train_step(ranks, model, shape, tmp_path):
    """The production command, torchrun -m fsalab.bench.train --parallel fsdp, on 2 and 4 CPU
    ranks: the row is ok, each rank holds 1/ranks of the parameters (fully_shard per layer +
    root), the loss is finite."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "fsalab.bench.train", "--model", model, "--impl", "reference", "--N", "128", "--layers", "2",
           "--parallel", "fsdp", "--dtype", "float32", "--topk", "3", "--window-size", "32", "--loss-chunk", "64",
           "--warmup", "0", "--repeats", "2", "--model-overrides", json.dumps(shape), "--out", str(out)]
    proc = subprocess.run(cmd, check=False, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(out.read_text())
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["world_size"] == ranks and row["parallel"] == "fsdp" and f"-fsdp{ranks}-" in row["point"]
    assert row["local_param_fraction"] == pytest.approx(1 / ranks, abs=0.01)
    assert row["n_samples"] == 2 and math.isfinite(row["loss"])


def _tp_worker(rank: int, port: int, queue, world: int, shape: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    from fsalab import NSAConfig
    from fsalab.bench import layer_split, points, prefill
    from fsalab.models import configs, patch
    from fsalab.parallel import fsdp, tp

    device = fsdp.setup_device()
    results, kinds = [], []
    # Qwen3 QK-norm through the NSA adapter; Qwen2 biases through HF's own attention.
    for name, impl in (("qwen3-14b", "reference"), ("qwen2.5-32b", "sdpa_math")):
        model = configs.build_model(name, 2, "cpu", torch.float32, **shape)
        configs.init_random_(model, seed=0)
        patch.patch_model(model, impl, NSAConfig(block_size=32, topk=3, window_size=32))
        ids = torch.randint(0, shape["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), patch.attention_context(impl):
            ref = model(input_ids=ids, use_cache=False).logits
            tp.apply_tensor_parallel(model)
            out = model(input_ids=ids, use_cache=False).logits
            mlp = patch.decoder_layers(model)[0].mlp
            pending = mlp(torch.randn(1, 16, shape["hidden_size"]))
        results.append((name, (out - ref).abs().max().item(), ref.abs().max().item()))
        kinds.append((type(pending).__name__, type(layer_split.settled(pending)).__name__))
    p = {**points.E2E_DEFAULTS, "op": "prefill", "model": "llama3-8b", "impl": "reference", "N": 128, "dtype": "float32",
         "layers": None, "topk": 3, "window_size": 32, "parallel": "tp", "ranks": world, "experiment": "prefill",
         "model_overrides": {**shape, "num_hidden_layers": 2}}
    p["id"] = points.e2e_point_id(p)
    row = prefill.run_point(p, {"timing": {"warmup": 0, "repeats": 1}}, device, "cpu-test")
    queue.put((rank, results, kinds,
               {k: row.get(k) for k in ("status", "message", "world_size", "layers", "point", "split_kind")}))
    fsdp.teardown()


# TP = 4 with Qwen's group size g = 5 (20 query heads, 4 KV heads: one KV head and its 5 query
# heads per rank, as Qwen's 40 / 8 heads split at TP = 8). A TP = 2 case of the tiny shape (one
# KV head and its 2 query heads per rank) checked nothing this one does not, at the cost of two
# more spawned ranks.
TP_WORLD, TP_SHAPE = 4, {**TINY, "hidden_size": 320, "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 16}


@pytest.mark.slow(40)
def test_tensor_parallel_prefill():
    """Splitting a materialised model's heads and MLP over the ranks leaves its logits unchanged;
    ``layer_split.settled`` turns a row-parallel layer's pending all-reduce into a plain tensor (so
    the isolated module timings include it); the prefill runner's tensor-parallel path (meta
    build, split, materialise) gives a row."""
    world, shape = TP_WORLD, TP_SHAPE
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_tp_worker, args=(port, queue, world, shape), nprocs=world, start_method="spawn")
    for _ in range(world):
        rank, results, kinds, row = queue.get(timeout=60)
        for name, err, scale in results:
            assert err <= 1e-5 * max(1.0, scale), f"rank {rank} {name}: max abs diff {err}"
        for pending, waited in kinds:
            assert (pending, waited) == ("AsyncCollectiveTensor", "Tensor"), (pending, waited)
        assert row["status"] == "ok", row["message"]
        assert "all-reduce waited" in row["split_kind"]
        assert row["world_size"] == world and row["layers"] == 2 and f"-tp{world}-" in row["point"]


def test_tensor_parallel_prefill_one_rank(tmp_path):
    """TP = 1 (the first column of Tables 12-15) is torchrun with one process: it must start a
    one-rank process group and give an ok row, not a 'needs a process group' one."""
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "fsalab.bench.prefill", "--model", "llama3-8b", "--impl", "reference", "--N", "128",
           "--parallel", "tp", "--dtype", "float32", "--topk", "3", "--window-size", "32",
           "--warmup", "0", "--repeats", "1", "--model-overrides", json.dumps({**TINY, "num_hidden_layers": 2}),
           "--out", str(out)]
    proc = subprocess.run(cmd, check=False, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(out.read_text())
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["world_size"] == 1 and "-tp1-" in row["point"]
