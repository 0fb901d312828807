"""Experiment configs: load ``experiments/<name>.yaml``, validate it against
``workflow/schemas/experiment.schema.yaml`` (filling defaults), expand its grid into points.

Each point gets its parameters filled and its ``id`` (``fsalab.bench.points``); results are
written to ``results/<platform>/<experiment>/<id>.json``, so editing any parameter in a YAML
gives new ids (Snakemake then re-measures those points). The Snakefile and the CLI both expand
grids here, so they always agree on the point list. Misspelt parameters, axes, impl names,
model names and experiment names are errors.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

from .. import data
from .decode_points import expand_points as expand_decode_points
from .points import E2E_OPS, E2E_RUNNERS, KernelPoint, e2e_base, e2e_point_id, expand_subgrid, point_id
from .repo import repo_root

KERNEL_REQUIRED = ("op", "impl", "direction", "N", "g")
THEORY_REQUIRED = ("N", "g", "cost_model")
E2E_REQUIRED = ("op", "model", "impl", "N", "dtype")


def load_schema(name: str) -> dict:
    """``<name>.schema.yaml`` of the package data (``workflow/schemas/`` in a checkout) as a dict
    (a fresh copy: callers may change it)."""
    return copy.deepcopy(_parsed_schema(name))


@functools.lru_cache(maxsize=None)
def _parsed_schema(name: str) -> dict:
    # Parsed once per process: pyyaml takes ~25 ms per schema, and result files are checked
    # against one row by row (fsalab.results reads thousands).
    with open(data.path("schemas", f"{name}.schema.yaml")) as fh:
        return yaml.safe_load(fh)


def _with_defaults(validator_cls):
    """A validator class that also writes each property's ``default`` into the instance."""
    validate_properties = validator_cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub:
                    instance.setdefault(prop, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_cls, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def validate(instance: dict, schema: dict, where: str) -> dict:
    """Validate ``instance`` in place (defaults filled); ValueError naming ``where`` on failure."""
    errors = sorted(_Validator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:10]]
        raise ValueError(f"{where} is not a valid config:\n" + "\n".join(lines))
    return instance


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


OVERLAYS = ("smoke", "paper")


def known_experiments() -> list[str]:
    """Names of the experiments (every YAML of the checkout's ``experiments/``, else of the
    package's copy, but the overlays smoke.yaml and paper.yaml), sorted."""
    local = repo_root() / "experiments"
    folder = local if local.is_dir() else data.path("experiments")
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem not in OVERLAYS)


def experiment_path(name_or_path: str | Path) -> Path:
    """``experiments/<name>.yaml`` under the repo root, else the package's copy; or the path itself
    if it is a file. ValueError listing the known experiments for a name that has no YAML."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise ValueError(f"experiment file {str(p)!r} does not exist")
        return p
    local = repo_root() / "experiments" / f"{name_or_path}.yaml"
    path = local if local.is_file() else data.path("experiments", f"{name_or_path}.yaml")
    if not path.is_file():
        raise ValueError(f"unknown experiment {str(name_or_path)!r}; known: {', '.join(known_experiments())}")
    return path


def read_yaml(path: str | Path):
    """The parsed YAML file; ValueError naming the file, the line and the problem of a syntax error."""
    try:
        with open(path) as fh:
            return yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None


def load_experiment(name_or_path: str | Path, smoke: bool = False, paper: bool = False) -> dict:
    """A validated experiment; with ``smoke`` (``paper``) its entry of experiments/smoke.yaml
    (experiments/paper.yaml) merged over it."""
    if smoke and paper:
        raise ValueError("an experiment is loaded with the smoke overlay or the paper overlay, not both")
    path = experiment_path(name_or_path)
    exp = read_yaml(path)
    if not isinstance(exp, dict):
        raise ValueError(f"{path} must hold a mapping (experiment, runner, grid, ...), got {type(exp).__name__}")
    overlay = "smoke" if smoke else "paper" if paper else None
    if overlay:
        entries = load_overlay(overlay)["experiments"]
        name = exp.get("experiment")
        if name not in entries:
            raise ValueError(f"experiments/{overlay}.yaml has no entry for experiment {name!r}")
        exp = _deep_merge(exp, entries[name])
    return validate(exp, load_schema("experiment"), str(path) + (f" ({overlay})" if overlay else ""))


def load_overlay(name: str) -> dict:
    """experiments/<name>.yaml of an overlay (``OVERLAYS``), validated."""
    if name not in OVERLAYS:
        raise ValueError(f"overlay must be one of {OVERLAYS}, got {name!r}")
    path = experiment_path(name)
    return validate(read_yaml(path), load_schema("overlay"), str(path))


def load_smoke() -> dict:
    """experiments/smoke.yaml, validated."""
    return load_overlay("smoke")


def check_impl(p: dict, where: str) -> None:
    """ValueError when the point's impl (or model) is not a name the runner knows, whether or
    not it can run on this machine: a misspelt impl is a config error, not an ``unsupported`` row."""
    if p.get("op") in E2E_OPS:
        from ..models.configs import MODELS
        from ..models.patch import canonical_impl

        try:
            canonical_impl(p["impl"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if p["model"] not in MODELS:
            raise ValueError(f"{where}: model must be one of {sorted(MODELS)}, got {p['model']!r}")
        return
    if "impl" in p:
        from .ops import known_impls

        known = known_impls(p["op"])
        if p["impl"] not in known:
            raise ValueError(f"{where}: impl of op {p['op']!r} must be one of {sorted(known)}, got {p['impl']!r}")


def is_parallel(exp: dict) -> bool:
    """Whether some point of the experiment runs over several ranks (``parallel`` fsdp or tp):
    it runs under torchrun, and its points need a rank count (``expand``'s ``ranks``)."""
    if exp["runner"] not in E2E_RUNNERS:
        return False
    values = [exp.get("defaults", {}).get("parallel", "none")]
    values += [v for sub in exp["grid"] for raw in expand_subgrid(sub) for k, v in raw.items() if k == "parallel"]
    return any(v != "none" for v in values)


def _expand_e2e(exp: dict, base: dict | None = None, ranks: int | None = None) -> list[dict]:
    """Points of an end-to-end experiment: runner defaults <- ``base`` <- exp defaults <- each
    sub-grid's values, a parallel point's rank count from ``ranks``; ids from ``points.e2e_point_id``."""
    start = {**e2e_base(exp["runner"]), **copy.deepcopy(base or {})}
    schema = load_schema("experiment")
    params_schema = {"$defs": schema["$defs"], **schema["$defs"]["e2e_params"]}
    points, seen = [], set()
    for i, sub in enumerate(exp["grid"]):
        for raw in expand_subgrid(sub):
            where = f"{exp['experiment']} grid[{i}]"
            if "ranks" in raw or "ranks" in exp.get("defaults", {}):
                raise ValueError(f"{where}: ranks is the launcher's rank count, not a parameter of the experiment "
                                 "(torchrun --nproc-per-node, or the workflow's torchrun config)")
            p = {**copy.deepcopy(start), **copy.deepcopy(exp.get("defaults", {})), **raw}
            p = validate(p, params_schema, where)
            missing = [k for k in E2E_REQUIRED if p.get(k) is None]
            if missing:
                raise ValueError(f"{where}: point {raw} lacks {missing}")
            check_impl(p, where)
            if p["parallel"] != "none":
                if ranks is None:
                    raise ValueError(f"{where}: a point with parallel: {p['parallel']} names its rank count in its "
                                     "id: give the rank count it runs at (--ranks; grid.expand's ranks)")
                p["ranks"] = ranks
            p["experiment"] = exp["experiment"]
            p["id"] = e2e_point_id(p)
            if p["id"] not in seen:
                seen.add(p["id"])
                points.append(p)
    return points


def kernel_point(params: dict, where: str, experiment: str | None = None, theory: bool = False) -> KernelPoint:
    """The ``KernelPoint`` of kernel-level ``params``: validated against the experiment schema's
    kernel parameters (defaults filled), its impl checked, its id computed. ValueError naming
    ``where`` for a missing or unknown parameter or an unknown impl."""
    schema = load_schema("experiment")
    params_schema = {"$defs": schema["$defs"], **schema["$defs"]["params"]}
    p = validate(copy.deepcopy(params), params_schema, where)
    missing = [k for k in (THEORY_REQUIRED if theory else KERNEL_REQUIRED) if k not in p]
    if missing:
        raise ValueError(f"{where}: point {params} lacks {missing}")
    check_impl(p, where)
    if experiment is not None:
        p["experiment"] = experiment
    p["id"] = point_id(p)
    return KernelPoint(**p)


def expand(exp: dict, base: dict | None = None, ranks: int | None = None) -> list[KernelPoint] | list[dict]:
    """Every point of the experiment's grid, validated, with ``id`` and ``experiment`` set:
    ``KernelPoint``s for the kernel-level runners, dicts for the end-to-end and decode ones.

    Raises ValueError for a point that lacks a required parameter, has one the runner does not
    know (a misspelt key or axis), names an unknown impl or model, or duplicates another's id.
    End-to-end runners (train, prefill, convergence) start from their runner's defaults
    (``base`` overrides them); the points of a parallel experiment (``is_parallel``) take the
    rank count ``ranks`` they run at, which their ids name, and need it.
    """
    if exp["runner"] in E2E_RUNNERS:
        return _expand_e2e(exp, base, ranks)
    if exp["runner"] == "decode":  # its own parameters (decode_points.DEFAULTS)
        return expand_decode_points(exp)
    points, seen = [], {}
    for i, sub in enumerate(exp["grid"]):
        for raw in expand_subgrid(sub):
            p = kernel_point({**copy.deepcopy(exp.get("defaults", {})), **raw}, f"{exp['experiment']} grid[{i}]",
                             exp["experiment"], theory=exp["runner"] == "theory")
            if p.id in seen:
                # Identical points from overlapping sub-grids are measured once.
                if {k: v for k, v in seen[p.id].items() if k != "label"} != {k: v for k, v in p.items() if k != "label"}:
                    raise ValueError(f"{exp['experiment']}: two different points share the id {p.id}")
                continue
            seen[p.id] = p
            points.append(p)
    return points


def find_point(exp: dict, pid: str, ranks: int | None = None) -> KernelPoint | dict:
    """The point of ``exp`` (at ``ranks``, ``expand``) whose id is ``pid`` (ValueError listing a few ids otherwise)."""
    for p in expand(exp, ranks=ranks):
        if p["id"] == pid:
            return p
    ids = [p["id"] for p in expand(exp, ranks=ranks)]
    raise ValueError(f"experiment {exp['experiment']!r} has no point {pid!r}; e.g. {ids[:3]}")
