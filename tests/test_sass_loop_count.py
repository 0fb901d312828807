"""scripts/sass_loop_count.py, whose counts docs/perf-log.md cites, still builds the select
kernel and FSA's forward and backward tile kernels for sm_90a on CPU, finds their main loops and
refuses an edit it cannot place; and the select kernel's 128-row, 8-warp tile at g = 4 (the GPU's
config there) spills nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loop_count.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_select_loop_counted_without_spills():
    out = _run("--config", "4,128,8")
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"(\d+) registers, (\d+) B spilled; loop (\d+) instructions", out.stdout)
    assert m, out.stdout
    assert int(m.group(2)) == 0, out.stdout
    assert int(m.group(3)) > 100, out.stdout  # the score loop, not a short index loop


@pytest.mark.parametrize("kernel", ["fsa_partial", "fsa_dkdv"])
def test_fsa_tile_loops_counted(kernel):
    out = _run("--kernel", kernel, "--config", "4,128,8" if kernel == "fsa_dkdv" else "4,128,4")
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"loop (\d+) instructions per thread and tile \((\d+) per \(token, head\) row", out.stdout)
    assert m and int(m.group(1)) > 100, out.stdout


def test_replace_must_match_once():
    out = _run("--config", "4,128,8", "--replace", "no such text", "x")
    assert out.returncode != 0 and "occurs 0 times" in out.stderr + out.stdout


def test_variant_function_and_two_loops():
    """--source/--function/--const build an A/B's variant kernel; --loops 2 reports both its tile loops."""
    variant = Path(__file__).resolve().parents[1] / "results/h200/checks/ab-fsa-pow2-heads/fsa_bwd_pow2.py"
    out = _run("--kernel", "fsa_dkdv", "--source", str(variant), "--function", "_dkdv_pow2_kernel",
               "--const", "G_HI=4", "--const", "G_LO=1", "--const", "G_LO_P=1", "--const", "PER_ITEM=2048",
               "--rows", "128", "--loops", "2", "--config", "5,128,8")
    assert out.returncode == 0, out.stderr[-3000:]
    loops = re.findall(r"loop (\d) (\d+) instructions per thread and tile \((\d+) per", out.stdout)
    assert [n for n, _, _ in loops] == ["1", "2"] and all(int(k) > 100 for _, k, _ in loops), out.stdout
