"""scripts/decode_host_glue.py (the decode step's host time with launches stubbed) still runs
against the module's API and reports a time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_host_glue_script_reports_a_step_time():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_host_glue.py"), "--steps", "100"],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"stubbed: (\d+) us/step median", proc.stdout)
    assert m and int(m.group(1)) > 0, proc.stdout[-2000:]
    assert "decode" in proc.stdout.split("stubbed:", 1)[1], "no profile of the decode step"
