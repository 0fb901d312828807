"""Notebooks (headless) -> figures and tables; REPRODUCTION.md from the results.

Every platform's figures are rendered into results/<platform>/figures/<notebook>/ (Snakemake's
output, deleted by it before a run and after a failure); for figures_platform `fsalab notebook
--publish` then copies the finished folder into paper_figures/<notebook>/, so a failing notebook
never touches the committed figures."""


rule notebook_platform_figures:
    input:
        notebook="analysis/{notebook}.ipynb",
        tables=lambda wc: tables(wc.platform, wc.notebook),
        code=figure_code(),
    output:
        report(
            directory("results/{platform}/figures/{notebook}"),
            patterns=["{name}.png"],
            category="Figures ({platform})",
            subcategory="{notebook}",
            caption="../report/figures.rst",
        ),
    log:
        notebook="logs/notebooks/{platform}/{notebook}.ipynb",
        stderr="logs/notebooks/{platform}/{notebook}.log",
    params:
        publish=lambda wc: publish_flag(wc.platform, wc.notebook),
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab notebook {input.notebook} --platform {wildcards.platform} --results-dir results --figures {output} "
        "{params.publish} --executed {log.notebook} > {log.stderr} 2>&1"


# Also rewrites README.md's generated blocks: an update() output, which Snakemake neither deletes
# before the job (the hand-written rest of README stays) nor keeps half-written after a failure.
rule reproduction_paper:
    input:
        lambda wc: reproduction_inputs(FIGURES_PLATFORM),
    output:
        reproduction=report("REPRODUCTION.md", category="Reproduction", caption="../report/reproduction.rst"),
        readme=update("README.md"),
    log:
        f"logs/reproduction_{FIGURES_PLATFORM}.log",
    params:
        platform=FIGURES_PLATFORM,
        figures=figures_dir(FIGURES_PLATFORM),
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab reproduction --platform {params.platform} --results-dir results --figures {params.figures} "
        "--out {output.reproduction} --readme {output.readme} > {log} 2>&1"


rule reproduction_platform:
    input:
        lambda wc: reproduction_inputs(wc.platform),
    output:
        report("results/{platform}/REPRODUCTION.md", category="Reproduction", caption="../report/reproduction.rst"),
    log:
        "logs/reproduction_{platform}.log",
    params:
        figures=lambda wc: figures_dir(wc.platform),
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab reproduction --platform {wildcards.platform} --results-dir results --figures {params.figures} "
        "--out {output} > {log} 2>&1"
