"""The analysis notebooks and their figures: inline in Jupyter and Agg headless, valid notebook
files, and figures readable without their title."""

from __future__ import annotations

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
    assert not any("image/png" in o.get("data", {}) for o in ran.cells[0].outputs)
