"""Where the checkout is: results, experiments and the git state of provenance live there."""

from __future__ import annotations

import os
from pathlib import Path

# The checkout this package is installed from (editable install); results and configs live there.
REPO_ROOT = Path(__file__).resolve().parents[3]


def repo_root() -> Path:
    """``$FSALAB_ROOT``, else the checkout this package lives in, else the working directory."""
    env = os.environ.get("FSALAB_ROOT")
    if env:
        return Path(env)
    if (REPO_ROOT / "workflow" / "schemas").is_dir():
        return REPO_ROOT
    return Path.cwd()
