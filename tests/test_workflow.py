"""The Snakemake workflow: lint, a dry run of every profile, and the smoke run end to end.

Skipped with a reason when snakemake is not installed (`pip install -e '.[workflow,analysis]'`).
The end-to-end smoke run takes a few minutes on 2 CPU cores; FSALAB_E2E=0 skips it locally.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsalab.bench.repo import repo_root

ROOT = repo_root()
SNAKEMAKE = shutil.which("snakemake") or (
    str(Path(sys.executable).parent / "snakemake") if (Path(sys.executable).parent / "snakemake").exists() else None
)
pytestmark = pytest.mark.skipif(SNAKEMAKE is None, reason="snakemake is not installed (pip install -e '.[workflow]')")


def _snakemake(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)  # callers assert on returncode with the output


def test_lint_clean():
    out = _snakemake("--lint")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Congratulations, your workflow is in a good condition" in out.stdout + out.stderr


# ids avoid the bare word "gpu": conftest skips tests carrying a "gpu" keyword on CPU.
@pytest.mark.parametrize("profile", ["default", "smoke", "gpu", "slurm"], ids=lambda p: f"{p}-profile")
def test_dry_run(profile):
    # The slurm profile is planned by the dryrun executor, which needs no slurm plugin.
    extra = ["--executor", "dryrun", "--config", "platform=h200"] if profile == "slurm" else []
    # --forceall: plan every job even where results already exist.
    out = _snakemake("--workflow-profile", f"workflow/profiles/{profile}", "-n", "--forceall", "--quiet", "rules", *extra)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    if profile in ("gpu", "slurm"):
        # The paper-scale grids: one job per point.
        assert "bench_point" in text
    if profile == "smoke":
        assert "bench_kernel" in text and "aggregate" in text
        assert all(f"bench_{e}" in text for e in ("train", "prefill", "convergence"))


def test_paper_profile_plans_slices_of_the_papers_points_and_moves_nothing():
    """The paper profile plans the experiments of experiments/paper.yaml as slices whose point
    files are update() outputs (a cut slice keeps its finished points), asks a GPU for each, and
    parsing it writes or moves no file."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    out = _snakemake("--workflow-profile", "workflow/profiles/paper", "-n", "--forceall", "--config", "platform=h200",
                     "--", "results/h200/kernel.csv")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "bench_kernel_slice0" in text and "bench_point" not in text
    assert "--paper --all --skip-existing" in text and "--budget-s 480" in text and "gpu=1" in text
    assert "bench_versus" not in text  # versus is no paper artefact
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before


def test_torchrun_config_plans_a_job_per_rank_count_and_moves_nothing():
    """`torchrun` in the config plans one torchrun job per multi-GPU experiment and rank count:
    the YAML's runner under `python -m torch.distributed.run`, asked for that many ranks and GPUs
    with NVLink multicast off, its grid's point files (those committed under results/h200x2/
    among them) as update() outputs, and the host's table; parsing it writes or moves no file."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    out = _snakemake("-n", "--forceall", "--resources", "gpu=2", "--config", "platform=h200", "host_gpus=2",
                     "torchrun={prefill_tp: [1, 2]}", "--", "results/h200x2/prefill_tp.csv")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    jobs = {name: text.split(f"rule {name}:", 1)[1].split("\n\n", 1)[0]
            for name in ("torchrun_prefill_tp_1", "torchrun_prefill_tp_2", "aggregate_torchrun")}
    for n in (1, 2):
        job = jobs[f"torchrun_prefill_tp_{n}"]
        assert (f"python -m torch.distributed.run --standalone --nproc-per-node {n} -m fsalab.bench.prefill "
                "--experiment prefill_tp --all --skip-existing") in job
        assert f"--platform h200x2 --results-dir results --ranks {n} " in job and f"gpu={n}" in job
        assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in job
        outputs = set(re.findall(r"(results/h200x2/prefill_tp/\S+\.json) \(update\)", job))
        assert len(outputs) == 8 and all(f"-tp{n}-" in o for o in outputs)
        committed = subprocess.run(["git", "ls-files", "results/h200x2/prefill_tp"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.split()
        assert {c for c in committed if f"-tp{n}-" in c} <= outputs
    assert "fsalab aggregate --experiment prefill_tp --platform h200x2" in jobs["aggregate_torchrun"]
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before


def test_paper_scale_jobs_ask_for_a_gpu_where_the_planner_has_none():
    """Planned on a machine without CUDA (a slurm login node), the paper-scale grids still
    request a GPU per measurement job, and a whole-grid job (versus, batch_points) a runtime
    that fits a grid; the smoke grids request none."""
    def bench_versus_resources(platform, *args):
        out = _snakemake("-n", "--forceall", *args, f"platform={platform}", "--", f"results/{platform}/versus.csv")
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        job = text.split("rule bench_versus:", 1)[1]
        return next(line.strip() for line in job.splitlines() if line.strip().startswith("resources:"))

    import torch

    if torch.cuda.is_available():
        pytest.skip("the workflow plans every job on a GPU where it has one")
    slurm = bench_versus_resources("h200", "--workflow-profile", "workflow/profiles/slurm", "--executor", "dryrun",
                                   "--config")
    assert all(r in slurm for r in ("gpu=1", "runtime=240", "cpus_per_task=8", "mem_mb=64000")), slurm
    assert "gpu=1, runtime=240" in bench_versus_resources("h200", "--config", "mode=full")
    assert "gpu=0" in bench_versus_resources("cpu-interpret", "--config", "mode=smoke")


@pytest.mark.slow(290)
@pytest.mark.skipif(os.environ.get("FSALAB_E2E") == "0", reason="FSALAB_E2E=0 skips the smoke workflow end to end")
def test_smoke_end_to_end(tmp_path):
    """Every rule of the smoke profile in a scratch copy: results, tables, figures, REPRODUCTION.md."""
    for name in ("workflow", "experiments", "analysis"):
        shutil.copytree(ROOT / name, tmp_path / name)
    out = _snakemake("--workflow-profile", "workflow/profiles/smoke", "--config", "figures_platform=none",
                     cwd=tmp_path, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    plat = tmp_path / "results" / "cpu-interpret"
    for exp in ("theory", "kernel", "breakdown", "ablation", "buffers", "longctx", "compile", "train", "prefill",
                "convergence", "versus", "decode", "inference", "generate"):
        assert (plat / f"{exp}.csv").is_file()
    for fig in ("theory/figure2.png", "kernel/figure4_fwd.png", "breakdown/figure8.png", "ablation/figure9.png",
                "buffers/table5.md", "longctx/tables6_7.md", "e2e/figure5.png", "e2e/figure6.png",
                "e2e/figure10.png", "e2e/convergence.png", "versus/ratio_auto.png", "versus/versus_split.md",
                "decode/table10.png", "decode/table9.md", "decode/decode_batch.md", "decode/generate.md"):
        assert (plat / "figures" / fig).is_file(), fig
    text = (plat / "REPRODUCTION.md").read_text()
    assert "| Theorem (§3.5) |" in text and "**Plumbing check, not a reproduction.**" in text
