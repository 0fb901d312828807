"""Which of a grid's missing points fit in a device call's time: a point filter for run_grid.sh.

    python3 scripts/gpu/fit_points.py EXPERIMENT FILTER SECONDS [--platform h200] [--results-dir results]
                                      [--pace 1.25] [--margin 30]

A runner stopped at its time limit loses the point it is running (its device time, and a log
full of the interrupt's traceback). This picks, among the points of EXPERIMENT whose id matches
FILTER and that have no point file yet, a set whose expected seconds fit in SECONDS less
``--margin`` (the runner's start: imports, CUDA), longest first, and prints a filter matching
exactly those ids (FILTER itself when every missing point fits). Expected seconds of a point:
the ``elapsed_s`` of its newest row set aside by ``fsalab supersede``
(``results/<platform>/superseded/<experiment>/<id>.<commit>.json``) times ``--pace`` (host-bound
points ran up to 1.9x their earlier time on another device host); a point never measured counts
as the median of those measured. Exit status 3, with the reason on stderr, when no missing point
fits or none is missing; 0 otherwise, with a summary line on stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from fsalab.bench.grid import expand, load_experiment  # noqa: E402
from fsalab.results import SUPERSEDED  # noqa: E402

NOTHING_TO_RUN = 3


def newest_elapsed(superseded: Path) -> dict[str, float]:
    """Point id -> ``elapsed_s`` of its newest set-aside row that recorded one (files
    ``<id>.<commit>.json``; newest by the row's provenance timestamp)."""
    newest: dict[str, tuple[str, float]] = {}
    for path in superseded.glob("*.json"):
        row = json.loads(path.read_text())
        if row.get("elapsed_s") is None:
            continue
        point_id = path.name.rsplit(".", 2)[0]
        timed = ((row.get("provenance") or {}).get("timestamp") or "", float(row["elapsed_s"]))
        newest[point_id] = max(newest.get(point_id, timed), timed)
    return {point_id: seconds for point_id, (_, seconds) in newest.items()}


def fit(expected: dict[str, float], seconds: float) -> list[str]:
    """Ids whose expected seconds sum to at most ``seconds``, taken longest first (first fit)."""
    chosen, used = [], 0.0
    for point_id, need in sorted(expected.items(), key=lambda item: (-item[1], item[0])):
        if used + need <= seconds:
            chosen.append(point_id)
            used += need
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("filter", help="regular expression on point ids (re.search), as the runners take it")
    ap.add_argument("seconds", type=float, help="the runner's time limit")
    ap.add_argument("--platform", default="h200")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--pace", type=float, default=1.25, help="factor on the set-aside rows' seconds")
    ap.add_argument("--margin", type=float, default=30.0, help="seconds of the runner's start")
    args = ap.parse_args(argv)
    root = Path(args.results_dir) / args.platform
    exp = load_experiment(args.experiment)
    ids = [p["id"] for p in expand(exp) if re.search(args.filter, p["id"])]
    name = exp["experiment"]
    missing = [i for i in ids if not (root / name / f"{i}.json").exists()]
    if not missing:
        print(f"fit_points {name}: no point of filter {args.filter!r} is missing", file=sys.stderr)
        return NOTHING_TO_RUN
    earlier = newest_elapsed(root / SUPERSEDED / name)
    known = {i: earlier.get(i) for i in missing}
    measured = [s for s in known.values() if s is not None]
    if not measured:  # nothing to judge by: run them all, as the runner would
        print(f"fit_points {name}: {len(missing)} points, none measured before; all offered", file=sys.stderr)
        print(args.filter)
        return 0
    typical = statistics.median(measured)
    expected = {i: args.pace * (s if s is not None else typical) for i, s in known.items()}
    room = args.seconds - args.margin
    chosen = fit(expected, room)
    if not chosen:
        print(f"fit_points {name}: none of {len(missing)} missing points fits in {room:.0f} s "
              f"(the shortest needs ~{min(expected.values()):.0f} s)", file=sys.stderr)
        return NOTHING_TO_RUN
    need = sum(expected[i] for i in chosen)
    print(f"fit_points {name}: {len(chosen)} of {len(missing)} missing points, ~{need:.0f} s expected of {room:.0f} s "
          f"(pace {args.pace})", file=sys.stderr)
    print(args.filter if len(chosen) == len(missing) else "^(?:" + "|".join(map(re.escape, chosen)) + ")$")
    return 0


if __name__ == "__main__":
    sys.exit(main())
