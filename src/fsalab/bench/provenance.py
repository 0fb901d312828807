"""Where a measurement came from: platform name, hardware, software versions, git state.

Every result file embeds ``provenance()`` so a number can be traced to the machine, the code
and the library versions that produced it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform as _platform
import re
import subprocess
from datetime import datetime, timezone

from .repo import REPO_ROOT

# GPU name fragments -> platform name; the first match wins (order matters: "h200" before "h20").
_GPU_PLATFORMS = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("h800", "h800"),
    ("h20", "h20"),
    ("gh200", "gh200"),
    ("b200", "b200"),
    ("a100", "a100"),
    ("a800", "a800"),
    ("l40", "l40"),
    ("4090", "rtx4090"),
)


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def gpu_name() -> str | None:
    """Name of CUDA device 0, or None without a usable CUDA device."""
    import torch  # in the functions that need it: the aggregating processes never import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def platform_from_gpu_name(name: str) -> str:
    """Short platform name of a GPU: 'NVIDIA H200' -> 'h200'; unknown GPUs get a slug of their name."""
    lowered = name.lower()
    # Match "h200" in "nvidia h200" but not "h20" inside "h200": compare against whole tokens first.
    tokens = re.split(r"[^a-z0-9]+", lowered)
    for fragment, plat in _GPU_PLATFORMS:
        if fragment in tokens:
            return plat
    for fragment, plat in _GPU_PLATFORMS:
        if fragment in lowered:
            return plat
    slug = re.sub(r"[^a-z0-9]+", "-", lowered.replace("nvidia", "")).strip("-")
    return slug or "gpu"


def machine_platform() -> str:
    """The platform of the hardware this process runs on, whatever ``--platform`` names: the GPU's
    (``h200``, ...) or ``cpu``. Rows carry it (``provenance.machine``) so that a result folder
    never takes rows measured on another machine (``check_destination``)."""
    name = gpu_name()
    return platform_from_gpu_name(name) if name is not None else "cpu"


def row_machine(row: dict) -> str:
    """The machine a result row was measured on: ``provenance.machine``, or for rows written
    before it existed the platform of ``provenance.gpu`` (``cpu`` without a GPU)."""
    prov = row.get("provenance") or {}
    if prov.get("machine"):
        return prov["machine"]
    return platform_from_gpu_name(prov["gpu"]) if prov.get("gpu") else "cpu"


def machine_folder(machine: str) -> str:
    """The results folder of a machine's rows: its platform name; ``cpu-interpret`` for ``cpu``
    (``fsalab`` runs the kernels through the Triton interpreter there)."""
    return "cpu-interpret" if machine == "cpu" else machine


def folder_machine(platform: str) -> str | None:
    """The machine a results folder belongs to when its name says so: ``h200``, ``h200-smoke``
    and ``h200x2`` belong to ``h200``; ``cpu-interpret`` to ``cpu``; other names (test folders,
    GPUs without a table entry) to no machine in particular (None)."""
    base = re.sub(r"x\d+$", "", re.sub(r"-smoke$", "", platform))
    if base in ("cpu", "cpu-interpret"):
        return "cpu"
    return base if base in {plat for _, plat in _GPU_PLATFORMS} else None


def plumbing_only(platform: str) -> bool:
    """Whether ``results/<platform>/`` holds plumbing checks rather than measurements: rows of a
    CPU (kernels run by the Triton interpreter, or the fp32 reference) or of a GPU's smoke grids
    (``<gpu>-smoke``), whose tiny shapes time nothing the paper speaks of."""
    return folder_machine(platform) == "cpu" or platform.endswith("-smoke")


class PlatformMismatch(ValueError):
    """A row measured on one machine was about to land in another machine's results."""


def check_destination(row: dict, platform: str, existing: dict | None = None, force: bool = False) -> None:
    """PlatformMismatch unless ``row`` may be written into ``results/<platform>/``: the folder's
    machine (``folder_machine``) must be the row's, and a row it replaces (``existing``) must
    come from the same machine. ``force`` imports copies measured elsewhere on purpose."""
    if force:
        return
    machine = row_machine(row)
    owner = folder_machine(platform)
    if owner is not None and owner != machine:
        raise PlatformMismatch(
            f"row {row.get('point')!r} was measured on {machine!r} but results/{platform}/ holds {owner!r} "
            f"results; refusing to mix them (write to results/{machine_folder(machine)}/ or pass --force to import a "
            "copy)")
    if existing is not None and row_machine(existing) != machine:
        raise PlatformMismatch(
            f"results/{platform}/{row.get('experiment')}/{row.get('point')}.json was measured on "
            f"{row_machine(existing)!r}; refusing to replace it by a row measured on {machine!r} (--force to do so)")


def detect_platform() -> str:
    """Platform name used in ``results/<platform>/`` unless a runner is given one (``--platform``):
    the GPU's (``h200``, ``a100``, ...), else ``cpu-interpret`` (Triton interpreter) or ``cpu``."""
    name = gpu_name()
    if name is not None:
        return platform_from_gpu_name(name)
    return "cpu-interpret" if interpreter_active() else "cpu"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_state() -> dict:
    """Commit hash and dirtiness of the checkout the package runs from (None outside git).

    ``$FSALAB_GIT_COMMIT`` names the commit instead, for a copied working tree whose ``.git``
    is another commit's (a device copy): the row then says ``git_commit_from: env`` and leaves
    ``git_dirty`` unknown (None)."""
    named = os.environ.get("FSALAB_GIT_COMMIT")
    if named:
        return {"git_commit": named, "git_dirty": None, "git_commit_from": "env"}

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def provenance(platform: str | None = None) -> dict:
    """Machine, software and code state, JSON-serialisable; ``platform``: the results folder the
    row goes to (default: ``detect_platform()``)."""
    import torch

    info = {
        "platform": platform or detect_platform(),
        "machine": machine_platform(),
        "hostname": _platform.node(),
        "python": _platform.python_version(),
        "os": _platform.platform(),
        "cpu": _platform.processor() or _platform.machine(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "fsalab": _version("fsalab"),
        "cuda": torch.version.cuda,
        "triton_interpret": interpreter_active(),
        "gpu": gpu_name(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "driver": _driver_version() if torch.cuda.is_available() else None,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
        **git_state(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 2)
        info["gpu_sm_count"] = props.multi_processor_count
        info["gpu_capability"] = f"{props.major}.{props.minor}"
    return info
