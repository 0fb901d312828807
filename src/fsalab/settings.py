"""Process-wide settings of fsalab, chosen by arguments, never read from the environment.

============  =========  ========================================================================
setting       default    meaning
============  =========  ========================================================================
dispatch      "profile"  how ``impl="auto"`` picks the selected-attention kernels on CUDA:
                         ``"profile"`` times FSA's and NSA's once per shape (cached);
                         ``"rules"`` applies the fixed rules of ``ops.selected.dispatch``
autotune      True       Triton autotunes each kernel per shape on a GPU; False runs one config
                         per launch without timing (short GPU test runs)
value_checks  True       input-value checks (cu_seqlens ascending, block indices in range);
                         False skips them (the benchmarks time without their extra ops)
============  =========  ========================================================================

``configure(...)`` sets them for the process, ``override(...)`` for a ``with`` block; the
command line sets them with ``--dispatch`` and ``--no-autotune`` (``add_arguments``). The hot
paths read ``current``, an immutable ``Settings`` that each change replaces, so a reader sees
one consistent set. The settings are one per process, not per thread: an ``override`` in one
thread applies to all of them. The few switches that stay in the environment (cache locations,
the Triton interpreter, the CUDA allocator) are listed in README's "Settings and environment".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator

DISPATCH_MODES = ("profile", "rules")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One consistent set of the process-wide settings (the table of the module docstring)."""

    dispatch: str = "profile"
    autotune: bool = True
    value_checks: bool = True

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {', '.join(map(repr, DISPATCH_MODES))}, got {self.dispatch!r}")
        for name in ("autotune", "value_checks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")


current = Settings()


def _changed(dispatch: str | None, autotune: bool | None, value_checks: bool | None) -> Settings:
    changes = {"dispatch": dispatch, "autotune": autotune, "value_checks": value_checks}
    return dataclasses.replace(current, **{k: v for k, v in changes.items() if v is not None})


def configure(*, dispatch: str | None = None, autotune: bool | None = None,
              value_checks: bool | None = None) -> Settings:
    """Set the given settings for the whole process (None leaves one as it is); returns the
    settings before the change. Autotuning applies from the next launch of each kernel: a shape
    tuned under one setting is tuned again under the other (``ops._triton.autotune``)."""
    global current
    previous, current = current, _changed(dispatch, autotune, value_checks)
    return previous


@contextlib.contextmanager
def override(*, dispatch: str | None = None, autotune: bool | None = None,
             value_checks: bool | None = None) -> Iterator[Settings]:
    """The given settings inside the ``with`` block, the settings before it back after it
    (also when the block raises): ``with settings.override(value_checks=False): ...``."""
    global current
    previous, current = current, _changed(dispatch, autotune, value_checks)
    try:
        yield current
    finally:
        current = previous


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line flags of the settings a runner's user may choose (``apply_arguments``
    sets them)."""
    parser.add_argument("--dispatch", choices=DISPATCH_MODES, default=None,
                        help="how impl auto picks the selected-attention kernels on CUDA: profile (time both once "
                             "per shape, the default) or rules (fixed rules, nothing timed)")
    parser.add_argument("--no-autotune", dest="autotune", action="store_false", default=None,
                        help="run each Triton kernel with one config, without autotune timing")


def apply_arguments(args: argparse.Namespace) -> Settings:
    """``configure`` from the flags of ``add_arguments`` (those not given leave their setting)."""
    return configure(dispatch=args.dispatch, autotune=args.autotune)


def as_arguments(settings: Settings | None = None) -> list[str]:
    """The flags of ``add_arguments`` that give a child process ``settings`` (default: ``current``)."""
    s = settings or current
    return ["--dispatch", s.dispatch] + ([] if s.autotune else ["--no-autotune"])
