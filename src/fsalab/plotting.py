"""Shared look and plumbing of the analysis notebooks.

A notebook's parameters are arguments: which ``results/<platform>/`` to read (default ``h200``
when present, else the first platform with results), the results root (default the checkout's
``results/``) and the output folder (default ``paper_figures/<notebook>/``, the notebook's own
folder). ``context(notebook, platform=..., ...)`` takes them; ``fsalab notebook`` puts a first
cell into the notebook it runs (tagged ``injected-parameters``, as papermill tags its own) that
calls ``set_parameters(...)``, which ``context`` falls back on. Every figure is saved as PNG and
PDF; every table as Markdown and CSV. ``fsalab notebook`` points the output folder at a temporary
folder and moves it into place only when the whole notebook ran, so a failing notebook never
replaces or deletes figures.

The matplotlib backend is left to matplotlib: inline in Jupyter, Agg without a display, and
Agg under ``fsalab notebook`` (its first cell selects it), so headless figures do not depend on
the machine. Every implementation has one display name and one colour in every figure
(``IMPLS``; ``label``, ``color`` and ``hue`` look them up), the parts of an NSA step or a layer
theirs (``PARTS``). Figures of a plumbing-check platform (``provenance.plumbing_only``) say so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.patches import Patch

from . import results
from .bench.provenance import plumbing_only
from .bench.repo import repo_root

# Implementation (the ``impl`` of result rows) -> (display name, colour), in legend order.
# "full": the fastest full attention measured at a point. "triton" names several kernels, so it
# is keyed by op (``key``): fsalab's NSA decode step and its FlashAttention-2 full attention.
IMPLS: dict[str, tuple[str, str]] = {
    "fsa": ("FSA (fsalab)", "#1b9e77"),
    "fsa_paper": ("FSA (paper)", "#66a61e"),
    "nsa": ("NSA", "#d95f02"),
    "auto": ("auto (FSA or NSA per shape)", "#e7298a"),
    "fla_nsa": ("NSA (fla-core)", "#a6761d"),
    "nsa_step": ("NSA decode step (fsalab)", "#1f78b4"),
    "reference": ("reference (fp32)", "#999999"),
    "full": ("full attention (fastest)", "#7570b3"),
    "sdpa_cudnn": ("full attention (cuDNN)", "#54278f"),
    "sdpa_flash": ("full attention (SDPA flash)", "#9e9ac8"),
    "sdpa_math": ("full attention (SDPA math)", "#cbc9e2"),
    "sdpa": ("full attention (SDPA)", "#bcbddc"),
    "flash_attn": ("full attention (flash-attn)", "#3f007d"),
    "flashinfer": ("full attention (FlashInfer)", "#e6ab02"),
    "full_triton": ("full attention (fsalab Triton)", "#807dba"),
}
_TRITON_BY_OP = {"decode_step": "nsa_step", "full_attention": "full_triton"}
# Parts of an NSA attention step (its branches) and of a layer, each with its own colour (no
# implementation's).
PARTS: dict[str, tuple[str, str]] = {
    "compressed": ("compressed", "#fdb462"),
    "selected": ("selected", "#80b1d3"),
    "window": ("sliding window", "#b3de69"),
    "mlp": ("MLP", "#d9d9d9"),
}
ESTIMATE_HATCH = "////"


def key(impl: str, op: str | None = None) -> str:
    """The ``IMPLS`` key of a row's ``impl`` (of op ``op``: "triton" names a different kernel per op)."""
    return _TRITON_BY_OP.get(op, impl) if impl == "triton" else impl


def label(impl: str, op: str | None = None) -> str:
    """The display name of an implementation; KeyError for one without a name in ``IMPLS``."""
    return IMPLS[key(impl, op)][0]


def color(impl: str, op: str | None = None) -> str:
    """The colour of an implementation in every figure."""
    return IMPLS[key(impl, op)][1]


def hue(impls: Iterable[str], op: str | None = None) -> dict:
    """seaborn's ``hue_order`` and ``palette`` for a hue column of display names (``label``) of
    ``impls``, in ``IMPLS`` order: the same colour and legend order in every panel."""
    keys = {key(i, op) for i in impls}
    order = [k for k in IMPLS if k in keys]
    return {"hue_order": [IMPLS[k][0] for k in order], "palette": {IMPLS[k][0]: IMPLS[k][1] for k in order}}


@dataclass(frozen=True)
class Context:
    """Where a notebook reads results and writes figures."""

    platform: str
    results_dir: Path
    figures_dir: Path

    def table(self, experiment: str) -> pd.DataFrame:
        """Aggregated table of ``experiment`` on this platform (empty frame when absent)."""
        return results.load_table(self.platform, experiment, self.results_dir)


# The parameters of this run (``set_parameters``): a headless run's first cell sets them.
_parameters: dict[str, str | None] = {"platform": None, "results_dir": None, "figures_dir": None}


def set_parameters(platform: str | None = None, results_dir: str | Path | None = None,
                   figures_dir: str | Path | None = None) -> None:
    """The parameters ``context`` uses where it is given none (None: its default), for the rest
    of this process: the first cell ``fsalab notebook`` puts into a notebook calls it."""
    _parameters.update(platform=platform, results_dir=None if results_dir is None else str(results_dir),
                       figures_dir=None if figures_dir is None else str(figures_dir))


def context(notebook: str, platform: str | None = None, results_dir: str | Path | None = None,
            figures_dir: str | Path | None = None) -> Context:
    """The run's parameters (arguments, else ``set_parameters``'s, else the defaults), with the
    style applied and the output folder created (default ``paper_figures/<notebook>``)."""
    results_dir = Path(results_dir or _parameters["results_dir"] or repo_root() / "results")
    platform = platform or _parameters["platform"]
    if not platform:
        available = results.platforms(results_dir)
        platform = "h200" if "h200" in available else (available[0] if available else "h200")
    figures = Path(figures_dir or _parameters["figures_dir"] or repo_root() / "paper_figures" / notebook)
    figures.mkdir(parents=True, exist_ok=True)
    setup()
    return Context(platform, results_dir, figures)


def setup() -> None:
    """The shared seaborn style."""
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.0)
    plt.rcParams.update({"figure.dpi": 120, "savefig.dpi": 200, "savefig.bbox": "tight"})


def save(fig: plt.Figure, ctx: Context, name: str) -> list[Path]:
    """Save ``fig`` as ``<figures>/<name>.png`` and ``.pdf``; returns the paths. A plumbing-check
    platform's figure is stamped as one."""
    if plumbing_only(ctx.platform):
        fig.text(0.5, 0, f"plumbing check (results/{ctx.platform}/: smoke shapes), not a measurement of the paper's "
                 "claims", ha="center", va="top", fontsize=8, color="#b2182b")
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


def shades(impl: str, n: int) -> list:
    """``n`` shades of an implementation's colour, light to full: its variants (a parameter's
    values, an optimisation turned off) in one family."""
    return sns.light_palette(color(impl), n_colors=n + 1)[1:]


def figure_legend(fig: plt.Figure) -> None:
    """One legend below the panels for every entry of their legends (each label once), in place
    of a legend per panel."""
    entries = {}
    for ax in fig.axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(text, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if entries:
        fig.legend(entries.values(), entries.keys(), loc="upper center", bbox_to_anchor=(0.5, 0), ncol=len(entries),
                   fontsize=7, frameon=False)


def ratio_label(ratios: dict[str, float], fmt: str = "{:.1f}") -> str:
    """A bar group's ratios to FSA, one line each, named: {"NSA": 3.7, "full": 0.7} ->
    'NSA 3.7×' / 'full 0.7×' (time / FSA's time; '–' where one is missing)."""
    return "\n".join(f"{name} " + ("–" if value is None or math.isnan(value) else fmt.format(value) + "×")
                     for name, value in ratios.items())


def mark_estimates(bars: Iterable, estimated: Iterable[bool]) -> None:
    """Hatch the bars whose value is an estimate (e.g. a full-depth time extrapolated from a slice
    of layers) rather than a measurement; ``estimate_handle`` is their legend entry."""
    for bar, est in zip(bars, estimated):
        if est:
            bar.set_hatch(ESTIMATE_HATCH)


def estimate_handle(text: str) -> Patch:
    """Legend entry of the hatched bars of ``mark_estimates``, saying what they estimate from."""
    return Patch(facecolor="white", edgecolor="0.3", hatch=ESTIMATE_HATCH, label=text)


def bt_label(block_size: int, topk: int) -> str:
    """'(64,16)'-style label of a (B_K, T) pair."""
    return f"({int(block_size)},{int(topk)})"


def tokens_label(n: int) -> str:
    """'64K'-style label of a token count."""
    return f"{int(n) // 1024}K" if n >= 1024 else str(int(n))
