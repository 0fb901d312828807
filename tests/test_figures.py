"""The analysis notebooks and their figures: inline in Jupyter and Agg headless, valid notebook
files, and figures readable without their title."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from fsalab import cli
from fsalab.bench.repo import repo_root

ROOT = repo_root()
NOTEBOOKS = sorted((ROOT / "analysis").glob("*.ipynb"))


def _notebook(path: Path, code: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_valid_with_cell_ids(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MissingIDFieldWarning included
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    assert all(cell.get("id") for cell in nb.cells)


DRAW = ("from fsalab import plotting\nimport matplotlib\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2], [2, 1])\nprint(matplotlib.get_backend())")


def test_jupyter_shows_figures_inline(tmp_path, monkeypatch):
    """A kernel as Jupyter starts it (no MPLBACKEND: ipykernel picks the inline backend) shows
    the figure a notebook draws after importing fsalab.plotting."""
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(_notebook(tmp_path / "draw.ipynb", DRAW), as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs
    assert "inline" in "".join(o.get("text", "") for o in outputs)


def test_headless_notebook_runs_draw_with_agg(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)
    (tmp_path / "res" / "unit").mkdir(parents=True)
    (tmp_path / "res" / "unit" / "unit.csv").write_text("experiment\n")
    code = DRAW + "\n(plotting.context('t').figures_dir / 'backend.txt').write_text(matplotlib.get_backend())"
    out = tmp_path / "figures"
    assert cli.main(["notebook", str(_notebook(tmp_path / "t.ipynb", code)), "--platform", "unit", "--results-dir",
                     str(tmp_path / "res"), "--figures", str(out), "--executed", str(tmp_path / "ran.ipynb")]) == 0
    assert (out / "backend.txt").read_text().lower() == "agg"
    ran = nbformat.read(tmp_path / "ran.ipynb", as_version=4)
    assert ran.cells[0].metadata["tags"] == ["injected-parameters"]
    assert not any("image/png" in o.get("data", {}) for cell in ran.cells for o in cell.outputs)


def test_headless_run_passes_its_parameters_as_a_cell_not_the_environment(tmp_path, monkeypatch):
    """``fsalab notebook`` hands the notebook its platform, results and figures folders through
    its first cell; this process's environment stays as it was."""
    monkeypatch.delenv("MPLBACKEND", raising=False)
    (tmp_path / "res" / "unit").mkdir(parents=True)
    (tmp_path / "res" / "unit" / "unit.csv").write_text("experiment\n")
    code = ("from fsalab import plotting\nctx = plotting.context('t')\n"
            "(ctx.figures_dir / 'ctx.txt').write_text(f'{ctx.platform} {ctx.results_dir}')")
    before = dict(os.environ)
    out = tmp_path / "figures"
    assert cli.main(["notebook", str(_notebook(tmp_path / "t.ipynb", code)), "--platform", "unit", "--results-dir",
                     str(tmp_path / "res"), "--figures", str(out)]) == 0
    assert (out / "ctx.txt").read_text() == f"unit {(tmp_path / 'res').resolve()}"
    assert dict(os.environ) == before


# ---------------------------------------------------------------- one name and colour per impl


def _known_impls() -> set[tuple[str, str]]:
    """(op, impl) of every implementation a runner knows, and of every committed row."""
    import pandas as pd

    from fsalab.bench import decode_points, ops
    from fsalab.models import patch

    known = {(op, impl) for op in ops.OPS for impl in ops.known_impls(op)}
    known |= {(op, impl) for op in decode_points.OPS
              for impl in decode_points.NSA_IMPLS[op] + decode_points.FULL_IMPLS[op]}
    known |= {("train_step", impl) for impl in patch.SELECTION_IMPLS + patch.FULL_IMPLS}
    for csv in (ROOT / "results").glob("h200*/*.csv"):
        df = pd.read_csv(csv)
        if {"op", "impl"} <= set(df.columns):
            known |= set(zip(df["op"], df["impl"]))
    # Branch-level ops are drawn as parts of an NSA step, not as implementations.
    return {(op, impl) for op, impl in known if op not in ("compressed", "window")}


def test_every_impl_has_one_name_and_colour():
    from fsalab import plotting

    keys = {plotting.key(impl, op) for op, impl in _known_impls()}
    assert keys <= set(plotting.IMPLS), sorted(keys - set(plotting.IMPLS))
    names = [name for name, _ in plotting.IMPLS.values()]
    colours = [colour.lower() for _, colour in plotting.IMPLS.values()]
    assert len(set(names)) == len(names) and len(set(colours)) == len(colours)
    assert not {c.lower() for _, c in plotting.PARTS.values()} & set(colours)


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """name -> every figure the notebooks save from the committed results/h200/ (drawn, not written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fsalab import plotting

    drawn = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plotting, "save", lambda fig, ctx, name: drawn.setdefault(name, fig))
        mp.setattr(plotting, "_parameters", dict(plotting._parameters))  # set_parameters' changes undone after
        for path in NOTEBOOKS:
            plotting.set_parameters(platform="h200", results_dir=ROOT / "results",
                                    figures_dir=tmp_path_factory.mktemp(path.stem))
            namespace: dict = {}
            for cell in nbformat.read(path, as_version=4).cells:
                if cell.cell_type == "code":
                    exec(compile(cell.source, str(path), "exec"), namespace)
    yield drawn
    plt.close("all")


def _colour(handle) -> tuple:
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D

    colour = handle.get_color() if isinstance(handle, Line2D) else handle.get_facecolor()
    if getattr(colour, "ndim", 1) == 2:  # a collection's first colour
        colour = colour[0]
    return tuple(round(x, 3) for x in to_rgba(colour))


def test_figures_show_each_impl_by_its_name_and_colour(figures):
    """Every legend entry that names an implementation has its colour, in every figure; no text
    of any figure shows a raw impl name (sdpa_cudnn, fsa_paper, ...) where it has a display name."""
    import re

    from matplotlib.colors import to_rgba
    from matplotlib.text import Text

    from fsalab import plotting

    by_name = {name: colour for name, colour in plotting.IMPLS.values()}
    raw = [k for k, (name, _) in plotting.IMPLS.items() if k not in ("auto", "reference", "full")] + ["triton"]
    raw_word = re.compile(r"\b(" + "|".join(map(re.escape, raw)) + r")\b")
    wrong, shown = [], set()
    for name, fig in figures.items():
        for legend in [ax.get_legend() for ax in fig.axes] + fig.legends:
            for text, handle in zip(legend.get_texts() if legend else [], legend.legend_handles if legend else []):
                if text.get_text() in by_name:
                    shown.add(text.get_text())
                    if _colour(handle) != tuple(round(x, 3) for x in to_rgba(by_name[text.get_text()])):
                        wrong.append(f"{name}: {text.get_text()!r} drawn in {_colour(handle)}")
        for text in fig.findobj(Text):
            if raw_word.search(text.get_text()):
                wrong.append(f"{name}: raw impl name in {text.get_text()!r}")
    assert not wrong, "\n".join(wrong)
    assert {plotting.label(i) for i in ("fsa", "nsa", "full", "sdpa_cudnn")} <= shown


def test_figures_name_their_axes(figures):
    """Every figure with data labels its x and y axes somewhere (Figure 4 had no x label)."""
    unlabelled = [name for name, fig in figures.items()
                  if any(ax.has_data() for ax in fig.axes)
                  and not (any(ax.get_xlabel() for ax in fig.axes) and any(ax.get_ylabel() for ax in fig.axes))]
    assert not unlabelled, unlabelled


def test_generate_marks_its_estimates(figures):
    """generate.png hatches exactly the bars whose whole-model tokens/s is estimated from slices."""
    import pandas as pd

    from fsalab import plotting

    gen = pd.read_csv(ROOT / "results" / "h200" / "generate.csv")
    estimated = gen["full_depth_kind"].fillna("").str.startswith("estimate")
    fig = figures["generate"]
    bars = [p for ax in fig.axes for c in ax.containers for p in c]
    hatched = [round(p.get_height(), 6) for p in bars if p.get_hatch()]
    assert sorted(hatched) == sorted(round(v, 6) for v in gen.loc[estimated, "full_depth_tokens_per_s"])
    assert any("estimated" in t.get_text() for leg in [ax.get_legend() for ax in fig.axes] if leg
               for t in leg.get_texts())
    assert {t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()} >= {plotting.label("fsa")}


def test_plumbing_platform_figures_say_so(tmp_path):
    import matplotlib.pyplot as plt

    from fsalab import plotting

    def stamped(platform: str) -> bool:
        fig, _ = plt.subplots()
        plotting.save(fig, plotting.Context(platform, tmp_path, tmp_path), platform)
        plt.close(fig)
        return any("plumbing check" in t.get_text() for t in fig.texts)

    assert stamped("cpu-interpret") and stamped("h200-smoke") and not stamped("h200")
