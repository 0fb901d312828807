"""Shared state: mode, platform, experiments and their points (expanded by fsalab.bench.grid,
the same code the runner uses, so the workflow and `fsalab bench-kernel` agree on point ids)."""

import re
import sys
from pathlib import Path

ROOT = Path(workflow.basedir).parent
# Use the checkout's package even when fsalab is not installed in this environment.
sys.path.insert(0, str(ROOT / "src"))

from fsalab.bench import grid  # noqa: E402


def _cuda_available():
    import torch

    return torch.cuda.is_available()


# Decided here, not inherited by jobs: `fsalab` itself selects the Triton interpreter on a
# machine without CUDA (a slurm login node may lack the GPU its jobs get).
ON_GPU = _cuda_available()

MODE = config["mode"] if config["mode"] != "auto" else ("full" if ON_GPU else "smoke")
# Whether a measurement job needs a GPU: on a GPU machine, and for the paper-scale grids planned
# where there is none (a slurm login node submitting to GPU nodes), which only a GPU can run.
JOBS_NEED_GPU = ON_GPU or MODE in ("full", "paper")
SMOKE = MODE == "smoke"
PAPER = MODE == "paper"
# The grid overlay every runner of this run is given (experiments/smoke.yaml, experiments/paper.yaml).
SMOKE_FLAG = "--smoke" if SMOKE else "--paper" if PAPER else ""
# One process per experiment for the tiny smoke grids (interpreter start-up dominates them).
BATCH_POINTS = config["batch_points"] if config["batch_points"] is not None else SMOKE


def _platform():
    if config["platform"]:
        return config["platform"]
    if not ON_GPU:
        return "cpu-interpret"  # `fsalab` runs kernels through the Triton interpreter without CUDA
    from fsalab.bench.provenance import detect_platform

    name = detect_platform()
    # Tiny smoke points must never mix with a GPU's real results.
    return f"{name}-smoke" if SMOKE and not name.startswith("cpu") else name


PLATFORM = _platform()
FIGURES_PLATFORM = config["figures_platform"]
# The paper profile measures the experiments experiments/paper.yaml holds, in its order (most-cited
# artefacts first), and the cost model.
_NAMES = ([n for n in ("theory", *grid.load_overlay("paper")["experiments"]) if n in config["experiments"]]
          if PAPER else config["experiments"])
for _name in _NAMES:  # before an overlay, which has no entry for them
    if grid.is_parallel(grid.load_experiment(_name)):
        raise ValueError(f"experiment {_name} runs under torchrun, its ids naming a rank count: name it in the "
                         f"torchrun config with its rank counts (e.g. --config torchrun='{{{_name}: [2]}}'), "
                         "not in experiments")
EXPERIMENTS = {name: grid.load_experiment(name, smoke=SMOKE, paper=PAPER and name != "theory") for name in _NAMES}
# Experiments measured point by point with `fsalab bench-<runner>` (one result file per point):
# kernel, dram, compile, versus, decode and the end-to-end runners train, prefill, convergence.
POINT_RUNNERS = ("kernel", "dram", "compile", "train", "prefill", "convergence", "versus", "decode")
POINT_EXPERIMENTS = [n for n, e in EXPERIMENTS.items() if e["runner"] in POINT_RUNNERS]
# Experiments whose points run in one process per experiment: all of them with batch_points;
# versus always (it times the points of a group side by side, so one point alone is no job).
BATCH_EXPERIMENTS = [n for n in POINT_EXPERIMENTS if BATCH_POINTS or EXPERIMENTS[n]["runner"] == "versus"]
# With slice_s, the other experiments run in slices: consecutive points expected to take at most
# slice_s seconds in one process (fsalab.bench.budget: each point's last measured time).
SLICE_S = config["slice_s"]
SLICED_EXPERIMENTS = [n for n in POINT_EXPERIMENTS if SLICE_S and n not in BATCH_EXPERIMENTS]
SINGLE_POINT_EXPERIMENTS = [n for n in POINT_EXPERIMENTS if n not in BATCH_EXPERIMENTS + SLICED_EXPERIMENTS]
_EXPANDED = {n: grid.expand(EXPERIMENTS[n]) for n in POINT_EXPERIMENTS}
if config.get("point_filter"):
    _EXPANDED = {n: [p for p in pts if re.search(config["point_filter"], p["id"])] for n, pts in _EXPANDED.items()}
POINTS = {n: [p["id"] for p in pts] for n, pts in _EXPANDED.items()}


def _slices(experiment):
    """The experiment's points cut into slices of at most SLICE_S expected seconds, estimated
    from this platform's measured rows, else other platforms' (read only: parsing writes nothing)."""
    from fsalab.bench import budget

    measured = budget.measured_anywhere(PLATFORM, experiment, ROOT / "results", EXPERIMENTS[experiment].get("timing"))
    points = _EXPANDED[experiment]
    return budget.slices(points, budget.estimates(points, measured), SLICE_S)


SLICES = {n: [[p["id"] for p in piece] for piece in _slices(n)] for n in SLICED_EXPERIMENTS}

# Multi-GPU experiments (config torchrun: experiment -> rank counts), each at its rank counts in
# one torchrun job over its whole grid (rules/bench.smk), on a host of HOST_GPUS GPUs whose
# results folder is TORCHRUN_PLATFORM (<platform>x<GPUs>). Their own YAML in every mode: the
# smoke and paper overlays hold no multi-GPU grid. No benchmark runs in figures mode.
TORCHRUN = ({name: sorted({int(n) for n in counts}) for name, counts in config["torchrun"].items()}
            if MODE != "figures" else {})
TORCHRUN_EXPERIMENTS = {name: grid.load_experiment(name) for name in TORCHRUN}
for _name, _exp in TORCHRUN_EXPERIMENTS.items():
    if not grid.is_parallel(_exp):
        raise ValueError(f"torchrun: experiment {_name} has no parallel (fsdp, tp) point; a one-process "
                         "experiment belongs in experiments")


def _host_gpus():
    if config["host_gpus"]:
        return config["host_gpus"]
    import torch

    return torch.cuda.device_count() if ON_GPU else 0


HOST_GPUS = _host_gpus() if TORCHRUN else 0
if TORCHRUN and not HOST_GPUS:
    raise ValueError("torchrun: no CUDA here to count the host's GPUs: name them with --config host_gpus=<GPUs>")
for _name, _counts in TORCHRUN.items():
    if max(_counts) > HOST_GPUS:
        raise ValueError(f"torchrun: {_name} at {max(_counts)} ranks needs as many GPUs; the host has {HOST_GPUS} "
                         "(host_gpus)")


def _machine_platform():
    """The platform of the machine's GPU, never a smoke folder: the multi-GPU grids have no smoke overlay."""
    if config["platform"] or not ON_GPU:
        return config["platform"] or "cpu-interpret"
    from fsalab.bench.provenance import detect_platform

    return detect_platform()


TORCHRUN_PLATFORM = f"{_machine_platform()}x{HOST_GPUS}" if TORCHRUN else ""
# (experiment, ranks) -> point ids of the job: the whole grid at that rank count (point_filter applied).
TORCHRUN_POINTS = {}
for _name, _counts in TORCHRUN.items():
    for _n in _counts:
        _ids = [p["id"] for p in grid.expand(TORCHRUN_EXPERIMENTS[_name], ranks=_n)]
        TORCHRUN_POINTS[_name, _n] = [i for i in _ids if re.search(config["point_filter"] or ".", i)]


def torchrun_point_files(wildcards):
    """The point files of a multi-GPU experiment's table: those of the rank counts this run
    measures, and those of the host's other rank counts already on disk (a TP = 1 run stays in
    the table beside a TP = 2 one; read only: parsing writes nothing)."""
    name, folder = wildcards.experiment, f"results/{TORCHRUN_PLATFORM}/{wildcards.experiment}"
    files = []
    for n in range(1, HOST_GPUS + 1):
        if n in TORCHRUN[name]:
            files += [f"{folder}/{p}.json" for p in TORCHRUN_POINTS[name, n]]
        else:
            ids = (p["id"] for p in grid.expand(TORCHRUN_EXPERIMENTS[name], ranks=n))
            files += [f"{folder}/{i}.json" for i in ids if (ROOT / folder / f"{i}.json").is_file()]
    return files


def torchrun_tables():
    """The tables of the multi-GPU experiments this run measures."""
    return [f"results/{TORCHRUN_PLATFORM}/{name}.csv" for name in TORCHRUN]


def figures_dir(platform):
    """paper_figures/ for the platform the paper's figures come from, else under results/."""
    return "paper_figures" if platform == FIGURES_PLATFORM else f"results/{platform}/figures"


def rendered_dir(platform, notebook):
    """Where a notebook renders its figures (the Snakemake output): results/<platform>/figures/<notebook>."""
    return f"results/{platform}/figures/{notebook}"


def publish_flag(platform, notebook):
    """`--publish paper_figures/<notebook>` for figures_platform (copied there only on success)."""
    return f"--publish paper_figures/{notebook}" if platform == FIGURES_PLATFORM else ""


def experiments_of_notebook(notebook):
    """Experiments whose YAML names this notebook (defaults to the experiment's own name)."""
    names = set(config["experiments"]) | {notebook}
    out = []
    for name in sorted(names & set(grid.known_experiments())):
        exp = EXPERIMENTS.get(name) or grid.load_experiment(name)
        if exp.get("notebook", name) == notebook:
            out.append(name)
    return out


def multi_gpu_tables(platform, notebook):
    """CSVs of this notebook's experiments measured on multi-GPU hosts of the platform's GPU
    (results/<platform>x<GPUs>/, e.g. train_fsdp and prefill_tp under torchrun), already on disk
    or made by this run's torchrun jobs."""
    from fsalab.results import multi_gpu_hosts

    out = []
    for host in multi_gpu_hosts(platform, ROOT / "results"):
        for path in sorted((ROOT / "results" / host).glob("*.csv")):
            name = path.stem
            if name in grid.known_experiments() and grid.load_experiment(name).get("notebook", name) == notebook:
                out.append(str(path.relative_to(ROOT)))
    # Those this run makes (torchrun), whose host folder may not exist yet.
    if re.fullmatch(rf"{re.escape(platform)}x\d+", TORCHRUN_PLATFORM):
        out += [t for t, e in zip(torchrun_tables(), TORCHRUN_EXPERIMENTS.values())
                if e.get("notebook", e["experiment"]) == notebook and t not in out]
    return out


def tables(platform, notebook):
    """The CSVs a notebook reads: all of them for this machine's platform (made by rules), only
    those already on disk for another platform (e.g. the committed results/h200/), plus the
    multi-GPU hosts' ones."""
    paths = [f"results/{platform}/{e}.csv" for e in experiments_of_notebook(notebook)]
    if platform == PLATFORM and MODE != "figures":
        own = [p for p, e in zip(paths, experiments_of_notebook(notebook)) if e in EXPERIMENTS]
    else:
        own = [p for p in paths if (ROOT / p).is_file()]
    return own + multi_gpu_tables(platform, notebook)


def figure_platforms():
    """Platforms whose figures this run (re)makes."""
    plats = [] if MODE == "figures" else [PLATFORM]
    if FIGURES_PLATFORM not in plats and (ROOT / "results" / FIGURES_PLATFORM).is_dir():
        plats.append(FIGURES_PLATFORM)
    return plats


def reproduction_path(platform):
    return "REPRODUCTION.md" if platform == FIGURES_PLATFORM else f"results/{platform}/REPRODUCTION.md"


def all_targets():
    targets = []
    if MODE != "figures":
        targets += [f"results/{PLATFORM}/{e}.csv" for e in EXPERIMENTS] + torchrun_tables()
    for plat in figure_platforms():
        for nb in config["notebooks"]:
            if tables(plat, nb):
                targets.append(rendered_dir(plat, nb))
        if config["reproduction"]:
            targets.append(reproduction_path(plat))
    return targets


def bench_command(experiment):
    """`fsalab` subcommand of an experiment's runner (bench-kernel, bench-dram, bench-train, ...)."""
    return f"bench-{EXPERIMENTS[experiment]['runner']}"


def point_files(wildcards):
    """Result files of every point of an experiment (the aggregate rule's input)."""
    return [f"results/{wildcards.platform}/{wildcards.experiment}/{p}.json" for p in POINTS[wildcards.experiment]]


def reproduction_inputs(platform):
    """Tables and figure folders REPRODUCTION.md is generated from: the notebooks' and those of
    experiments without a notebook (compile), made by this run or already on disk."""
    figs = [rendered_dir(platform, nb) for nb in config["notebooks"] if tables(platform, nb)]
    notebook_tables = [t for nb in config["notebooks"] for t in tables(platform, nb)]
    made = platform == PLATFORM and MODE != "figures"
    others = [f"results/{platform}/{e}.csv" for e in grid.known_experiments()
              if (made and e in EXPERIMENTS) or (ROOT / "results" / platform / f"{e}.csv").is_file()]
    return sorted(set(notebook_tables + others)) + figs + reproduction_code()


def reproduction_code():
    """The code and paper values REPRODUCTION.md is written by, where this checkout has them (a
    copied workflow runs the installed package): a change to a verdict rule or a claim rewrites
    the document on the next run, as a new result does."""
    files = sorted((ROOT / "src" / "fsalab" / "reproduction").glob("*.py"))
    paper_values = ROOT / "src" / "fsalab" / "data" / "paper_values.yaml"
    if paper_values.is_file():
        files.append(paper_values)
    return [str(f.relative_to(ROOT)) for f in files]


def figure_code():
    """The code the notebooks draw and tabulate with, where this checkout has it: the metrics
    (``reproduction``) and ``plotting.py``; a change to either renders the figures again, as a
    new result does."""
    plotting = ROOT / "src" / "fsalab" / "plotting.py"
    return reproduction_code() + ([str(plotting.relative_to(ROOT))] if plotting.is_file() else [])
