"""Shared look and plumbing of the analysis notebooks.

Notebooks are parametrised by environment variables (set by ``fsalab notebook`` / Snakemake):
``FSALAB_PLATFORM_RESULTS`` (which ``results/<platform>/`` to read; default ``h200`` when present,
else the first platform with results), ``FSALAB_FIGURES`` (output folder; default
``paper_figures/<notebook>/``, the notebook's own folder) and ``FSALAB_RESULTS`` (the results
root). Every figure is saved as PNG and PDF; every table as Markdown and CSV. ``fsalab notebook``
points ``FSALAB_FIGURES`` at a temporary folder and moves it into place only when the whole
notebook ran, so a failing notebook never replaces or deletes figures.

The matplotlib backend is left to matplotlib: inline in Jupyter, Agg without a display, and
Agg under ``fsalab notebook`` (which sets ``MPLBACKEND``), so headless figures do not depend on
the machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from . import results
from .bench.repo import repo_root

# One colour per implementation across every figure.
PALETTE = {
    "fsa": "#1b9e77",
    "fsa_paper": "#66a61e",
    "nsa": "#d95f02",
    "full": "#7570b3",
    "reference": "#999999",
    "compressed": "#e6ab02",
    "selected": "#1b9e77",
    "window": "#7570b3",
}
LABELS = {"fsa": "FSA (fsalab)", "fsa_paper": "FSA (paper)", "nsa": "NSA", "full": "Full attention", "reference": "reference"}


@dataclass(frozen=True)
class Context:
    """Where a notebook reads results and writes figures."""

    platform: str
    results_dir: Path
    figures_dir: Path

    def table(self, experiment: str) -> pd.DataFrame:
        """Aggregated table of ``experiment`` on this platform (empty frame when absent)."""
        return results.load_table(self.platform, experiment, self.results_dir)


def context(notebook: str) -> Context:
    """Read the notebook parameters from the environment, apply the style, create the output
    folder (``$FSALAB_FIGURES``, else ``paper_figures/<notebook>``)."""
    results_dir = Path(os.environ.get("FSALAB_RESULTS", repo_root() / "results"))
    platform = os.environ.get("FSALAB_PLATFORM_RESULTS")
    if not platform:
        available = results.platforms(results_dir)
        platform = "h200" if "h200" in available else (available[0] if available else "h200")
    figures = Path(os.environ.get("FSALAB_FIGURES") or repo_root() / "paper_figures" / notebook)
    figures.mkdir(parents=True, exist_ok=True)
    setup()
    return Context(platform, results_dir, figures)


def setup() -> None:
    """The shared seaborn style."""
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.0)
    plt.rcParams.update({"figure.dpi": 120, "savefig.dpi": 200, "savefig.bbox": "tight"})


def save(fig: plt.Figure, ctx: Context, name: str) -> list[Path]:
    """Save ``fig`` as ``<figures>/<name>.png`` and ``.pdf``; returns the paths."""
    paths = [ctx.figures_dir / f"{name}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        # No creation date in the PDF: regenerating unchanged results leaves the files unchanged.
        fig.savefig(p, metadata={"CreationDate": None} if p.suffix == ".pdf" else None)
    return paths


def save_table(df: pd.DataFrame, ctx: Context, name: str, floatfmt: str = ".3g") -> list[Path]:
    """Save ``df`` as ``<figures>/<name>.md`` (Markdown) and ``.csv``."""
    md, csv = ctx.figures_dir / f"{name}.md", ctx.figures_dir / f"{name}.csv"
    md.write_text(df.to_markdown(index=False, floatfmt=floatfmt) + "\n" if len(df) else "(no data)\n")
    df.to_csv(csv, index=False)
    return [md, csv]


def note(ax: plt.Axes, text: str) -> None:
    """Write a note in the middle of an axis (used for panels without data)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="0.4", wrap=True)


def empty_figure(ctx: Context, name: str, message: str) -> plt.Figure:
    """A placeholder figure that says why there is nothing to show (still saved, so rules succeed)."""
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.set_axis_off()
    note(ax, message)
    save(fig, ctx, name)
    return fig


def label_bars(ax: plt.Axes, fmt: str = "{:.2g}", fontsize: int = 6) -> None:
    """Write each bar's height above it (nothing for missing or zero bars)."""
    for container in ax.containers:
        heights = [b.get_height() for b in container]
        ax.bar_label(container, labels=[fmt.format(h) if not math.isnan(h) and h > 0 else "" for h in heights],
                     fontsize=fontsize, padding=1)


def bt_label(block_size: int, topk: int) -> str:
    """'(64,16)'-style label of a (B_K, T) pair."""
    return f"({int(block_size)},{int(topk)})"


def tokens_label(n: int) -> str:
    """'64K'-style label of a token count."""
    return f"{int(n) // 1024}K" if n >= 1024 else str(int(n))
