"""Every kernel the NSA module launches compiles for the H200 (sm_90) on this CPU-only machine.

The interpreter that runs the other tests executes a kernel's Python, not Triton's GPU front end,
so a kernel can pass them all and still fail to build on the GPU. scripts/check_sm90_compile.py
records the module's launches under the interpreter and builds each for cuda:90 in a process
without it (every autotune config the kernel's prune keeps in bf16, the first in fp16 too; a
launch whose configs all exceed the block's shared memory fails too). One item per case of the
script, so pytest-xdist spreads them over its workers.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_sm90_compile.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_sm90_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib imports only at module level
    return module


CASES = _script().CASES


@pytest.mark.slow(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_launched_kernels_compile_for_sm90(case):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--case", case, "--jobs", "1"], check=False,
                          capture_output=True, text=True, timeout=1800)
    report = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    compiled = set(re.findall(r"^ok +fsalab\.ops\.(?:\w+\.)*?(\w+\.\w+):", proc.stdout, re.M))
    expected = {k for run in CASES[case] for k in run[4]}
    assert expected <= compiled, (sorted(expected - compiled), report)


def test_cases_name_every_launched_kernel():
    """Every @triton.jit function of src/fsalab that no Triton code calls (a kernel the host
    launches, not a device helper) is a kernel some case must reach."""
    texts = {path: path.read_text() for path in (ROOT / "src" / "fsalab").rglob("*.py")}
    every = "\n".join(texts.values())
    kernels = {f"{path.stem}.{name}" for path, text in texts.items()
               for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)", text)
               if not re.search(rf"(?<!def )\b{name}\(", every)}
    assert len(kernels) > 20, f"the pattern no longer finds the kernels: {sorted(kernels)}"
    named = {k for runs in CASES.values() for run in runs for k in run[4]}
    assert kernels <= named, sorted(kernels - named)
