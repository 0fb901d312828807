"""FSDP2 training through torchrun: 2 CPU processes (gloo), tiny model, NSA reference ops."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

TINY = ("{hidden_size: 128, intermediate_size: 256, num_attention_heads: 4, num_key_value_heads: 2, "
        "head_dim: 32, vocab_size: 256, bos_token_id: null, eos_token_id: null}")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("impl", ["reference", "sdpa_math"])
def test_fsdp2_train_step_two_processes(tmp_path, impl):
    """The production command (torchrun -m fsalab.bench.train --parallel fsdp) on 2 gloo ranks:
    the row is ok, every rank holds half of the parameters, the loss is finite."""
    out = tmp_path / "row.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "fsalab.bench.train", "--model", "qwen3-14b", "--impl", impl, "--N", "128", "--layers", "2",
        "--parallel", "fsdp", "--dtype", "float32", "--topk", "3", "--window-size", "32", "--loss-chunk", "64",
        "--warmup", "0", "--repeats", "2", "--model-overrides", TINY, "--out", str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(out.read_text())
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["world_size"] == 2 and row["parallel"] == "fsdp"
    assert row["local_param_fraction"] == pytest.approx(0.5, abs=0.01)
    assert row["n_samples"] == 2 and row["loss"] == row["loss"]
    assert row["point"].endswith("-fsdp")
