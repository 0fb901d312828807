"""Point files -> one tidy CSV per experiment (DESIGN §2 columns): the grid's points only, so
the files of points no longer in the grid (an edited YAML) stay on disk but leave the table."""


rule aggregate:
    input:
        point_files,
    output:
        report("results/{platform}/{experiment}.csv", category="Tables", caption="../report/tables.rst"),
    log:
        "logs/{platform}/aggregate_{experiment}.log",
    wildcard_constraints:
        platform=PLATFORM,
        experiment="|".join(POINT_EXPERIMENTS) or "^$",
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab aggregate --experiment {wildcards.experiment} --platform {wildcards.platform} "
        "--out {output} --points {input} > {log} 2>&1"


# The multi-GPU host's table of a torchrun experiment: every rank count's points (common.smk,
# torchrun_point_files).
if TORCHRUN:

    rule aggregate_torchrun:
        input:
            torchrun_point_files,
        output:
            report("results/{platform}/{experiment}.csv", category="Tables", caption="../report/tables.rst"),
        log:
            "logs/{platform}/aggregate_{experiment}.log",
        wildcard_constraints:
            platform=re.escape(TORCHRUN_PLATFORM),
            experiment="|".join(TORCHRUN),
        conda:
            "../envs/fsalab.yaml"
        shell:
            "fsalab aggregate --experiment {wildcards.experiment} --platform {wildcards.platform} "
            "--out {output} --points {input} > {log} 2>&1"
