"""Measurements: one job per grid point (kernel, dram and the end-to-end runners train, prefill,
convergence), per slice of a grid (slice_s), or per experiment (batch_points, and versus always);
the theory table in one job; a multi-GPU experiment in one torchrun job per rank count."""


if SINGLE_POINT_EXPERIMENTS:

    rule bench_point:
        output:
            "results/{platform}/{experiment}/{point}.json",
        log:
            "logs/{platform}/{experiment}/{point}.log",
        wildcard_constraints:
            platform=PLATFORM,
            experiment="|".join(SINGLE_POINT_EXPERIMENTS),
        params:
            smoke=SMOKE_FLAG,
            command=lambda wc: bench_command(wc.experiment),
        resources:
            # One benchmark per GPU at a time (profiles cap the total `gpu`).
            gpu=1 if JOBS_NEED_GPU else 0,
        conda:
            "../envs/fsalab.yaml"
        shell:
            "fsalab {params.command} --experiment {wildcards.experiment} {params.smoke} "
            "--point {wildcards.point} --platform {wildcards.platform} --out {output} > {log} 2>&1"

# batch_points: one process per experiment writes every point file (same files, no per-point
# interpreter start-up; the smoke profile uses it to keep CI fast). versus always runs this way.
for _exp in BATCH_EXPERIMENTS:

    rule:
        name:
            f"bench_{_exp}"
        output:
            [f"results/{PLATFORM}/{_exp}/{p}.json" for p in POINTS[_exp]],
        log:
            f"logs/{PLATFORM}/bench_{_exp}.log",
        params:
            smoke=SMOKE_FLAG,
            experiment=_exp,
            filter=config["point_filter"] or ".",
            platform=PLATFORM,
            command=bench_command(_exp),
        resources:
            gpu=1 if JOBS_NEED_GPU else 0,
            # A whole grid in one job: on the H200 kernel's grid is ≈ 29 min of point time and
            # versus' ≈ 40 min (docs/workflow.md), so a batch scheduler must not stop it at a
            # single point's default.
            runtime=240,
        conda:
            "../envs/fsalab.yaml"
        shell:
            "fsalab {params.command} --experiment {params.experiment} {params.smoke} --all "
            "--filter '{params.filter}' --platform {params.platform} --results-dir results > {log} 2>&1"


# slice_s: one job per slice of an experiment, in the order of its grid, earlier experiments of
# the config first. Its point files are update() outputs and profiles that slice keep incomplete
# files: a job stopped at its time limit loses no finished point, and the next run measures what
# is missing (the runner skips files already there).
for _rank, _exp in enumerate(SLICED_EXPERIMENTS):
    for _k, _ids in enumerate(SLICES[_exp]):

        rule:
            name:
                f"bench_{_exp}_slice{_k}"
            output:
                [update(f"results/{PLATFORM}/{_exp}/{p}.json") for p in _ids],
            log:
                f"logs/{PLATFORM}/bench_{_exp}_slice{_k}.log",
            params:
                smoke=SMOKE_FLAG,
                experiment=_exp,
                filter="^(" + "|".join(_ids) + ")$",
                platform=PLATFORM,
                command=bench_command(_exp),
                budget=SLICE_S,
            priority: len(SLICED_EXPERIMENTS) - _rank
            resources:
                gpu=1 if JOBS_NEED_GPU else 0,
                # The slice is planned to take slice_s; a batch scheduler stops it at 1.25 x that.
                runtime=max(1, int(SLICE_S * 1.25 / 60)),
            conda:
                "../envs/fsalab.yaml"
            shell:
                "fsalab {params.command} --experiment {params.experiment} {params.smoke} --all --skip-existing "
                "--filter '{params.filter}' --platform {params.platform} --results-dir results "
                "--budget-s {params.budget} > {log} 2>&1"


rule theory:
    output:
        report("results/{platform}/theory.csv", category="Tables", caption="../report/tables.rst"),
    log:
        "logs/{platform}/theory.log",
    wildcard_constraints:
        platform=PLATFORM,
    params:
        smoke=SMOKE_FLAG,
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab theory --experiment theory {params.smoke} --out {output} > {log} 2>&1"


# torchrun: one job per multi-GPU experiment and rank count, its whole grid in one launch of
# `python -m torch.distributed.run` around the YAML's runner, which refuses a world size other
# than --ranks (the ids of the files below name it). Point files are update() outputs, as a
# slice's: with keep-incomplete a stopped job keeps its finished points, and the next run
# measures what is missing (--skip-existing). NVLink multicast stays off (NCCL, symmetric memory,
# NVSHMEM), as it was for the committed multi-GPU rows, so a re-run compares with them; torchrun
# passes the environment to its ranks. gpu=<ranks> is what a cluster allocates; a local profile's gpu=1 caps it, so the
# job runs alone, as every benchmark does (its ranks start at GPU 0, as a one-GPU job does).
for _exp, _n in TORCHRUN_POINTS:
    if not TORCHRUN_POINTS[_exp, _n]:
        continue

    rule:
        name:
            f"torchrun_{_exp}_{_n}"
        output:
            [update(f"results/{TORCHRUN_PLATFORM}/{_exp}/{p}.json") for p in TORCHRUN_POINTS[_exp, _n]],
        log:
            f"logs/{TORCHRUN_PLATFORM}/torchrun_{_exp}_{_n}.log",
        params:
            module=f"fsalab.bench.{TORCHRUN_EXPERIMENTS[_exp]['runner']}",
            experiment=_exp,
            filter="^(" + "|".join(TORCHRUN_POINTS[_exp, _n]) + ")$",
            platform=TORCHRUN_PLATFORM,
            ranks=_n,
        resources:
            gpu=_n,
            # A whole grid in one job (train_fsdp: 30 full-depth training steps of 10-20 s each,
            # six per point, and each model's build).
            runtime=240,
        conda:
            "../envs/fsalab.yaml"
        shell:
            "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1; "
            "python -m torch.distributed.run --standalone --nproc-per-node {params.ranks} -m {params.module} "
            "--experiment {params.experiment} --all --skip-existing --filter '{params.filter}' "
            "--platform {params.platform} --results-dir results --ranks {params.ranks} > {log} 2>&1"
