"""Notebooks (headless) -> figures and tables; REPRODUCTION.md from the results."""


rule notebook_paper_figures:
    input:
        notebook="analysis/{notebook}.ipynb",
        tables=lambda wc: tables(FIGURES_PLATFORM, wc.notebook),
    output:
        report(
            directory("paper_figures/{notebook}"),
            patterns=["{name}.png"],
            category="Figures",
            subcategory="{notebook}",
            caption="../report/figures.rst",
        ),
    log:
        notebook=f"logs/notebooks/{FIGURES_PLATFORM}/{{notebook}}.ipynb",
        stderr=f"logs/notebooks/{FIGURES_PLATFORM}/{{notebook}}.log",
    params:
        platform=FIGURES_PLATFORM,
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab notebook {input.notebook} --platform {params.platform} --results-dir results --figures {output} "
        "--executed {log.notebook} > {log.stderr} 2>&1"


rule notebook_platform_figures:
    input:
        notebook="analysis/{notebook}.ipynb",
        tables=lambda wc: tables(wc.platform, wc.notebook),
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
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab notebook {input.notebook} --platform {wildcards.platform} --results-dir results --figures {output} "
        "--executed {log.notebook} > {log.stderr} 2>&1"


rule reproduction_paper:
    input:
        lambda wc: reproduction_inputs(FIGURES_PLATFORM),
    output:
        report("REPRODUCTION.md", category="Reproduction", caption="../report/reproduction.rst"),
    log:
        f"logs/reproduction_{FIGURES_PLATFORM}.log",
    params:
        platform=FIGURES_PLATFORM,
        figures=figures_dir(FIGURES_PLATFORM),
    conda:
        "../envs/fsalab.yaml"
    shell:
        "fsalab reproduction --platform {params.platform} --results-dir results --figures {params.figures} "
        "--out {output} > {log} 2>&1"


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
