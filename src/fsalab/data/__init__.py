"""Package data the library reads, installed with it (``pip install .`` needs no checkout):

- ``schemas/*.schema.yaml``: the experiment, smoke, result and workflow-config schemas;
- ``experiments/*.yaml``: the experiment grids (a checkout's ``experiments/`` takes precedence);
- ``paper_values.yaml``: the paper's reported numbers used beside ours.

In a checkout these are links to ``workflow/schemas/``, ``experiments/`` and
``analysis/paper_values.yaml``, so the workflow and the library read the same files; building the
package copies their contents.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent


def path(*parts: str) -> Path:
    """A file of the package data, e.g. ``path("schemas", "result.schema.yaml")``."""
    return DATA.joinpath(*parts)
