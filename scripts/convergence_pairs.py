"""Loss gaps between convergence runs of two code versions: this tree's `span32-S3000` runs and
the same ids at an earlier commit (whose files this tree's runs replaced), pair by pair.

Pairs that differ only in rounding (the same impl across versions, NSA against its gate-reference
twin) give the spread of the noise floor; FSA against NSA of one version is the gap it is judged
against. Median and max of |loss_a - loss_b| over the steps both logged, and the first step
with a gap above 0.02 (``fsalab.reproduction.loss_gaps``).

    PYTHONPATH=src python scripts/convergence_pairs.py --before fe425e3 [--platform h200]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from fsalab.reproduction import loss_gaps

# A run's file: this prefix and ".json" (ids before the parameter hash) or "-<8 hex>.json".
RUN = "results/{platform}/convergence/convergence-llama3-8b-{impl}-N4096-b8-L2-B64-T16-bf16-{tag}span32-S3000"


def run_file(prefix: str, names: list[str]) -> str:
    """The one file of ``names`` (paths) that is the run ``prefix``, with or without its hash."""
    found = [n for n in names if re.fullmatch(re.escape(prefix) + r"(-[0-9a-f]{8})?\.json", n)]
    if len(found) != 1:
        raise SystemExit(f"expected one result file for {prefix}, found {found}")
    return found[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit holding the earlier runs")
    ap.add_argument("--platform", default="h200")
    args = ap.parse_args()

    def now(impl, tag=""):
        prefix = RUN.format(platform=args.platform, impl=impl, tag=tag)
        with open(run_file(prefix, [str(p) for p in Path(prefix).parent.glob("*.json")])) as f:
            return json.load(f)["curve"]

    def before(impl):
        prefix = RUN.format(platform=args.platform, impl=impl, tag="")
        names = subprocess.check_output(["git", "ls-tree", "--name-only", f"{args.before}:{Path(prefix).parent}"],
                                        text=True).split()
        path = run_file(prefix, [f"{Path(prefix).parent}/{n}" for n in names])
        return json.loads(subprocess.check_output(["git", "show", f"{args.before}:{path}"]))["curve"]

    pairs = {
        "nsa before vs nsa (gate reference)": (before("nsa"), now("nsa", "gatereference-")),
        "nsa before vs nsa": (before("nsa"), now("nsa")),
        "nsa vs nsa (gate reference)": (now("nsa"), now("nsa", "gatereference-")),
        "fsa before vs fsa": (before("fsa"), now("fsa")),
        "fsa vs nsa, before": (before("fsa"), before("nsa")),
        "fsa vs nsa": (now("fsa"), now("nsa")),
    }
    print(f"{'pair':36s} {'median':>7s} {'max':>6s} {'first > 0.02':>12s}")
    for name, (a, b) in pairs.items():
        gap = loss_gaps(a, b)
        over = gap.index[gap > 0.02]
        print(f"{name:36s} {gap.median():7.3f} {gap.max():6.2f} {over[0] if len(over) else '-':>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
