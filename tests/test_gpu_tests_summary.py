"""The GPU suite's scripts. scripts/gpu/gpu_tests_summary.py writes the summary committed beside
its logs: a chunk passes only when pytest printed a count free of failures and was not
interrupted; a chunk stopped by the suite's budget or killed says so, with what its log shows.
scripts/gpu/run_gpu_tests.sh deals every file with GPU tests into exactly one chunk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "gpu_tests_summary.py"

LOGS = {
    "finished": "....s.                                    [100%]\n"
                "SKIPPED [1] tests/test_window.py:59: flash-attn is not installed\n"
                "5 passed, 1 skipped, 3 deselected in 12.50s\n",
    "interrupted": "......\n!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n"
                   "(to show a full traceback on KeyboardInterrupt use --full-trace)\n"
                   "6 passed in 300.10s (0:05:00)\n",
    "killed": "............\n....F\n",
    "failed": "..F.                                      [100%]\nFAILED tests/test_x.py::test_y - assert 0\n"
              "1 failed, 3 passed in 9.00s\n",
}


def _summarise(tmp_path: Path, names: list[str], missing: int = 0) -> tuple[int, list[str]]:
    for i, name in enumerate(names):
        (tmp_path / f"pytest-gpu-{i}.log").write_text(LOGS[name])
    chunks = [arg for i in range(len(names) + missing) for arg in ("--chunk", f"tests/test_{i}.py")]
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--seconds", "321", "--commit",
                          "abc1234", "--tests-commit", "def5678", *chunks], capture_output=True, text=True, timeout=60)
    written = (tmp_path / "pytest-gpu-summary.txt").read_text()
    assert out.stdout == written
    return out.returncode, written.splitlines()


def test_all_finished_chunks_pass(tmp_path):
    code, lines = _summarise(tmp_path, ["finished", "finished"])
    assert code == 0
    assert lines[0] == "# bash scripts/gpu/run_gpu_tests.sh 2 at abc1234, tests of def5678"
    assert lines[1] == "chunk 0: tests/test_0.py -> 5 passed, 1 skipped, 3 deselected in 12.50s"
    assert lines[-1] == "all chunks: 321 s, status 0"


def test_interrupted_killed_failed_and_missing_chunks_fail(tmp_path):
    code, lines = _summarise(tmp_path, ["finished", "interrupted", "killed", "failed"], missing=1)
    assert code == 1
    assert lines[2] == "chunk 1: tests/test_1.py -> 6 passed in 300.10s (0:05:00); interrupted at the budget"
    assert lines[3] == "chunk 2: tests/test_2.py -> no summary (stopped); 16 passed, 1 failed, 0 errors so far"
    assert lines[4] == "chunk 3: tests/test_3.py -> 1 failed, 3 passed in 9.00s"
    assert lines[5] == "chunk 4: tests/test_4.py -> no log"
    assert lines[-1] == "all chunks: 321 s, status 1"


def test_every_gpu_test_file_runs_in_exactly_one_chunk():
    """run_gpu_tests.sh deals each file that pytest collects GPU tests from into one chunk, once,
    and names no file that does not exist (GPU_TESTS_LIST_ONLY=1 lists the chunks without running)."""
    root = SCRIPT.parents[2]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                                "no:cacheprovider", "tests"], cwd=root, capture_output=True, text=True, timeout=300)
    gpu_files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert len(gpu_files) > 10, collected.stdout[-2000:]
    for chunks in (8, 3):
        listed = subprocess.run(["bash", str(SCRIPT.parent / "run_gpu_tests.sh"), str(chunks)], cwd=root,
                                env={**os.environ, "GPU_TESTS_LIST_ONLY": "1"}, capture_output=True, text=True,
                                timeout=60)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert len(lines) == chunks and all(line.startswith(f"chunk {i}: ") for i, line in enumerate(lines))
        dealt = [f for line in lines for f in line.split(": ", 1)[1].split()]
        assert sorted(dealt) == sorted(gpu_files), (chunks, set(dealt) ^ gpu_files)


def test_summary_says_which_commit_it_does_not_know(tmp_path):
    """Without --commit / --tests-commit nor their environment variables the first line says which
    is missing instead of naming a commit."""
    (tmp_path / "pytest-gpu-0.log").write_text(LOGS["finished"])
    env = {k: v for k, v in os.environ.items() if k not in ("FSALAB_GIT_COMMIT", "FSALAB_TESTS_COMMIT")}
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--seconds", "1", "--chunk", "tests/test_0.py"],
                   env=env, capture_output=True, text=True, timeout=60, check=True)
    first = (tmp_path / "pytest-gpu-summary.txt").read_text().splitlines()[0]
    assert first == ("# bash scripts/gpu/run_gpu_tests.sh 1 at unknown (FSALAB_GIT_COMMIT unset), "
                     "tests of unknown (FSALAB_TESTS_COMMIT unset)")
