"""The verdict rules of REPRODUCTION.md, written once: a claim of the paper, our number beside it,
and the verdict these rules give (``Claim.verdict``).

A claim is of one of five kinds (``KINDS``):

- ``higher``: FSA does better when the number is higher (speedups, other time / FSA time);
- ``lower``: FSA does better when the number is lower (FSA/NSA bytes, FSA's own seconds);
- ``magnitude``: a size with no better side (an ablation's slowdown, a time share, a buffer's
  bytes, the value of a formula);
- ``at_most`` / ``at_least``: the paper states an inequality (ours must stay below / above the
  bound).

Verdicts, with ``ratio`` = ours / paper:

- *not reproduced* first, for ``higher``/``lower``: the paper's effect has a side of the
  claim's ``baseline`` (1 for ratios) and ours is not on it (a claimed speed-up of 1.10
  measured as 0.95 is a reversal, however close to the paper's number);
- *reproduced*: ``|ratio - 1| <= TOLERANCE`` (25 %); for an inequality: it holds with
  ``MARGIN`` (5 %) to spare (``ours <= bound (1 - MARGIN)`` or ``ours >= bound (1 + MARGIN)``);
- *exceeded*: ``higher``/``lower`` only: better than the paper's by more than 25 %
  (``ratio > 1.25`` resp. ``ratio < 0.75``);
- *same direction*: ``higher``/``lower`` only: outside ±25 % on the worse side, with the effect
  on the paper's side of the baseline;
- *not reproduced*: everything else: an inequality fails (or holds within the margin), a
  ``magnitude`` misses ±25 % (a size has no better side: seconds are compared as seconds);
- *not attempted (why)*: no measured value; the reason says why (hardware, checkpoints, a
  runner not run yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOLERANCE = 0.25
MARGIN = 0.05
KINDS = ("higher", "lower", "magnitude", "at_most", "at_least")
REPRODUCED, EXCEEDED, SAME_DIRECTION, NOT_REPRODUCED = "reproduced", "exceeded", "same direction", "not reproduced"
NOT_ATTEMPTED = "not attempted"
VERDICTS = (REPRODUCED, EXCEEDED, SAME_DIRECTION, NOT_REPRODUCED, NOT_ATTEMPTED)


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def verdict(ours: float | None, paper: float | None, kind: str, baseline: float = 1.0,
            reason: str = "") -> str:
    """The verdict of one claim under the rules of this module's docstring. ``reason`` (or a
    missing ``ours``) gives "not attempted (<reason>)"."""
    if kind not in KINDS:
        raise ValueError(f"unknown claim kind {kind!r}; one of {KINDS}")
    if reason or _missing(ours):
        return f"{NOT_ATTEMPTED} ({reason or 'no measured rows'})"
    if _missing(paper) or paper == 0:
        raise ValueError(f"a claim needs the paper's non-zero value (got {paper!r}); say why it is not attempted instead")
    if kind == "at_most":
        return REPRODUCED if ours <= paper * (1 - MARGIN) else NOT_REPRODUCED
    if kind == "at_least":
        return REPRODUCED if ours >= paper * (1 + MARGIN) else NOT_REPRODUCED
    if kind in ("higher", "lower") and paper != baseline and (ours - baseline) * (paper - baseline) <= 0:
        return NOT_REPRODUCED
    ratio = ours / paper
    if abs(ratio - 1) <= TOLERANCE:
        return REPRODUCED
    if kind == "magnitude":
        return NOT_REPRODUCED
    better = ratio > 1 + TOLERANCE if kind == "higher" else ratio < 1 - TOLERANCE
    if better:
        return EXCEEDED
    return SAME_DIRECTION


def paper_gpu(platform: str) -> str:
    """Which of the paper's GPUs (h20, h200) a results platform is compared with: h20 for
    h20-named platforms, h200 for every other one (the paper's faster GPU)."""
    return "h20" if platform.startswith("h20") and not platform.startswith("h200") else "h200"


@dataclass(frozen=True)
class Claim:
    """One row of REPRODUCTION.md.

    ``artefact``: the paper's numbered item ("Figure 4", "Table 5", "Theorem", "Abstract");
    ``paper_gpu``: which GPUs the paper's number covers ("H200", "H20, H200", "formula");
    ``platform``: where ours was measured (a results folder, or "—"); ``commits``: the short
    ``git_commit`` fields of the rows behind ours, as the rows give them; ``points``: how many
    measured points a max/mean covers; ``experiments``: the experiments whose rows ours comes
    from; ``impls``: the implementations the verdict's number compares (the paper's kernel and
    baseline); ``beyond``: the same number for what fsalab adds beyond the paper (its own FSA
    variant, ``auto``, stronger full-attention baselines), shown beside the verdict and never
    judged; ``counted``: False for a row that repeats another row's measurement (the abstract
    restating a figure), so the tally counts each claim once."""

    artefact: str
    claim: str
    paper: float | None
    ours: float | None
    kind: str
    paper_gpu: str = "H200"
    platform: str = "—"
    commits: tuple[str, ...] = ()
    points: int | None = None
    baseline: float = 1.0
    reason: str = ""
    experiments: tuple[str, ...] = ()
    impls: tuple[str, ...] = ()
    beyond: tuple[tuple[str, float | None], ...] = ()
    counted: bool = True

    @property
    def verdict(self) -> str:
        return verdict(self.ours, self.paper, self.kind, self.baseline, self.reason)

    @property
    def ratio(self) -> float | None:
        """ours / paper, None where either is missing."""
        if _missing(self.ours) or _missing(self.paper) or self.paper == 0:
            return None
        return self.ours / self.paper
