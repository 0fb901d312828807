"""The GPU suite's summary: one line per chunk of ``run_gpu_tests.sh`` from its pytest log.

A chunk's line is pytest's own final count ("36 passed, 2 skipped ... in 330.43s"), marked
"interrupted" when the chunk was stopped (the suite's budget sends SIGINT, after which pytest
still prints its count), or, when the log holds no count (the process was killed), the tests
its progress dots show: "no summary; N passed, M failed so far". Writes
``<out>/pytest-gpu-summary.txt`` and prints it; exits 1 unless every chunk ended with a count
free of failures and errors. Its first line names the code under test (``--commit``, default
``FSALAB_GIT_COMMIT``: the kernels' commit, ``scripts/gpu/code_commit.sh``) and the commit of the
tests themselves (``--tests-commit``, default ``FSALAB_TESTS_COMMIT``), which move apart while the
measured code is held at one commit; the device machine has no git, so the caller exports both.

    python3 scripts/gpu/gpu_tests_summary.py --out DIR --seconds S [--commit SHA] [--tests-commit SHA]
        --chunk 'FILE FILE ...' [--chunk ...]      (chunk i's log: DIR/pytest-gpu-<i>.log)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

COUNT = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")
PROGRESS = re.compile(r"^[.sFExX]+(\s+\[\s*\d+%\])?$")


def chunk_result(log: str) -> tuple[str, bool]:
    """(the chunk's result text, whether it passed) from its pytest log."""
    lines = [line.strip(" =") for line in log.splitlines()]
    counts = [line for line in lines if COUNT.search(line)]
    interrupted = "KeyboardInterrupt" in log
    if counts:
        text = counts[-1] + ("; interrupted at the budget" if interrupted else "")
        return text, not interrupted and not re.search(r"\b\d+ (failed|errors?)\b", counts[-1])
    marks = "".join(line.split()[0] for line in lines if PROGRESS.match(line))
    return (f"no summary (stopped); {marks.count('.')} passed, {marks.count('F')} failed, "
            f"{marks.count('E')} errors so far"), False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--seconds", required=True, type=int)
    unset = "unknown ({} unset)"
    ap.add_argument("--commit", default=os.environ.get("FSALAB_GIT_COMMIT", "")[:7] or unset.format("FSALAB_GIT_COMMIT"))
    ap.add_argument("--tests-commit",
                    default=os.environ.get("FSALAB_TESTS_COMMIT", "")[:7] or unset.format("FSALAB_TESTS_COMMIT"))
    ap.add_argument("--chunk", action="append", default=[], help="the test files of one chunk, in order")
    args = ap.parse_args(argv)
    lines = [f"# bash scripts/gpu/run_gpu_tests.sh {len(args.chunk)} at {args.commit}, tests of {args.tests_commit}"]
    ok = True
    for i, files in enumerate(args.chunk):
        log = args.out / f"pytest-gpu-{i}.log"
        text, passed = chunk_result(log.read_text(errors="replace")) if log.exists() else ("no log", False)
        ok &= passed
        lines.append(f"chunk {i}: {files} -> {text}")
    lines.append(f"all chunks: {args.seconds} s, status {0 if ok else 1}")
    summary = "\n".join(lines) + "\n"
    (args.out / "pytest-gpu-summary.txt").write_text(summary)
    print(summary, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
