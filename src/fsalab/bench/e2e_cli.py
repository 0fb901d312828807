"""The command line of the end-to-end runners (``fsalab bench-train``, ``bench-prefill``,
``convergence``): points from an experiment or one ad-hoc point from flags, run, rows written.

A runner's ``main`` calls ``run_cli`` with its ``run_point``; this module imports no runner.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from pathlib import Path

import yaml

from .. import settings
from .budget import budget_for
from .grid import expand, load_experiment
from .points import DTYPES, E2E_DEFAULTS, e2e_point_id
from .repo import repo_root
from .rows import check_writable, result_path, run_safely, write_row


def add_point_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by the end-to-end runners (experiment points or one ad-hoc point)."""
    ap.add_argument("--experiment", help="experiments/<name>.yaml (or a path)")
    ap.add_argument("--point", help="a point id of the experiment")
    ap.add_argument("--all", action="store_true", help="every point of the experiment, in this process")
    ap.add_argument("--list", action="store_true", help="print the experiment's point ids")
    ap.add_argument("--filter", default=".", help="with --all: only point ids matching this regular expression")
    overlay = ap.add_mutually_exclusive_group()
    overlay.add_argument("--smoke", action="store_true", help="the experiment's tiny entry in experiments/smoke.yaml")
    overlay.add_argument("--paper", action="store_true", help="the experiment's paper points (experiments/paper.yaml)")
    ap.add_argument("--skip-existing", action="store_true", help="with --point/--all: keep result files already there")
    ap.add_argument("--budget-s", type=float, help="with --all: start only the points expected to end within this "
                    "many seconds (their last measured time), leave the rest for a later run")
    ap.add_argument("--ranks", type=int, default=None,
                    help="the rank count this job was launched with (the workflow passes its own): refused unless it "
                         "is the torchrun world size; with --list, the rank count whose ids to list")
    ap.add_argument("--results-dir", default=None, help="default: <repo>/results")
    ap.add_argument("--platform", default=None, help="default: detected (h200, cpu-interpret, ...)")
    ap.add_argument("--out", help="ad-hoc point: write the row here (default: print it)")
    ap.add_argument("--force", action="store_true",
                    help="write even into another machine's results folder or over its row (importing copies)")
    for flag, kind, text in (("model", str, "model architecture (llama3-8b, qwen3-14b, qwen2.5-32b)"),
                             ("impl", str, "attention: fsa, fsa_paper, nsa, auto, reference or a full-attention "
                                           "backend"),
                             ("N", int, "tokens per sequence"), ("batch", int, "sequences in the batch"),
                             ("layers", int, "decoder layers to run (0: the whole model)"),
                             ("block-size", int, "selection block B_K in tokens"),
                             ("topk", int, "selected blocks T per token and KV head"),
                             ("window-size", int, "sliding window w in tokens"), ("seed", int, "random seed"),
                             ("loss-chunk", int, "tokens per chunk of the chunked cross-entropy loss"),
                             ("parallel", str, "none, fsdp or tp (under torchrun)")):
        ap.add_argument(f"--{flag}", type=kind, default=None, help=f"ad-hoc point: {text}")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="ad-hoc point: parameter and input dtype")
    ap.add_argument("--model-overrides", type=yaml.safe_load, default=None,
                    help="YAML/JSON mapping of config fields to replace (tiny test models)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default: the experiment's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default: the experiment's)")
    settings.add_arguments(ap)


def parser(op: str, description: str = "") -> argparse.ArgumentParser:
    """The command line of the end-to-end runner of ``op`` (``fsalab bench-<runner>``)."""
    ap = argparse.ArgumentParser(prog=f"fsalab bench-{op.split('_')[0]}", description=description)
    add_point_args(ap)
    return ap


def run_cli(argv, runner, op: str, default_dtype: str, defaults: dict | None = None) -> int:
    """Resolve points from an experiment or from flags, run them with ``runner(p, exp, device,
    platform) -> row``, write the rows.

    Exit status 0 once every point has its row on disk, failed points included (a failed point
    is a row: a non-zero status would make Snakemake delete the job's files, the good ones with
    it); an ad-hoc point printed instead of written exits 1 when it failed with ``error``."""
    from ..parallel import fsdp

    doc = sys.modules[runner.__module__].__doc__ or ""
    ap = parser(op, doc.split("\n\n")[0])
    args = ap.parse_args(argv)
    settings.apply_arguments(args)
    device = fsdp.setup_device()  # first: selects the Triton interpreter before triton is imported
    from .provenance import detect_platform

    # A parallel point's id names its rank count: the launcher's, which a rank count the caller
    # planned the job's files with must match.
    ranks = fsdp.world_size()
    if args.ranks is not None and args.ranks != ranks and not args.list:
        ap.error(f"--ranks {args.ranks}, but this job runs on {ranks} rank(s) (torchrun --nproc-per-node): its "
                 f"parallel points would be written under ids naming {ranks} rank(s), not the {args.ranks} asked for")
    if args.list and args.ranks is not None:
        ranks = args.ranks
    exp = load_experiment(args.experiment, args.smoke, args.paper) if args.experiment else {"experiment": op, "runner": {"train_step": "train"}.get(op, op), "grid": []}
    base = {**(defaults or {}), "op": op, "dtype": default_dtype}
    if args.list:
        for p in expand(exp, base, ranks):
            print(p["id"])
        return 0
    if args.warmup is not None or args.repeats is not None:
        exp["timing"] = {**exp.get("timing", {}), **{k: v for k, v in
                                                     (("warmup", args.warmup), ("repeats", args.repeats)) if v is not None}}
    if args.point or args.all:
        if not args.experiment:
            ap.error("--point/--all need --experiment")
        points = expand(exp, base, ranks)
        if args.all:
            points = [p for p in points if re.search(args.filter, p["id"])]
        if args.point:
            points = [p for p in points if p["id"] == args.point]
            if not points:
                ap.error(f"experiment {exp['experiment']!r} has no point {args.point!r}")
    else:
        flags = {k: getattr(args, k.replace("-", "_")) for k in
                 ("model", "impl", "N", "batch", "layers", "block_size", "topk", "window_size", "dtype", "seed",
                  "loss_chunk", "parallel", "model_overrides")}
        p = {**copy.deepcopy(E2E_DEFAULTS), **base, **exp.get("defaults", {})}
        p.update({k: v for k, v in flags.items() if v is not None})
        missing = [k for k in ("model", "impl", "N") if p.get(k) is None]
        if missing:
            ap.error(f"an ad-hoc point needs --{' --'.join(missing)} (or --experiment with --point/--all)")
        if p.get("parallel", "none") != "none":
            p["ranks"] = ranks
        p["experiment"], p["id"] = exp["experiment"], e2e_point_id(p)
        points = [p]
    platform = args.platform or detect_platform()
    results = Path(args.results_dir) if args.results_dir else repo_root() / "results"
    writes = bool(args.out or args.point or args.all)
    paths = [Path(args.out) if args.out else result_path(results, platform, p["experiment"], p["id"]) for p in points]
    for path in paths if writes else []:  # refuse before measuring anything (another machine's folder)
        if not (args.skip_existing and path.exists()):
            check_writable(path, platform, args.force)
    if args.budget_s is not None and fsdp.world_size() > 1:
        # Each rank would judge the budget on its own clock and could leave a different point.
        ap.error("--budget-s runs on one process; a torchrun job times every point it is given")
    status = 0
    budget = budget_for(points, args.budget_s, platform, results, exp.get("timing"))
    for i, (p, path) in enumerate(zip(points, paths), 1):
        if args.skip_existing and path.exists():
            continue
        if not budget.fits(p):
            if fsdp.rank() == 0:
                print(f"[{i}/{len(points)}] {p['id']}: {budget.note(p)}", file=sys.stderr, flush=True)
            continue
        started = time.time()
        row = run_safely(runner, p, exp, device, platform)
        budget.spend(time.time() - started)
        if fsdp.rank() == 0:
            if writes:
                write_row(row, path, args.force)
            lat = f"{row['median_ms']:.1f} ms" if row.get("median_ms") is not None else row["message"][:120]
            print(f"[{i}/{len(points)}] {p['id']}: {row['status']} {lat}", file=sys.stderr, flush=True)
            if not writes:
                print(json.dumps({k: v for k, v in row.items() if k not in ("provenance", "samples_ms")}, indent=1,
                                 default=str))
        if not writes:
            status = status or (row["status"] not in ("ok", "oom", "unsupported"))
    fsdp.teardown()
    return int(status)
