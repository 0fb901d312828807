"""Freshness of an artefact's rows: the files each experiment executes, and which of them changed
since the rows' commit (``fsalab.reproduction.freshness``)."""

from __future__ import annotations

import subprocess

import pytest

from fsalab.reproduction import freshness as fr


def test_an_experiment_executes_its_runner_and_the_kernels_named_by_string():
    kernel = fr.experiment_sources("kernel")
    # The impl table imports the FSA kernels by module name (a string), not by an import statement.
    assert {"src/fsalab/bench/kernel.py", "src/fsalab/ops/selected/fsa.py", "src/fsalab/ops/selected/nsa.py",
            "src/fsalab/__init__.py"} <= set(kernel)
    assert not any(f.startswith(("src/fsalab/reproduction/", "experiments/")) for f in kernel)
    decode = fr.experiment_sources("decode")
    assert "src/fsalab/ops/decode/step.py" in decode and "src/fsalab/bench/decode.py" in decode
    assert "src/fsalab/bench/kernel.py" not in decode


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def tiny_repo(tmp_path, monkeypatch):
    """A git checkout with a runner that imports one kernel by statement and one by name."""
    src = tmp_path / "src" / "fsalab"
    for folder in (src, src / "bench", src / "ops"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (src / "bench" / "runner.py").write_text("from ..ops import direct\nIMPLS = {'x': 'fsalab.ops.named'}\n")
    (src / "ops" / "direct.py").write_text("A = 1\n")
    (src / "ops" / "named.py").write_text("B = 2\n")
    (src / "ops" / "unused.py").write_text("C = 3\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, check=True, capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.setenv("FSALAB_ROOT", str(tmp_path))
    for cached in (fr.module_closure, fr.experiment_sources, fr.changed_since):
        cached.cache_clear()
    monkeypatch.setattr(fr, "runner_module", lambda experiment: "fsalab.bench.runner")
    yield tmp_path, commit
    for cached in (fr.module_closure, fr.experiment_sources, fr.changed_since):
        cached.cache_clear()


def test_rows_go_stale_when_an_executed_file_changes(tiny_repo):
    repo, commit = tiny_repo
    assert set(fr.experiment_sources("exp")) == {
        "src/fsalab/__init__.py", "src/fsalab/bench/__init__.py", "src/fsalab/bench/runner.py",
        "src/fsalab/ops/__init__.py", "src/fsalab/ops/direct.py", "src/fsalab/ops/named.py"}
    assert fr.freshness((commit[:7],), ("exp",)) == fr.Freshness(fr.FRESH)
    (repo / "src/fsalab/ops/unused.py").write_text("C = 4\n")  # not executed: still fresh
    fr.changed_since.cache_clear()
    assert fr.freshness((commit[:7],), ("exp",)).state == fr.FRESH
    (repo / "src/fsalab/ops/named.py").write_text("B = 3\n")  # uncommitted changes count
    fr.changed_since.cache_clear()
    assert fr.freshness((commit[:7],), ("exp",)) == fr.Freshness(fr.STALE, ("src/fsalab/ops/named.py",))


def test_a_move_without_a_change_keeps_rows_fresh(tiny_repo):
    repo, commit = tiny_repo
    _git(repo, "mv", "src/fsalab/ops/unused.py", "src/fsalab/ops/moved.py")
    assert fr.changed_since(commit) == frozenset()
    (repo / "src/fsalab/ops/moved.py").write_text("C = 5\n")
    fr.changed_since.cache_clear()
    assert "src/fsalab/ops/moved.py" in fr.changed_since(commit)


def test_freshness_is_unknown_where_git_cannot_tell(tiny_repo):
    assert fr.freshness(("0" * 40,), ("exp",)).state == fr.UNKNOWN
    assert fr.freshness((), ("exp",)).state == fr.UNKNOWN


def test_freshness_command_lists_each_stale_artefacts_changed_files(capsys):
    """``fsalab freshness``: a line per artefact with its state, and under a stale one the files
    changed since its rows (the documents show the state only)."""
    from fsalab import cli

    assert cli.main(["freshness", "--platform", "h200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(lines) if not line.startswith("    ")]
    assert heads and heads[0] == 0
    for i, j in zip(heads, heads[1:] + [len(lines)]):
        state = lines[i].split(": ", 1)[1].split(" ")[0]
        assert state in (fr.FRESH, fr.STALE, fr.UNKNOWN), lines[i]
        listed = lines[i + 1:j]
        assert (state == fr.STALE) == bool(listed), lines[i]
        assert all(line.strip().startswith("src/fsalab/") for line in listed)
