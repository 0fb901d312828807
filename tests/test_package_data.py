"""The library stands without the checkout: the schemas, experiment grids and paper values it
reads ship as package data (``fsalab.data``), and an installed copy run outside the checkout
reports its environment, runs a kernel benchmark point, the ops and the module.

By hand (what the slow test does):

    pip install --no-deps --target /tmp/fsalab-pkg .
    cd /tmp && PYTHONPATH=/tmp/fsalab-pkg python -m fsalab.cli env
    PYTHONPATH=/tmp/fsalab-pkg python -m fsalab.cli bench-kernel --experiment kernel --smoke \\
        --op selected --impl fsa --direction fwd --N 64 --g 1 --out point.json
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsalab import data
from fsalab.bench import grid
from fsalab.results import paper_values

ROOT = Path(__file__).resolve().parents[1]

MODULE_RUN = """
import torch
from fsalab import NSAConfig, NativeSparseAttention
from fsalab.testing import cu_seqlens_of
torch.manual_seed(0)
attn = NativeSparseAttention(64, 4, 2, config=NSAConfig(kernel_size=16, kernel_stride=16, block_size=16,
                             topk=4, window_size=32), compression_impl="triton", selection_impl="fsa",
                             window_impl="triton", gate_impl="triton", dtype=torch.float16)
x = torch.randn(80, 64, dtype=torch.float16, requires_grad=True)
out = attn(x, cu_seqlens_of([50, 30]))
out.float().square().mean().backward()
assert out.shape == (80, 64) and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
print("module ok")
"""


def test_package_data_holds_what_the_library_reads():
    for name in ("experiment", "overlay", "result", "config"):
        assert grid.load_schema(name)["type"] == "object"
    assert grid.load_experiment("kernel")["experiment"] == "kernel"
    assert "experiments" in grid.load_smoke()
    assert paper_values()


@pytest.mark.skipif(not (ROOT / "workflow" / "schemas").is_dir(), reason="not a checkout")
def test_package_data_is_the_checkouts_files():
    """In a checkout the package data and the workflow's files are the same files, not copies."""
    pairs = [(data.path("schemas"), ROOT / "workflow" / "schemas"),
             (data.path("experiments"), ROOT / "experiments"),
             (data.path("paper_values.yaml"), ROOT / "analysis" / "paper_values.yaml")]
    for packaged, repo in pairs:
        assert packaged.resolve() == repo.resolve()


def _run(args, cwd, env):
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow(30)
@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="not a checkout")
def test_installed_package_runs_outside_the_checkout(tmp_path):
    target, work = tmp_path / "site", tmp_path / "run"
    work.mkdir()
    # The test environment's setuptools builds it when present (no download); else pip's isolated build.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    _run(["-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(target), str(ROOT)], work, None)
    assert (target / "fsalab" / "data" / "schemas" / "result.schema.yaml").is_file()
    assert not (target / "fsalab" / "data" / "schemas").is_symlink()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FSALAB_ROOT")}
    env |= {"PYTHONPATH": str(target), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    where = _run(["-c", "import fsalab; print(fsalab.__file__)"], work, env)
    assert Path(where.strip()).is_relative_to(target)

    report = json.loads(_run(["-m", "fsalab.cli", "env"], work, env))
    assert report["platform"] == "cpu-interpret"

    point = work / "point.json"
    _run(["-m", "fsalab.cli", "bench-kernel", "--experiment", "kernel", "--smoke", "--op", "selected", "--impl",
          "fsa", "--direction", "fwd", "--N", "64", "--g", "1", "--out", str(point)], work, env)
    row = json.loads(point.read_text())
    assert row["status"] == "ok" and row["impl"] == "fsa" and row["median_ms"] > 0

    assert "module ok" in _run(["-c", MODULE_RUN], work, env)
