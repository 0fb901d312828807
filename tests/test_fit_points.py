"""scripts/gpu/fit_points.py: of a grid's missing points, those whose earlier seconds fit in a
device call's time, longest first, as a filter of their ids."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from fsalab.bench.grid import expand, load_experiment

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "fit_points.py"


def _fit(results, pace, *positional):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--results-dir", str(results), "--margin", "10",
                           *(["--pace", pace] if pace else []), "--", *positional],
                          capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout.strip(), proc.stderr


def _grid(tmp_path):
    """The generate grid's ids; the first is measured already, the next four were set aside
    with 100, 60, 50 and 30 s (the 60 s one twice: the newest row counts), the rest never ran."""
    ids = [p["id"] for p in expand(load_experiment("generate"))]
    root = tmp_path / "h200"
    (root / "generate").mkdir(parents=True)
    (root / "superseded" / "generate").mkdir(parents=True)
    (root / "generate" / f"{ids[0]}.json").write_text("{}")
    set_aside = [(1, 100, "2026-01-01", "aaaaaaa"), (2, 999, "2026-01-01", "bbbbbbb"), (2, 60, "2026-02-01", "ccccccc"),
                 (3, 50, "2026-01-01", "aaaaaaa"), (4, 30, "2026-01-01", "aaaaaaa")]
    for i, seconds, stamp, commit in set_aside:
        row = {"elapsed_s": seconds, "provenance": {"timestamp": stamp}}
        (root / "superseded" / "generate" / f"{ids[i]}.{commit}.json").write_text(json.dumps(row))
    return ids


def test_picks_the_longest_missing_points_that_fit(tmp_path):
    ids = _grid(tmp_path)
    # 100 + 60 = 160 fit in 180 - 10; 50 does not after them, 30 does not either (190 > 170).
    rc, out, err = _fit(tmp_path, "1", "generate", ".", "180")
    assert rc == 0, err
    chosen = {i for i in ids if re.search(out, i)}
    assert chosen == {ids[1], ids[2]}
    assert f"2 of {len(ids) - 1} missing points, ~160 s expected of 170 s (pace 1.0)" in err


def test_unmeasured_points_count_as_the_median_and_the_pace_scales(tmp_path):
    ids = _grid(tmp_path)
    # Measured 100, 60, 50, 30 (median 55); at pace 2: 200, 120, 100, 60 and 110 for each never run.
    rc, out, _ = _fit(tmp_path, "2", "generate", ".", "140")
    assert rc == 0 and {i for i in ids if re.search(out, i)} == {ids[2]}  # 120 of 130
    rc, out, _ = _fit(tmp_path, "2", "generate", ".", "10000")
    assert rc == 0 and out == "."  # every missing point fits: the filter as given


def test_nothing_to_run_exits_3(tmp_path):
    ids = _grid(tmp_path)
    rc, out, err = _fit(tmp_path, "1", "generate", ".", "35")
    assert rc == 3 and out == "" and "the shortest needs ~30 s" in err
    measured_only = "-" + re.escape(ids[0][len("generate-"):])  # a filter starting with "-"
    rc, _, err = _fit(tmp_path, None, "generate", measured_only, "1000")
    assert rc == 3 and "is missing" in err


STUB_PYTHON = """#!/usr/bin/env bash
# python3 for run_grid.sh: `-m fsalab.cli env` prints nothing, `-m fsalab.cli bench-*` logs its
# filter and writes a point file for every missing id it matches (in no time); the rest is Python.
if [ "$1" = -m ] && [ "$2" = fsalab.cli ]; then
  [ "$3" = env ] && exit 0
  exec {python} - "$@" <<'PY'
import json, os, re, sys
from fsalab.bench.grid import expand, load_experiment
args = sys.argv[1:]
flt = next(a for a in args if a.startswith("--filter="))[len("--filter="):]
exp = load_experiment(args[args.index("--experiment") + 1])
wrote = []
for p in expand(exp):
    path = f"results/h200/{{exp['experiment']}}/{{p['id']}}.json"
    if re.search(flt, p["id"]) and not os.path.exists(path):
        open(path, "w").write("{{}}")
        wrote.append(p["id"])
with open("runner.log", "a") as log:
    log.write(json.dumps({{"filter": flt, "wrote": wrote}}) + "\\n")
PY
fi
exec {python} "$@"
"""


def _run_grid(tmp_path, budget, **env):
    """run_grid.sh generate over the grid of ``_grid`` in a scratch checkout, with the stub runner;
    returns (exit status, the runner's calls)."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for name in ("run_grid.sh", "fit_points.py", "pack_results.sh"):
        shutil.copy(ROOT / "scripts" / "gpu" / name, repo / "scripts" / "gpu")
    (repo / "src").symlink_to(ROOT / "src")
    shutil.copytree(tmp_path / "h200", repo / "results" / "h200")
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(STUB_PYTHON.format(python=sys.executable))
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), **env}
    env.pop("DEADLINE", None)
    proc = subprocess.run(["bash", "scripts/gpu/run_grid.sh", "generate", ".", str(budget)], cwd=repo, env=env,
                          capture_output=True, text=True, check=False)
    log = repo / "runner.log"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert (tmp_path / "out" / "results.tgz").exists(), proc.stderr
    return proc.returncode, calls


def test_run_grid_runs_fitted_rounds_until_nothing_is_left_or_fits(tmp_path):
    """run_grid.sh offers the runner only the points fit_points picks (defaults: pace 1.25, 30 s
    to start), again while time is left: with 200 s, the first round gets the 100 s and 30 s
    points (125 + 37.5 of 170 s); the stub takes no time, so later rounds fit more, four at most."""
    ids = _grid(tmp_path)
    rc, calls = _run_grid(tmp_path, 200)
    assert rc == 0 and len(calls) == 4
    assert sorted(calls[0]["wrote"]) == sorted([ids[1], ids[4]])
    assert all(call["filter"] != "." and call["wrote"] for call in calls)
    assert len({i for call in calls for i in call["wrote"]}) == sum(len(call["wrote"]) for call in calls)


def test_run_grid_without_fitting_passes_the_filter_through(tmp_path):
    ids = _grid(tmp_path)
    rc, calls = _run_grid(tmp_path, 200, FIT_POINTS="0")
    assert rc == 0 and [call["filter"] for call in calls] == ["."] and len(calls[0]["wrote"]) == len(ids) - 1
