"""Points: the parameters of one measurement, their defaults, and their stable ids.

A point holds its parameters (op, impl, direction, N, batch, h_kv, g, d, block_size, topk,
dtype, ...) and its ``id``, a file-name-safe string that is stable across runs and unique within
the experiment. An id is a readable prefix (op, impl, direction or model, shape, dtype, ...) and
a short hash of every parameter (``point_hash``), so two configurations never share a result
file and editing any parameter in a YAML gives new ids.

A kernel-level point (kernel, dram, compile, versus and theory experiments) is a
``KernelPoint``, built once by ``grid.kernel_point`` from parameters validated against the
experiment schema; end-to-end points (train, prefill, convergence) and decode points are dicts
checked by their own schemas. Kernel points take their ids from ``point_id``, end-to-end points
from ``e2e_point_id``; ``e2e_base`` gives an end-to-end runner's defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..config import NSAConfig

# Dtype names of points and result rows -> torch dtypes (``DTYPES``, below), and their tag in a point id.
DTYPE_TAGS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_DIRECTION_TAGS = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwdbwd"}

# End-to-end points: parameters and their defaults (an experiment's `defaults` and grid values
# override them), shared by the train, prefill and convergence runners.
E2E_DEFAULTS = {
    "batch": 1,
    "layers": 2,
    "block_size": 64,
    "topk": 16,
    "kernel_size": 32,
    "kernel_stride": 16,
    "init_blocks": 1,
    "local_blocks": 2,
    "window_size": 512,
    "compression_impl": "auto",
    "window_impl": "auto",
    "gate_impl": "auto",
    "checkpointing": True,
    "loss_chunk": 4096,
    "split": True,
    "seed": 0,
    "parallel": "none",
    "model_overrides": {},
}
# Prefill over the shared defaults: the whole model.
PREFILL_DEFAULTS = {"layers": None}
# Convergence (``fsalab.bench.convergence``): a shrunk Llama trained on the retrieval task
# (``task: retrieval``) or on byte-level text (``task: text``; the model then needs vocab_size 256).
CONVERGENCE_DEFAULTS = {
    "task": "retrieval",
    "model": "llama3-8b",
    "layers": 2,
    "model_overrides": {
        "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "bos_token_id": None, "eos_token_id": None,
    },
    "N": 4096,
    "batch": 8,
    "steps": 500,
    "lr": 1e-3,
    "warmup_steps": 30,
    "grad_clip": 1.0,
    "pairs": 8,
    "queries": 256,
    "num_keys": 8,
    "num_values": 8,
    "needle_span": 1,
    "log_every": 5,
    "checkpointing": False,
    "split": False,
}
# End-to-end runners: op, default dtype and defaults over E2E_DEFAULTS of their points.
E2E_RUNNERS = {"train": ("train_step", "bfloat16", {}), "prefill": ("prefill", "float16", PREFILL_DEFAULTS),
               "convergence": ("convergence", "bfloat16", CONVERGENCE_DEFAULTS)}
E2E_OPS = {op: runner for runner, (op, _, _) in E2E_RUNNERS.items()}  # op of a row -> its runner
# NSA branches whose op is chosen by name, and their tag in an end-to-end id when not "auto".
_BRANCH_TAGS = (("compression_impl", "cmp"), ("window_impl", "win"), ("gate_impl", "gate"))
# Keys of a point that do not change what is measured: the id itself, the experiment (the
# folder already names it) and the free-form series label.
_UNMEASURED = ("id", "experiment", "label")
# Keys a point's id names in its readable prefix only: a parallel point's rank count (``-tp2``),
# which ids carried before it was a parameter, so the hash of those committed results leaves it out.
_PREFIX_ONLY = ("ranks",)
# Parameters added after results named by their ids were committed, with the value those results
# were measured at: a point at that value hashes as if the parameter did not exist, so its id
# (and the file holding its row) stays the same.
_HASH_NEUTRAL = {"task": "retrieval"}


@dataclass(frozen=True, eq=False)
class KernelPoint(Mapping):
    """One kernel-level measurement: which op and impl, which direction, at which shape.

    The fields are ``experiment.schema.yaml``'s kernel parameters (``$defs.params``), every
    default filled: build one with ``grid.kernel_point``, which validates them once. op, impl and
    direction are None only for a theory point (``cost_model`` set); ``label`` is a free-form
    series name. It reads as a mapping of its set fields (``p["N"]``, ``{**p}``): exactly the
    dict the schema validated, which ids (``point_hash``) and result rows are made from.
    """

    N: int  # tokens per sequence
    g: int  # query heads per KV head
    batch: int  # sequences packed together
    h_kv: int
    d: int
    block_size: int
    topk: int
    kernel_size: int
    kernel_stride: int
    window_size: int
    init_blocks: int
    local_blocks: int
    dtype: str  # a key of DTYPES
    seed: int
    model: str  # empty for kernels
    options: dict = field(default_factory=dict)  # keyword switches of the implementation
    op: str | None = None
    impl: str | None = None
    direction: str | None = None  # fwd, bwd or fwd+bwd
    label: str | None = None
    cost_model: str | None = None
    experiment: str | None = None
    id: str | None = None

    @property
    def cfg(self) -> NSAConfig:
        return nsa_config(self)

    def _set(self) -> dict:
        return {name: getattr(self, name) for name in _KERNEL_FIELDS if getattr(self, name) is not None}

    def __getitem__(self, key: str):
        if key not in _KERNEL_FIELDS or getattr(self, key) is None:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())


_KERNEL_FIELDS = tuple(f.name for f in dataclasses.fields(KernelPoint))


def e2e_base(runner: str) -> dict:
    """Point defaults of an end-to-end runner (train, prefill, convergence), op and dtype set."""
    op, dtype, extra = E2E_RUNNERS[runner]
    return {**copy.deepcopy(E2E_DEFAULTS), **copy.deepcopy(extra), "op": op, "dtype": dtype}


def nsa_config(p: Mapping) -> NSAConfig:
    """NSAConfig of a point (kernel_size, kernel_stride, block_size, topk, init/local blocks, window)."""
    return NSAConfig(
        kernel_size=p["kernel_size"], kernel_stride=p["kernel_stride"], block_size=p["block_size"],
        topk=p["topk"], init_blocks=p["init_blocks"], local_blocks=p["local_blocks"], window_size=p["window_size"],
    )


def point_hash(p: dict) -> str:
    """8 hex digits of the SHA-256 of every measured parameter of ``p`` (canonical JSON)."""
    params = {k: v for k, v in p.items()
              if k not in _UNMEASURED and k not in _PREFIX_ONLY and not (k in _HASH_NEUTRAL and v == _HASH_NEUTRAL[k])}
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _slug(value) -> str:
    text = str(value).lower().replace("true", "1").replace("false", "0")
    return re.sub(r"[^a-z0-9.]+", "", text)


def point_id(p: dict) -> str:
    """A kernel point's id: a readable prefix and ``point_hash``, e.g.
    ``selected-fsa-fwd-N65536-b1-hkv4-g4-d128-B64-T16-bf16-1a2b3c4d``. Theory points (a model,
    not a measurement; every parameter is in the prefix) have the prefix alone."""
    if "cost_model" in p:
        return f"{p['cost_model']}-N{p['N']}-hkv{p['h_kv']}-g{p['g']}-d{p['d']}-B{p['block_size']}-T{p['topk']}"
    return f"{readable_id(p)}-{point_hash(p)}"


def readable_id(p: dict) -> str:
    """The readable part of a kernel point's id (op, impl, direction, shape, dtype, window, options)."""
    parts = [
        p["op"].replace("_", ""),
        _slug(p["impl"]),
        _DIRECTION_TAGS[p["direction"]],
        f"N{p['N']}",
        f"b{p['batch']}",
        f"hkv{p['h_kv']}",
        f"g{p['g']}",
        f"d{p['d']}",
        f"B{p['block_size']}",
        f"T{p['topk']}",
        DTYPE_TAGS[p["dtype"]],
    ]
    if p.get("window_size", 512) != 512:
        parts.append(f"w{p['window_size']}")
    parts += [f"{_slug(k)}{_slug(v)}" for k, v in sorted(p.get("options", {}).items())]
    return "-".join(parts)


def e2e_point_id(p: dict) -> str:
    """An end-to-end point's id: a readable prefix and ``point_hash`` of every parameter, e.g.
    ``trainstep-llama3-8b-fsa-N65536-b1-L2-B64-T16-bf16-1a2b3c4d``. The prefix of parallel
    runs ends with the mode and their rank count ``ranks`` (``-fsdp8``), of convergence runs with their step
    count (``-S500``, after ``-span32`` when needles are runs of 32 tokens and after ``-text`` for
    the byte-level text task); a compression, window or gate branch other than ``auto`` adds
    ``-cmp<impl>`` / ``-win<impl>`` / ``-gate<impl>``."""
    layers = "full" if p.get("layers") in (None, 0) else p["layers"]
    parts = [p["op"].replace("_", ""), p["model"], p["impl"], f"N{p['N']}", f"b{p['batch']}", f"L{layers}",
             f"B{p['block_size']}", f"T{p['topk']}", DTYPE_TAGS[p["dtype"]]]
    if p.get("window_size", 512) != 512:
        parts.append(f"w{p['window_size']}")
    for key, tag in _BRANCH_TAGS:
        if p.get(key, "auto") != "auto":
            parts.append(f"{tag}{p[key]}")
    if p.get("parallel", "none") != "none":
        # A parameter, never the launcher's environment: the workflow names a torchrun job's
        # files before any rank starts, and TP = 2 and TP = 8 runs on one host write different results.
        if not isinstance(p.get("ranks"), int) or p["ranks"] < 1:
            raise ValueError(f"a point with parallel: {p['parallel']} needs its rank count (ranks), got "
                             f"{p.get('ranks')!r}")
        parts.append(f"{p['parallel']}{p['ranks']}")
    if p["op"] == "convergence":  # a longer run of the same model is a different result
        if p.get("task", "retrieval") != "retrieval":  # another task (bench.convergence.text_batch)
            parts.append(p["task"])
        if p.get("needle_span", 1) != 1:  # a different task (bench.convergence.retrieval_batch)
            parts.append(f"span{p['needle_span']}")
        parts.append(f"S{p['steps']}")
    parts.append(point_hash(p))
    return "-".join(re.sub(r"[^A-Za-z0-9.\-]+", "", str(x)) for x in parts)


def expand_subgrid(sub: dict) -> list[dict]:
    """The points of one grid entry: the product of its axes; a dict value sets several keys."""
    keys = list(sub)
    points = []
    for combo in itertools.product(*(sub[k] for k in keys)):
        point = {}
        for key, value in zip(keys, combo):
            if isinstance(value, dict):
                point.update(copy.deepcopy(value))
            else:
                point[key] = value
        points.append(point)
    return points


def __getattr__(name: str):
    """``DTYPES`` (dtype name -> torch dtype), built on first use: the point ids, grids and tables
    of this module serve processes that never import torch (``fsalab aggregate``, the notebooks),
    and torch's import is most of their start-up."""
    if name == "DTYPES":
        import torch

        dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
        globals()["DTYPES"] = dtypes  # later lookups find the module attribute, not this hook
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
