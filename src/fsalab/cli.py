"""``fsalab`` command line: environment report, benchmark runners, aggregation, notebooks.

    fsalab env                                   platform, GPU, versions as JSON
    fsalab points --experiment kernel [--smoke]  the grid's point ids
    fsalab bench-kernel --experiment kernel --point ID            one grid point -> one JSON
    fsalab bench-kernel --experiment kernel --op selected --impl fsa --N 65536 --g 4 ...
    fsalab bench-kernel --experiment kernel --all [--skip-existing]   the whole grid, in-process
    fsalab bench-kernel ... --dispatch rules --no-autotune        settings (fsalab.settings) of every runner
    fsalab bench-dram --experiment dram --all                     DRAM bytes under Nsight Compute
    fsalab bench-compile --experiment compile --all               first-call compile + autotune time
    fsalab bench-versus --experiment versus --all [--filter N65536]  NSA vs cuDNN, interleaved
    fsalab bench-decode --experiment decode --all                 decode step, inference, generate
    fsalab bench-train|bench-prefill|bench-convergence ...   end-to-end runners (fsalab.bench.*)
    fsalab theory --experiment theory --out results/<platform>/theory.csv
    fsalab supersede --platform h200 --min-commit SHA [--filter RE] [--dry-run]   set aside rows of older commits
    fsalab collect OUT/results.tgz ...           add a device call's new point files, re-aggregate
    fsalab aggregate --experiment kernel [--platform h200]        -> results/<platform>/kernel.csv
    fsalab migrate-ids                           rename result files to the ids their parameters give
    fsalab notebook analysis/kernel.ipynb --platform h200 --figures paper_figures
    fsalab reproduction --platform h200 --out REPRODUCTION.md

Without a CUDA device, Triton kernels run through the interpreter (TRITON_INTERPRET=1 is set
before anything imports triton) and results go to ``results/cpu-interpret/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import settings
from .bench.flops import H200_CEILINGS


def _prepare_device():
    """The benchmark device; selects the Triton interpreter when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    return torch.device("cuda")


def cmd_env(args) -> int:
    _prepare_device()
    from .bench.provenance import provenance

    print(json.dumps(provenance(), indent=2))
    return 0


def _load(args):
    from .bench import grid

    return grid.load_experiment(args.experiment, smoke=args.smoke, paper=args.paper)


def cmd_points(args) -> int:
    from .bench import grid

    for p in grid.expand(_load(args), ranks=args.ranks):
        print(p["id"])
    return 0


def _parse_option(text: str):
    key, _, value = text.partition("=")
    if not key or not _:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    import yaml

    return key, yaml.safe_load(value)


_PARAM_FLAGS = ("op", "impl", "direction", "N", "batch", "h_kv", "g", "d", "block_size", "topk",
                "kernel_size", "kernel_stride", "window_size", "dtype", "seed", "label")


def _point_from_args(args, exp: dict) -> dict | None:
    """A point from --point (id or a JSON/YAML file) or from parameter flags; None if neither.

    A point given by parameters must make a valid NSA configuration: an impossible one is an
    error here, not an ``unsupported`` row."""
    from .bench import grid
    from .bench.points import nsa_config

    if args.point:
        path = Path(args.point)
        if path.suffix not in (".json", ".yaml", ".yml"):
            return grid.find_point(exp, args.point)
        if not path.is_file():
            raise ValueError(f"point file {args.point} does not exist")
        raw = grid.read_yaml(path)
        if not isinstance(raw, dict):
            raise ValueError(f"point file {args.point} must hold a mapping of parameters, got {type(raw).__name__}")
    else:
        raw = {k: getattr(args, k) for k in _PARAM_FLAGS if getattr(args, k) is not None}
        if args.option:
            raw["options"] = dict(args.option)
        if not raw:
            return None
    point = _expand_one(exp, raw)
    if "kernel_size" not in raw and point["kernel_size"] > point["block_size"]:
        # A block smaller than the default compression window (32 tokens): the window shrinks to
        # the block (NSA needs l <= l'), with its stride if that is longer too.
        raw = {**raw, "kernel_size": point["block_size"]}
        raw.setdefault("kernel_stride", min(point["kernel_stride"], point["block_size"]))
        point = _expand_one(exp, raw)
    nsa_config(point)
    return point


def _expand_one(exp: dict, raw: dict) -> dict:
    """The one point of ``exp`` (its defaults) with the parameters ``raw``."""
    from .bench import grid

    # A mapping value on a grid axis is merged into the point, so nest mappings (options) one level.
    one = dict(exp, grid=[{(f"_{k}" if isinstance(v, dict) else k): [{k: v} if isinstance(v, dict) else v]
                           for k, v in raw.items()}])
    return grid.expand(one)[0]


# Point runners of kernel-level experiments: command -> experiment runner (module fsalab.bench.<runner>).
# A runner module with its own run_points (versus: groups of points timed together) uses it.
POINT_RUNNERS = {"bench-kernel": "kernel", "bench-dram": "dram", "bench-compile": "compile", "bench-versus": "versus",
                 "bench-decode": "decode"}


def _apply_alloc_conf(exp: dict) -> None:
    """Set the experiment's ``cuda_alloc_conf`` as PYTORCH_CUDA_ALLOC_CONF; call before CUDA starts.

    The allocator reads the variable once, when CUDA is first used, so a later change would not
    apply; a different value already set is refused rather than silently overridden."""
    wanted = exp.get("cuda_alloc_conf")
    if wanted is None:
        return
    have = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if have not in (None, "", wanted):
        raise SystemExit(f"experiment {exp['experiment']!r} runs with PYTORCH_CUDA_ALLOC_CONF={wanted!r}, "
                         f"the environment sets {have!r}; unset it or make it match")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = wanted


def cmd_bench_kernel(args) -> int:
    exp = _load(args)
    _apply_alloc_conf(exp)
    device = _prepare_device()
    import importlib

    from .bench import grid, kernel, rows
    from .bench.provenance import detect_platform

    settings.apply_arguments(args)
    if exp["runner"] != POINT_RUNNERS[args.command]:
        print(f"experiment {exp['experiment']!r} uses the {exp['runner']!r} runner, not {args.command}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"fsalab.bench.{exp['runner']}")
    run_point = module.run_point
    platform = args.platform or detect_platform()
    point = _point_from_args(args, exp)
    if point is None:
        if not args.all:
            print("give --point, parameter flags (--op --impl --N --g ...), or --all", file=sys.stderr)
            return 2
        import re

        points = [p for p in grid.expand(exp) if re.search(args.filter, p["id"])]
        if exp["runner"] == "versus":  # it runs whole groups of points side by side
            if args.budget_s is not None:
                print("the versus runner times whole groups: --budget-s does not apply", file=sys.stderr)
                return 2
            module.run_points(points, exp, device, args.results_dir, platform, args.skip_existing, force=args.force)
        else:
            kernel.run_points(points, exp, device, args.results_dir, platform, args.skip_existing, runner=run_point,
                              force=args.force, budget_s=args.budget_s)
        return 0
    out = args.out or rows.result_path(args.results_dir, platform, point["experiment"], point["id"])
    rows.check_writable(out, platform, args.force)
    row = rows.run_safely(run_point, point, exp, device, platform)
    rows.write_row(row, out, args.force)
    median = f"{row['median_ms']:.4f} ms" if row.get("median_ms") is not None else row["message"][:200]
    print(f"{point['id']}: {row['status']} {median} -> {out}", file=sys.stderr)
    return 0


# `fsalab bench-<runner> ...` -> fsalab.bench.<module>.main(argv): end-to-end runners own their flags.
FORWARDED = {"bench-train": "train", "bench-prefill": "prefill", "bench-convergence": "convergence"}


def forward(command: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(f"fsalab.bench.{FORWARDED[command]}").main(argv)


def cmd_plan(args) -> int:
    from .bench import budget, grid

    names = args.experiment or (list(grid.load_overlay("paper")["experiments"]) if args.paper else grid.known_experiments())
    total = 0.0
    print(f"{'experiment':<12} {'points':>6} {'timed before':>12} {'slices':>6} {'expected s':>10} {'longest slice s':>15}")
    for name in names:
        exp = grid.load_experiment(name, smoke=args.smoke, paper=args.paper)
        if exp["runner"] == "theory" or (grid.is_parallel(exp) and not args.experiment):
            continue
        points = grid.expand(exp, ranks=args.ranks)
        measured = budget.measured_anywhere(args.platform, name, args.results_dir, exp.get("timing"))
        expected = budget.estimates(points, measured)
        pieces = budget.slices(points, expected, args.slice_s)
        seconds = [budget.START_S + sum(expected[p["id"]] for p in piece) for piece in pieces]
        total += sum(seconds)
        print(f"{name:<12} {len(points):>6} {sum(p['id'] in measured for p in points):>12} {len(pieces):>6} "
              f"{sum(seconds):>10.0f} {max(seconds):>15.0f}")
    print(f"{'all':<12} {'':>6} {'':>12} {'':>6} {total:>10.0f}  ({total / 60:.0f} min)")
    return 0


def cmd_theory(args) -> int:
    from .bench import grid
    from .theory import table

    exp = _load(args)
    if exp["runner"] != "theory":
        print(f"experiment {exp['experiment']!r} is not a theory experiment", file=sys.stderr)
        return 2
    import pandas as pd

    rows = []
    for p in grid.expand(exp):
        for r in table([p.N], [p.g], [(p.block_size, p.topk)], p.h_kv, p.d, [p.cost_model]):
            rows.append({"experiment": exp["experiment"], "op": "selected", "direction": "fwd", "model": "",
                         "batch": 1, "dtype": "bfloat16", "status": "ok", "point": p.id, **r})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"{len(rows)} rows -> {out}", file=sys.stderr)
    return 0


def cmd_aggregate(args) -> int:
    from . import results
    from .bench.grid import load_experiment

    platform = args.platform or _detect_platform_quiet()
    # Names (or YAML paths) of real experiments: an unknown one is an error listing the known ones, not an empty CSV.
    names = [load_experiment(exp)["experiment"] for exp in args.experiment]
    if args.out and len(names) > 1:
        raise ValueError("--out names one table: give one --experiment")
    for exp in names:
        points = [Path(f).stem for f in args.points] if args.points is not None else None
        out = results.aggregate(platform, exp, args.results_dir, args.out, force=args.force, points=points)
        print(f"{out}: {results.row_count(out)} rows", file=sys.stderr)
    return 0


def cmd_migrate_ids(args) -> int:
    from . import results

    for old, new in results.migrate_point_ids(args.results_dir, dry_run=args.dry_run):
        print(f"{old} -> {new}")
    return 0


def cmd_supersede(args) -> int:
    from . import results

    moves = results.supersede(args.platform, args.min_commit, args.results_dir, args.experiment, args.dry_run,
                              args.filter)
    by_experiment: dict[str, list[str]] = {}
    for old, new in moves:
        print(f"{old} -> {new}")
        by_experiment.setdefault(Path(old).parent.name, []).append(old if args.dry_run else new)
    for experiment, paths in sorted(by_experiment.items()):
        print(f"{experiment}: {len(paths)} point files, {results.rerun_seconds(paths):.0f} s of device time when "
              "measured", file=sys.stderr)
    print(f"{len(moves)} point files measured before {args.min_commit} {'would move' if args.dry_run else 'moved'}",
          file=sys.stderr)
    return 0


def cmd_restore(args) -> int:
    from . import results

    moves = results.restore_unmeasured(args.platform, args.results_dir, args.experiment, args.dry_run)
    for copy, original in moves:
        print(f"{copy} -> {original}")
    verb = "would be" if args.dry_run else "were"
    print(f"{len(moves)} point files set aside and not measured again {verb} put back; "
          "re-aggregate with `fsalab aggregate`", file=sys.stderr)
    return 0


def cmd_collect(args) -> int:
    from . import results

    found = results.collect(args.archives, args.results_dir, args.dry_run)
    for rel in found["kept"]:
        print(f"kept this tree's {rel}: the archive's differs (supersede it first to take the new one)", file=sys.stderr)
    touched = sorted({Path(rel).parts[:2] for rel in found["added"]})
    for platform, experiment in touched:
        n = sum(Path(rel).parts[:2] == (platform, experiment) for rel in found["added"])
        print(f"{platform}/{experiment}: {n} point files {'would be ' if args.dry_run else ''}added", file=sys.stderr)
        if not args.dry_run and not args.no_aggregate:
            csv = results.results_root(args.results_dir) / platform / f"{experiment}.csv"
            before = results.row_count(csv) or 0
            # The table may shrink here: `supersede` set rows aside that no archive measured again.
            results.aggregate(platform, experiment, args.results_dir, fewer_ok=True)
            after = results.row_count(csv)
            print(f"{csv}: {after} rows" + (f", {before - after} fewer than before" if after < before else ""),
                  file=sys.stderr)
    print(f"{len(found['added'])} added, {len(found['same'])} already here, {len(found['kept'])} kept (differing), "
          f"{len(found['superseded'])} set aside here before", file=sys.stderr)
    return 0


def _detect_platform_quiet() -> str:
    _prepare_device()
    from .bench.provenance import detect_platform

    return detect_platform()


def replace_dir(new: Path, dest: Path) -> None:
    """Put folder ``new`` (on dest's file system) in place of ``dest``: the old folder moves
    aside first and is deleted only once ``new`` is in place."""
    import shutil

    old = dest.with_name(f".{dest.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    if old.exists():
        shutil.rmtree(old)


def parameters_cell(**parameters):
    """The first cell of a headless notebook run: Agg for the figure files (in Jupyter the
    notebooks draw inline), then the run's parameters (``plotting.set_parameters``)."""
    import nbformat

    given = ", ".join(f"{name}={value!r}" for name, value in parameters.items())
    source = ("# Parameters of this run (fsalab notebook)\nimport matplotlib\n\nmatplotlib.use(\"Agg\")\n\n"
              f"from fsalab import plotting\n\nplotting.set_parameters({given})")
    return nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})


def cmd_notebook(args) -> int:
    import shutil
    import tempfile

    import nbformat
    from nbclient import NotebookClient

    from . import results
    from .bench.repo import repo_root

    if not Path(args.notebook).is_file():
        raise ValueError(f"notebook {args.notebook} does not exist")
    results.platform_folder(args.platform, args.results_dir)
    dest = Path(args.figures).resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Figures go to a temporary folder beside dest and replace it only when every cell ran.
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    staging.chmod(0o755)
    results_dir = str(Path(args.results_dir).resolve()) if args.results_dir else None
    nb = nbformat.read(args.notebook, as_version=4)
    nb.cells.insert(0, parameters_cell(platform=args.platform, results_dir=results_dir, figures_dir=str(staging)))
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(repo_root())}})
    try:
        client.execute()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if args.executed:
            Path(args.executed).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, args.executed)
    replace_dir(staging, dest)
    for target in map(Path, args.publish or []):
        target = target.resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        copy = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)) / "figures"
        shutil.copytree(dest, copy, ignore=shutil.ignore_patterns(".snakemake_timestamp"))
        replace_dir(copy, target)
        copy.parent.rmdir()
    return 0


def cmd_floors(args) -> int:
    from . import results
    from .reproduction.metrics import floors

    results.platform_folder(args.platform, args.results_dir)
    df = results.load_table(args.platform, args.experiment, args.results_dir)
    for column in ("N", "g", "block_size"):
        value = getattr(args, column)
        if value is not None and column in df.columns:
            df = df[df[column] == value]
    table = floors(df, args.tflops, args.tbps)
    if table.empty:
        print(f"no ok row of {args.experiment} on {args.platform} matches", file=sys.stderr)
        return 2
    table["useful_tflop"] = table.pop("useful_flops") / 1e12
    table["compulsory_gb"] = table.pop("compulsory_bytes") / 1e9
    print(table.sort_values(["op", "impl", "direction", "N", "g"]).to_markdown(index=False, floatfmt=".3g"))
    return 0


def cmd_freshness(args) -> int:
    from . import results
    from .reproduction.document import freshness_report

    results.platform_folder(args.platform, args.results_dir)
    for r in freshness_report(args.platform, args.results_dir).itertuples():
        print(f"{r.artefact}: {r.state} (rows of {r.commits}; {r.experiments})")
        for path in filter(None, r.changed.split(", ")):
            print(f"    {path}")
    return 0


def cmd_reproduction(args) -> int:
    from . import results
    from .reproduction import update_readme, write_reproduction

    results.platform_folder(args.platform, args.results_dir)
    out = write_reproduction(args.platform, args.out, args.results_dir, args.figures)
    print(f"{out}", file=sys.stderr)
    if args.readme:
        print(f"{update_readme(args.readme, args.platform, args.results_dir)}", file=sys.stderr)
    return 0


# Help of the ad-hoc point flags (bench-kernel ... --op selected --impl fsa --N 65536 --g 4).
_PARAM_HELP = {
    "op": "ad-hoc point: the op (selected, compressed, window, full_attention, nsa_attention; "
          "bench-decode: decode_step, inference, generate)",
    "impl": "ad-hoc point: the implementation (fsa, fsa_paper, nsa, auto, reference, a full-attention backend ...)",
    "direction": "ad-hoc point: fwd, bwd or fwd+bwd",
    "N": "ad-hoc point: tokens per sequence",
    "batch": "ad-hoc point: sequences in the batch",
    "h_kv": "ad-hoc point: KV heads",
    "g": "ad-hoc point: query heads per KV head (GQA group size)",
    "d": "ad-hoc point: head dimension",
    "block_size": "ad-hoc point: selection block B_K in tokens (a longer default compression window shrinks to it)",
    "topk": "ad-hoc point: selected blocks T per token and KV head",
    "kernel_size": "ad-hoc point: compression window l in tokens",
    "kernel_stride": "ad-hoc point: compression stride s in tokens",
    "window_size": "ad-hoc point: sliding window w in tokens",
    "dtype": "ad-hoc point: float16, bfloat16 or float32",
    "seed": "ad-hoc point: seed of the random inputs",
    "label": "ad-hoc point: free-form series label (not part of the point id)",
}


def results_dir_arg(p, default: str | None = "results") -> None:
    p.add_argument("--results-dir", default=default,
                   help=f"root of the results/<platform>/ folders (default: {default or 'the checkout results/'})")


def kernel_parser(sub, command: str, experiment_args) -> None:
    """Arguments of the point runners (bench-kernel: timing; bench-dram: Nsight Compute DRAM bytes)."""
    what = {"bench-kernel": "time", "bench-dram": "profile the DRAM traffic of",
            "bench-compile": "time the first call (Triton compile + autotune) of",
            "bench-versus": "time side by side (interleaved, eager and CUDA graph)",
            "bench-decode": "time decode steps, prefill + decode and generate() of"}[command]
    ops = "decode_step, inference, generate" if command == "bench-decode" else "selected, compressed, window, full, nsa"
    p = sub.add_parser(command, help=f"{what} kernel-level points ({ops})")
    experiment_args(p)
    p.add_argument("--point", help="a point id of the experiment, or a JSON/YAML file of parameters")
    p.add_argument("--all", action="store_true", help="run every point of the grid in this process")
    p.add_argument("--skip-existing", action="store_true", help="with --all: keep result files already there")
    p.add_argument("--filter", default=".", help="with --all: only point ids matching this regular expression")
    p.add_argument("--budget-s", type=float, help="with --all: start only the points expected to end within this many "
                   "seconds (their last measured time), leave the rest for a later run")
    p.add_argument("--out", help="result file (default results/<platform>/<experiment>/<point>.json)")
    results_dir_arg(p)
    p.add_argument("--platform", help="override the detected platform name")
    p.add_argument("--force", action="store_true",
                   help="write even into another machine's results folder or over its row (importing copies)")
    for flag in _PARAM_FLAGS:
        kind = str if flag in ("op", "impl", "direction", "dtype", "label") else int
        p.add_argument(f"--{flag.replace('_', '-')}" if flag != "N" else "--N", dest=flag, type=kind,
                       help=_PARAM_HELP[flag])
    p.add_argument("--option", action="append", type=_parse_option, help="impl switch key=value (repeatable)")
    settings.add_arguments(p)
    p.set_defaults(func=cmd_bench_kernel)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsalab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("env", help="platform, GPU, driver and library versions as JSON").set_defaults(func=cmd_env)

    def experiment_args(p):
        p.add_argument("--experiment", required=True, help="experiments/<name>.yaml (a name or a path)")
        overlay = p.add_mutually_exclusive_group()
        overlay.add_argument("--smoke", action="store_true", help="use the tiny grid of experiments/smoke.yaml")
        overlay.add_argument("--paper", action="store_true", help="use the paper's points (experiments/paper.yaml)")

    p = sub.add_parser("points", help="list the point ids of an experiment")
    experiment_args(p)
    p.add_argument("--ranks", type=int, default=None,
                   help="the rank count a parallel experiment (train_fsdp, prefill_tp) runs at, which its ids name")
    p.set_defaults(func=cmd_points)

    for command in POINT_RUNNERS:
        kernel_parser(sub, command, experiment_args)

    for name, module in FORWARDED.items():  # listed for --help; main() forwards them before parsing
        sub.add_parser(name, help=f"end-to-end runner fsalab.bench.{module} (see `fsalab {name} --help`)")

    p = sub.add_parser("plan", help="what a run costs: each experiment's points, slices and expected seconds, from "
                       "the points' last measured times (x 1.25)")
    p.add_argument("--experiment", nargs="+", help="experiments/<name>.yaml (default: all; with --paper, the paper's)")
    overlay = p.add_mutually_exclusive_group()
    overlay.add_argument("--smoke", action="store_true", help="the tiny grids of experiments/smoke.yaml")
    overlay.add_argument("--paper", action="store_true", help="the paper's points (experiments/paper.yaml)")
    p.add_argument("--platform", default="h200", help="whose measured times to plan with (others fill the gaps)")
    p.add_argument("--slice-s", type=float, default=480.0, help="the most expected seconds of one slice (one job)")
    p.add_argument("--results-dir", default="results", help="where the measured point files are")
    p.add_argument("--ranks", type=int, default=None,
                   help="the rank count of a parallel experiment named with --experiment (the default list leaves "
                        "them out: they run under torchrun, not in slices)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("theory", help="memory/FLOP model table of a theory experiment")
    experiment_args(p)
    p.add_argument("--out", required=True, help="the CSV to write (results/<platform>/theory.csv)")
    p.set_defaults(func=cmd_theory)

    p = sub.add_parser("aggregate", help="point files -> results/<platform>/<experiment>.csv")
    p.add_argument("--experiment", nargs="+", required=True, help="experiments/<name>.yaml (names or paths)")
    p.add_argument("--platform", help="the results/<platform>/ folder to read (default: this machine's)")
    results_dir_arg(p)
    p.add_argument("--out", help="output CSV (one experiment only; never another platform's folder)")
    p.add_argument("--force", action="store_true",
                   help="aggregate rows measured on another machine too, and replace a table of more rows")
    p.add_argument("--points", nargs="*",
                   help="only these point files (one experiment; default: every file of the folder)")
    p.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("migrate-ids", help="rename result files whose point id is not the one their parameters give")
    results_dir_arg(p)
    p.add_argument("--dry-run", action="store_true", help="print the renames only")
    p.set_defaults(func=cmd_migrate_ids)

    p = sub.add_parser("supersede", help="move point files measured before a commit to results/<platform>/superseded/")
    p.add_argument("--platform", required=True, help="the results/<platform>/ folder to sort")
    p.add_argument("--min-commit", required=True, help="rows of this commit or its descendants stay")
    p.add_argument("--experiment", nargs="+", help="only these experiments (default: all)")
    p.add_argument("--filter", help="only points whose id matches this regular expression")
    results_dir_arg(p)
    p.add_argument("--dry-run", action="store_true", help="print the moves only")
    p.set_defaults(func=cmd_supersede)

    p = sub.add_parser("restore", help="put back the point files supersede set aside that no run has measured again")
    p.add_argument("--platform", required=True, help="the results/<platform>/ folder")
    p.add_argument("--experiment", nargs="+", help="only these experiments (default: all)")
    results_dir_arg(p)
    p.add_argument("--dry-run", action="store_true", help="print the moves only")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("collect", help="add the point files of device calls' results.tgz this tree lacks, then "
                       "re-aggregate the experiments that gained rows")
    p.add_argument("archives", nargs="+", help="results.tgz files (scripts/gpu/pack_results.sh packs them)")
    results_dir_arg(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be added only")
    p.add_argument("--no-aggregate", action="store_true", help="leave the CSVs as they are")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("notebook", help="execute an analysis notebook headless")
    p.add_argument("notebook", help="the notebook to run (analysis/<name>.ipynb)")
    p.add_argument("--platform", required=True, help="results/<platform>/ to read")
    p.add_argument("--figures", required=True,
                   help="folder for figures and tables (replaced only when the notebook runs through)")
    p.add_argument("--publish", action="append",
                   help="also copy the finished folder here, replacing it (paper_figures/<notebook>; repeatable)")
    results_dir_arg(p, None)
    p.add_argument("--executed", help="where to save the executed notebook")
    p.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    p.set_defaults(func=cmd_notebook)

    p = sub.add_parser("floors", help="each measured row's FLOP and byte floor beside its time (a markdown table)")
    p.add_argument("--platform", required=True, help="results/<platform>/ to read")
    p.add_argument("--experiment", default="breakdown", help="the table to read (default: breakdown, each op alone)")
    p.add_argument("--results-dir", default="results", help="where the results tables are")
    p.add_argument("--N", type=int, help="only rows of N tokens per sequence")
    p.add_argument("--g", type=int, help="only rows of GQA group size g")
    p.add_argument("--block-size", type=int, help="only rows of selection block size B_K")
    p.add_argument("--tflops", type=float, default=H200_CEILINGS["tflops"],
                   help="the GPU's dense bf16 MMA ceiling in TFLOP/s (default: the H200's, measured)")
    p.add_argument("--tbps", type=float, default=H200_CEILINGS["tbps"],
                   help="the GPU's copy ceiling in TB/s (default: the H200's, measured)")
    p.set_defaults(func=cmd_floors)

    p = sub.add_parser("freshness", help="per artefact: fresh or stale, and the source files changed since its rows")
    p.add_argument("--platform", default="h200", help="results/<platform>/ to read (default: h200)")
    p.add_argument("--results-dir", default="results", help="where the results tables are")
    p.set_defaults(func=cmd_freshness)

    p = sub.add_parser("reproduction", help="write REPRODUCTION.md from results")
    p.add_argument("--platform", required=True, help="results/<platform>/ to read (and its multi-GPU hosts')")
    p.add_argument("--out", required=True, help="the Markdown file to write")
    results_dir_arg(p, None)
    p.add_argument("--figures", help="folder holding the figures to link")
    p.add_argument("--readme", help="also rewrite this README's generated blocks from the same results")
    p.set_defaults(func=cmd_reproduction)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``fsalab``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in FORWARDED:
            return forward(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except ValueError as exc:  # bad configs, unknown names, a row bound for another machine's folder
        print(f"fsalab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
