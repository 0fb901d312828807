"""Result rows: their columns, how a point's row starts, how a failure fills it, where it is
written.

Every runner builds its row here (``kernel_row`` for kernel points, ``e2e_row`` for end-to-end
ones), records a failure with ``fail_row`` (status from ``classify``) and writes it with
``write_row``, which refuses to put a row into another machine's results folder
(``provenance.check_destination``). ``run_safely`` turns whatever a runner raises into a row,
so a sweep never loses the rows of the points that did run.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .provenance import check_destination, machine_platform, provenance

if TYPE_CHECKING:
    import torch

STATUSES = ("ok", "oom", "error", "unsupported")
# DESIGN §2: every aggregated table has at least these columns, in this order.
COLUMNS = (
    "experiment", "op", "impl", "direction", "model", "N", "batch", "h", "h_kv", "g", "d",
    "block_size", "topk", "dtype", "median_ms", "p20_ms", "p80_ms", "n_samples",
    "useful_tflops", "peak_mem_gib", "status",
)
# Kernel-point parameters a row carries beside the columns.
_PARAM_KEYS = (
    "kernel_size", "kernel_stride", "window_size", "init_blocks", "local_blocks", "seed", "label", "options",
)


class Unsupported(Exception):
    """The requested op/impl is not available in this checkout or on this machine (its row's
    status is ``unsupported``)."""


def result_path(results_dir: str | Path, platform: str, experiment: str, point_id: str) -> Path:
    """``<results_dir>/<platform>/<experiment>/<point_id>.json``."""
    return Path(results_dir) / platform / experiment / f"{point_id}.json"


def kernel_row(p: Mapping, platform: str) -> dict:
    """A kernel point's row (a ``KernelPoint``, or a decode point with the same shape
    parameters): the DESIGN columns it has (h = h_kv x g), its parameters, measurements unset."""
    row = {c: None for c in COLUMNS}
    row.update({k: p.get(k) for k in COLUMNS if k in p})
    row.update(
        experiment=p["experiment"], point=p["id"], h=p["h_kv"] * p["g"], model=p.get("model", ""),
        platform=platform, status=None, message="",
    )
    row.update({k: p.get(k) for k in _PARAM_KEYS})
    return row


def model_shape(p: dict) -> dict:
    """h, h_kv, g, d, hidden, L_full of an end-to-end point's model (overrides applied)."""
    from ..models.configs import get_spec

    spec = get_spec(p["model"])
    cfg = {**spec.config, **p.get("model_overrides", {})}
    h, h_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // h
    return {"h": h, "h_kv": h_kv, "g": h // h_kv, "d": d, "hidden": cfg["hidden_size"],
            "layers_full": cfg["num_hidden_layers"]}


def e2e_row(p: dict, op: str, direction: str, platform: str) -> dict:
    """An end-to-end point's row: the DESIGN columns (shape from its model), its parameters,
    measurements unset."""
    shape = model_shape(p)
    row = {c: None for c in COLUMNS}
    row.update({k: v for k, v in p.items() if k != "id"})
    row.update(op=op, direction=direction, point=p["id"], platform=platform, status=None, message="",
               h=shape["h"], h_kv=shape["h_kv"], g=shape["g"], d=shape["d"],
               layers=p.get("layers") or shape["layers_full"], layers_full=shape["layers_full"])
    return row


def classify(exc: BaseException) -> str:
    """Row status of a failure: ``oom``; ``unsupported`` when the op, impl or configuration is
    not available or rejected here (``ops.Unsupported``, ValueError, NotImplementedError,
    ImportError, an impl lacking a requested keyword switch); ``error`` otherwise."""
    import torch  # here, not at the top: the aggregating processes read COLUMNS without torch

    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    if isinstance(exc, (Unsupported, NotImplementedError, ValueError, ImportError)):
        return "unsupported"
    if isinstance(exc, TypeError) and "keyword argument" in str(exc):
        return "unsupported"  # an impl that lacks a requested switch (ablation options)
    return "error"


def fail_row(row: dict, exc: BaseException) -> dict:
    """``row`` with status (``classify``), message and, for an ``error``, the traceback of ``exc``."""
    row["status"] = classify(exc)
    row["message"] = f"{type(exc).__name__}: {exc}"[:4000]
    if row["status"] == "error":
        row["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
    return row


def finish_row(row: dict, started: float) -> dict:
    """``row`` with its wall time since ``started`` (``time.time()``) and its provenance."""
    row["elapsed_s"] = round(time.time() - started, 3)
    row["provenance"] = provenance(row.get("platform"))
    return row


def failure_row(p: dict, platform: str, exc: BaseException) -> dict:
    """The row of a point whose runner raised before it could build its own: the point's
    parameters, the DESIGN columns it has (the others null), status and message from ``exc``."""
    row = {c: None for c in COLUMNS}
    row.update({k: v for k, v in p.items() if k != "id"})
    row.update(experiment=p.get("experiment"), point=p.get("id"), model=p.get("model") or "", platform=platform)
    if row.get("h") is None and isinstance(p.get("h_kv"), int) and isinstance(p.get("g"), int):
        row["h"] = p["h_kv"] * p["g"]
    fail_row(row, exc)
    row["traceback"] = "".join(traceback.format_exception(exc))[-4000:]
    row["provenance"] = provenance(platform)
    return row


def run_safely(runner, p: dict, exp: dict, device: torch.device, platform: str) -> dict:
    """``runner(p, exp, device, platform)``, or ``failure_row`` when it raises anything at all."""
    try:
        return runner(p, exp, device, platform)
    except Exception as exc:  # noqa: BLE001 - a failed point is a row, never a crash of the sweep
        return failure_row(p, platform, exc)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_row(row: dict, path: str | Path, force: bool = False) -> Path:
    """Write ``row`` as JSON atomically (a sweep killed mid-write leaves no half file).

    PlatformMismatch (nothing written) when the row was measured on another machine than the one
    its platform folder, or the row it would replace, belongs to; ``force`` writes anyway."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.is_file() else None
    check_destination(row, row.get("platform") or path.parent.parent.name, existing, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(row), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def check_writable(path: str | Path, platform: str, force: bool = False) -> None:
    """What ``write_row`` would refuse, checked before anything is measured: PlatformMismatch
    when this machine may not write ``path`` in ``results/<platform>/``."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.is_file() else None
    mine = {"provenance": {"machine": machine_platform()}, "point": path.stem, "experiment": path.parent.name}
    check_destination(mine, platform, existing, force)
