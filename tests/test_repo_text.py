"""The repository's text speaks of the project: no tracked file, by name or content, dates a change
by a work-history label (one of the words below followed by a number); changes are dated by commit
or date and their history lives in git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A label is one of these words followed by a number, optionally joined by '-', '_' or ' ', or '#'.
WORK_HISTORY = re.compile(r"\b(?:sessions?|issues?|calls?)[-_ ]?#?\d", re.IGNORECASE)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.decode().split("\0") if f]


def _is_binary(data: bytes) -> bool:
    return b"\0" in data[:8192]  # git's own test


# Labels the pattern must catch, assembled from their parts so that this file holds none itself
# (word, joiner, number, the text around it).
_LABEL_PARTS = [("session", " ", "9", "{}"), ("Session", "-", "8", "{} results"), ("sessions", " ", "6", "{}, 8 and 9"),
                ("session", "", "9", "{}-x"), ("call", " ", "3", "{}"), ("calls", " ", "2", "{}-3"),
                ("call", "", "4", "grid-kernel-{}.log"), ("issue", " ", "7", "{}"), ("Issue", " #", "12", "{}"),
                ("issue", " ", "6", "({})")]


@pytest.mark.parametrize("word,joiner,number,around", _LABEL_PARTS)
def test_pattern_catches_labels(word, joiner, number, around):
    assert WORK_HISTORY.search(around.format(word + joiner + number))


@pytest.mark.parametrize("text", [
    "one device call", "per call: 26 launches", "the recall 3", "syscall 2", "a process group session",
    "cp.async is issued", "issues found: none", "callable 1", "commit 9017e2e", "2026-11-29",
])
def test_pattern_spares_words(text):
    assert not WORK_HISTORY.search(text)


def test_no_work_history_labels_in_tracked_text():
    hits = []
    for name in _tracked_files():
        if WORK_HISTORY.search(name):
            hits.append(f"{name}: file name")
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if _is_binary(data):
            continue
        text = data.decode("utf-8", "replace")
        for m in WORK_HISTORY.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            hits.append(f"{name}:{line}: {m.group(0)!r}")
    assert not hits, "work-history labels (use a commit hash or a date):\n" + "\n".join(hits)
