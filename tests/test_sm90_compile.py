"""Every kernel the NSA module launches compiles for the H200 (sm_90) on this CPU-only machine.

The interpreter that runs the other tests executes a kernel's Python, not Triton's GPU front end,
so a kernel can pass them all and still fail to build on the GPU. scripts/check_sm90_compile.py
records the module's launches under the interpreter and builds each for cuda:90 in a process
without it (every autotune config, fp16 and bf16; a launch whose configs all exceed the
block's shared memory fails too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_sm90_compile.py"


# part -> a kernel its launches must include (the recording reached it).
PARTS = {"prefill": "_select_kernel", "decode": "_append_kernel"}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_launched_kernel_compiles_for_sm90(part):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--jobs", "1", "--part", part], check=False,
                          capture_output=True, text=True, timeout=1800)
    report = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert "launches compiled for sm_90" in proc.stdout and PARTS[part] in proc.stdout, report
