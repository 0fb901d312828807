"""scripts/host_glue.py (an NSA layer's host time with every Triton launch stubbed) still runs
against the module's and the op's API on every path and reports a time and a profile of the call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path,flags,entry", [("decode", [], "decode"), ("forward", [], "_forward_packed"),
                                              ("op", [], "nsa_attention"), ("op", ["--backward"], "backward")])
def test_host_glue_script_reports_a_call_time(path, flags, entry):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_glue.py"), path, "--rounds", "1", *flags],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(rf"^{path} host time with (\d+) Triton functions stubbed: (\d+) us/call median", proc.stdout, re.M)
    assert m and int(m.group(1)) > 20 and int(m.group(2)) > 0, proc.stdout[-2000:]
    assert entry in proc.stdout.split("stubbed:", 1)[1], f"no profile of {entry}"


@pytest.mark.parametrize("flags,launches", [([], 14), (["--backward"], 16)], ids=["fwd", "bwd"])
def test_host_glue_times_tritons_launch_path(flags, launches):
    """--triton-launch: the op's call goes through Triton's JIT and autotuner launch path (a
    stand-in sm_90 driver; the launcher only counts), as many launches as the GPU runs for fsa's
    forward (14 Triton kernels, tests/test_launch_count.py) and backward."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_glue.py"), "op", "--rounds", "1",
                           "--triton-launch", *flags], capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"^op host time with Triton's launch path, (\d+) launches a call: (\d+) us/call", proc.stdout, re.M)
    assert m and int(m.group(1)) == launches and int(m.group(2)) > 0, proc.stdout[-2000:]
    assert "triton/runtime/jit.py" in proc.stdout.split("a call:", 1)[1], "no profile of Triton's launch path"
