"""Behaviour is chosen by arguments (``fsalab.settings``, the runners' flags, the notebooks'
parameters), not by environment variables: the settings API, its flags, and a scan of src/ for
every environment variable the library reads or sets, each of which README's table lists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fsalab
from fsalab import cli, settings
from fsalab.checks import check_block_idx_values, check_cu_seqlens
from fsalab.ops.selected import dispatch

SRC = Path(fsalab.__file__).resolve().parent
ROOT = SRC.parents[1]
# Variables the library may set in its own process: each must precede a library's start (the
# interpreter before triton's import, the allocator's options before CUDA's).
SET_IN_PROCESS = {"TRITON_INTERPRET", "PYTORCH_CUDA_ALLOC_CONF"}
# Switches that became settings or arguments: no text of the repository may name them any more.
REMOVED = ("FSALAB_DISPATCH", "FSALAB_AUTOTUNE", "FSALAB_VALUE_CHECKS", "FSALAB_PLATFORM",
           "FSALAB_PLATFORM_RESULTS", "FSALAB_FIGURES", "FSALAB_RESULTS")


# ---------------------------------------------------------------- the settings API


def test_defaults_and_configure_returns_the_previous_settings():
    assert settings.Settings() == settings.Settings(dispatch="profile", autotune=True, value_checks=True)
    before = settings.current
    previous = settings.configure(dispatch="rules")
    assert previous is before
    assert settings.current == settings.Settings(dispatch="rules", autotune=before.autotune,
                                                 value_checks=before.value_checks)
    settings.configure(value_checks=False)  # None leaves the others as they are
    assert settings.current.dispatch == "rules" and settings.current.value_checks is False


def test_bad_values_are_errors_and_change_nothing():
    before = settings.current
    with pytest.raises(ValueError, match="dispatch must be one of"):
        settings.configure(dispatch="fastest")
    with pytest.raises(TypeError, match="autotune must be True or False"):
        settings.configure(autotune="0")
    assert settings.current is before


def test_override_restores_the_settings_also_when_the_block_raises():
    before = settings.current
    with pytest.raises(RuntimeError), settings.override(value_checks=False, dispatch="rules") as inside:
        assert settings.current is inside and not inside.value_checks and inside.dispatch == "rules"
        raise RuntimeError
    assert settings.current is before


def test_value_checks_off_skips_the_value_checks():
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)  # not ascending, ends past the 4 tokens
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(bad, 4, bad.device)
    block_idx = torch.full((4, 1, 1), 9, dtype=torch.int32)  # a block after the token's own
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        check_block_idx_values(block_idx, cu, 16)
    with settings.override(value_checks=False):
        check_cu_seqlens(bad, 4, bad.device)
        check_block_idx_values(block_idx, cu, 16)
    with pytest.raises(ValueError):  # on again after the block
        check_cu_seqlens(bad, 4, bad.device)


def _cuda_like(g: int):
    """Stand-ins for q and k on a CUDA device: all ``choose`` reads before it profiles."""
    device = SimpleNamespace(type="cuda")
    q = SimpleNamespace(shape=(8, 2 * g, 16), device=device)
    k = SimpleNamespace(shape=(8, 2, 16), device=device)
    q.detach = k.detach = lambda: None
    return q, k


def test_dispatch_setting_chooses_between_profiling_and_the_rules(monkeypatch):
    profiled = []
    monkeypatch.setattr(dispatch, "_memory", {})
    monkeypatch.setattr(dispatch, "shape_key", lambda *args: "key-grad0")
    monkeypatch.setattr(dispatch, "_load", dict)
    monkeypatch.setattr(dispatch, "_store", lambda key, impl: None)
    monkeypatch.setattr(dispatch, "_profile", lambda *args: profiled.append(args) or ("nsa", "nsa"))
    q, k = _cuda_like(g=16)
    settings.configure(dispatch="rules")
    assert dispatch.choose(q, k, k, None, None, 16) == dispatch.rule(16) == ("fsa", "nsa")
    assert not profiled
    settings.configure(dispatch="profile")
    assert dispatch.choose(q, k, k, None, None, 16) == ("nsa", "nsa")
    assert len(profiled) == 1


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("command", [*cli.POINT_RUNNERS, *cli.FORWARDED])
def test_every_runner_takes_the_settings_flags(command):
    if command in cli.FORWARDED:
        from fsalab.bench import e2e_cli

        parser = e2e_cli.parser("train_step" if command == "bench-train" else command.removeprefix("bench-"))
        args = parser.parse_args(["--dispatch", "rules", "--no-autotune"])
    else:
        args = cli.build_parser().parse_args([command, "--experiment", "kernel", "--dispatch", "rules",
                                              "--no-autotune"])
    settings.apply_arguments(args)
    assert settings.current.dispatch == "rules" and settings.current.autotune is False


def test_flags_not_given_leave_the_settings_alone():
    settings.configure(dispatch="rules", autotune=False)
    settings.apply_arguments(cli.build_parser().parse_args(["bench-kernel", "--experiment", "kernel"]))
    assert settings.current.dispatch == "rules" and settings.current.autotune is False


def test_child_processes_get_the_settings_as_flags(monkeypatch):
    """The compile runner's children run with the parent's settings."""
    from fsalab.bench import compile as first_call

    settings.configure(dispatch="rules", autotune=False)
    assert settings.as_arguments() == ["--dispatch", "rules", "--no-autotune"]
    seen = {}

    def run(cmd, **kwargs):
        seen.update(cmd=cmd, env=kwargs["env"])
        return SimpleNamespace(returncode=0, stdout=first_call.RESULT_TAG + "{}", stderr="")

    monkeypatch.setattr(first_call.subprocess, "run", run)
    first_call._child({"op": "selected"}, 1, "/tmp/cache")
    assert seen["cmd"][-3:] == ["--dispatch", "rules", "--no-autotune"]
    assert seen["env"]["FSALAB_DISPATCH_CACHE"] == "" and seen["env"]["TRITON_CACHE_DIR"] == "/tmp/cache"


def test_the_test_suites_no_autotune_flag_reaches_the_settings(pytester_probe):
    """``pytest --no-autotune`` (the GPU test runs, scripts/gpu/run_gpu_tests.sh) turns autotune
    off in the test session: a second ``pytest_configure`` in the conftest once replaced the
    first and the flag silently did nothing."""
    assert pytester_probe("--no-autotune") == "autotune=False"


def test_each_test_worker_gets_its_share_of_the_cores(tmp_path):
    """Under ``pytest -n 2`` (``make test``) each worker starts with the thread pools of numpy's
    BLAS and of OpenMP sized to its share of the cores (tests/conftest.py), not a thread per core
    each; a variable the caller set is kept."""
    import os

    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    share = max(1, (os.cpu_count() or 1) // 2)
    (tmp_path / "test_probe.py").write_text(
        "import os\n\n\ndef test_probe():\n"
        "    assert os.environ.get('PYTEST_XDIST_WORKER')\n"
        f"    assert os.environ['OPENBLAS_NUM_THREADS'] == os.environ['OMP_NUM_THREADS'] == '{share}'\n"
        "    assert os.environ['MKL_NUM_THREADS'] == '7'\n")
    # A fresh session: not a worker of this one (make test runs this test inside one).
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS") and not k.startswith("PYTEST_XDIST")}
    env["MKL_NUM_THREADS"] = "7"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "test_probe.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.fixture
def pytester_probe(tmp_path):
    """Runs a one-test session of this suite's conftest with the given pytest arguments (no
    xdist) and returns what the test printed: the session's autotune setting."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(
        "from fsalab import settings\n\n\ndef test_probe():\n"
        "    print(f'autotune={settings.current.autotune}')\n")

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:xdist", "-p", "no:cacheprovider",
                              *args, "test_probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return re.search(r"autotune=\w+", out.stdout).group(0)

    return run


def test_platform_is_an_argument_that_reaches_the_row_and_not_the_environment(tmp_path, monkeypatch):
    """``--platform`` names the row's folder and its provenance; the process's environment stays
    as it was (a platform named there is not read either)."""
    import json
    import os

    from fsalab.bench import kernel
    from fsalab.bench.provenance import detect_platform

    monkeypatch.setenv("FSALAB_PLATFORM", "from-env")
    assert detect_platform() != "from-env"
    monkeypatch.setattr(kernel, "kernel_row", lambda p, platform: {}["h_kv"])  # a failure row: nothing runs
    before = dict(os.environ)
    out = tmp_path / "row.json"
    assert cli.main(["bench-kernel", "--experiment", "kernel", "--op", "selected", "--impl", "fsa", "--N", "64",
                     "--direction", "fwd", "--g", "1", "--platform", "unit-cpu", "--results-dir", str(tmp_path),
                     "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["platform"] == row["provenance"]["platform"] == "unit-cpu"
    assert dict(os.environ) == before


# ---------------------------------------------------------------- the environment


def _environ_uses(tree: ast.AST) -> list[tuple[ast.AST, bool]]:
    """(the expression around each ``os.environ`` / ``os.getenv``, whether it writes the variable)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")):
            continue
        around, write = node, node.attr == "putenv"
        while not isinstance(around, (ast.Call, ast.Subscript, ast.Compare, ast.Dict)) and around in parents:
            around = parents[around]
        if isinstance(around, ast.Call) and isinstance(around.func, ast.Attribute):
            write |= around.func.attr in ("setdefault", "update", "pop", "__setitem__")
        if isinstance(around, ast.Subscript) and isinstance(around.ctx, (ast.Store, ast.Del)):
            write = True
        found.append((around, write))
    return sorted(found, key=lambda use: (use[0].lineno, use[0].col_offset))


def environment_uses() -> dict[str, set[str]]:
    """Variable name -> 'read' / 'set' (in this process) / 'child' (a child process's env), over src/."""
    uses: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for around, write in _environ_uses(ast.parse(path.read_text(), filename=str(path))):
            names = {n.value for n in ast.walk(around) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and re.fullmatch(r"[A-Z][A-Z0-9_]+", n.value)}
            where = f"{path.relative_to(SRC)}:{around.lineno}"
            assert names, f"{where} reaches the environment without naming a variable"
            kind = "child" if isinstance(around, ast.Dict) else "set" if write else "read"
            for name in names:
                uses.setdefault(name, set()).add(kind)
    return uses


def documented() -> set[str]:
    """The variables of README's table (section "Settings and environment")."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings and environment\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}


def test_the_library_uses_only_the_documented_variables():
    uses = environment_uses()
    assert set(uses) == documented(), (f"undocumented: {sorted(set(uses) - documented())}; "
                                       f"documented but unused: {sorted(documented() - set(uses))}")
    set_here = {name for name, kinds in uses.items() if "set" in kinds}
    assert set_here <= SET_IN_PROCESS, sorted(set_here - SET_IN_PROCESS)


def test_the_scan_sees_reads_writes_and_child_environments():
    tree = ast.parse('import os\na = os.environ.get("A_B")\nos.environ["C"] = "1"\n'
                     'b = "D" in os.environ\nenv = {**os.environ, "E": ""}\nos.environ.setdefault("F", "1")\n'
                     'c = os.getenv("G")\nd = os.environ[name]\n')
    got = [(sorted(n.value for n in ast.walk(a) if isinstance(n, ast.Constant) and str(n.value).isupper()), w)
           for a, w in _environ_uses(tree)]
    assert got == [(["A_B"], False), (["C"], True), (["D"], False), (["E"], False), (["F"], True), (["G"], False),
                   ([], False)]


def _tracked_text() -> list[Path]:
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-z", "src", "scripts", "workflow", "docs", "tests", "analysis",
                              "README.md", "Makefile", "pyproject.toml"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.decode().split("\0") if f and not f.endswith((".png", ".pdf", ".gz"))]


def test_no_text_names_a_removed_switch():
    pattern = re.compile(r"\b(" + "|".join(REMOVED) + r")\b")
    me = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)}:{i}" for path in _tracked_text() if path.resolve() != me and path.is_file()
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not found, found
