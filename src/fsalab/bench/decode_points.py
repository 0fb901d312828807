"""Points of the decode runner's experiments (decode, inference, generate): their parameters,
defaults and ids. Apart from the runner (``bench.decode``) so that ``bench.grid`` can expand
them without importing a runner.
"""

from __future__ import annotations

import copy

from .points import DTYPE_TAGS, expand_subgrid, point_hash

OPS = ("decode_step", "inference", "generate")
NSA_IMPLS = {"decode_step": ("triton", "reference"), "inference": ("fsa_paper", "fsa", "nsa", "auto"),
             "generate": ("fsa_paper", "fsa", "nsa", "auto")}
FULL_IMPLS = {"decode_step": ("sdpa_flash", "sdpa_cudnn", "sdpa_math", "flash_attn", "flashinfer"),
              "inference": ("sdpa_flash", "sdpa_cudnn", "sdpa_math"), "generate": ("sdpa_flash", "sdpa_cudnn", "sdpa_math")}
DEFAULTS = {"direction": "fwd", "batch": 1, "h_kv": 4, "g": 16, "d": 128, "block_size": 64, "topk": 16,
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512,
            "dtype": "bfloat16", "steps": 1024, "seed": 0, "model": "", "layers": 2, "model_overrides": {}}


def expand_points(exp: dict) -> list[dict]:
    """Points of a decode-runner experiment: DEFAULTS <- exp defaults <- each sub-grid's values.
    ValueError for unknown parameters, ops or impls (config errors, not rows)."""
    points, seen = [], set()
    for i, sub in enumerate(exp["grid"]):
        for raw in expand_subgrid(sub):
            where = f"{exp['experiment']} grid[{i}]"
            p = {**copy.deepcopy(DEFAULTS), **copy.deepcopy(exp.get("defaults", {})), **raw}
            unknown = sorted(set(p) - set(DEFAULTS) - {"op", "impl", "N", "label"})
            if unknown:
                raise ValueError(f"{where}: unknown decode parameters {unknown}")
            if p.get("op") not in OPS:
                raise ValueError(f"{where}: op must be one of {OPS}, got {p.get('op')!r}")
            if p.get("impl") not in NSA_IMPLS[p["op"]] + FULL_IMPLS[p["op"]]:
                raise ValueError(f"{where}: impl of op {p['op']!r} must be one of "
                                 f"{NSA_IMPLS[p['op']] + FULL_IMPLS[p['op']]}, got {p.get('impl')!r}")
            if "N" not in p:
                raise ValueError(f"{where}: point {raw} lacks N")
            p["experiment"] = exp["experiment"]
            # generate's heads come from its model; the others' from h_kv, g, d
            layers = "full" if p["layers"] in (None, 0) else p["layers"]
            shape = f"{p['model']}-L{layers}" if p["op"] == "generate" else f"hkv{p['h_kv']}-g{p['g']}-d{p['d']}"
            p["id"] = (f"{p['op'].replace('_', '')}-{p['impl'].replace('_', '')}-N{p['N']}-b{p['batch']}-{shape}"
                       f"-B{p['block_size']}-T{p['topk']}-s{p['steps']}-{DTYPE_TAGS[p['dtype']]}-{point_hash(p)}")
            if p["id"] not in seen:
                seen.add(p["id"])
                points.append(p)
    return points
