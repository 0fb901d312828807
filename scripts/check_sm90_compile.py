"""Compile every Triton kernel fsalab launches for the H200 (sm_90), on a machine without a GPU.

The Triton interpreter runs the kernels' Python, not the GPU front end: a kernel can pass every
CPU test and still fail to compile for the GPU (a constexpr reassigned inside a static loop,
a shape the layout pass rejects). This check closes that gap without a device:

1. record: under TRITON_INTERPRET=1, run NativeSparseAttention forward and backward (fp16) for
   each case of CASES and record each kernel launch: its function, the types of its runtime
   arguments, its constexprs (FSA's kernels, which take planned tiles rather than autotune
   configs, get the GPU's plan). Every selected-attention impl of ours runs at (d, g) = (64, 4)
   and (128, 5), fsa at (256, 1), nsa at (64, 16). The triton compression, window and gate branches
   and one decode step (ops/decode/step.py) run where their launches are new (they depend on d or
   (d, g), not on the selection impl); elsewhere those branches take the reference;
2. compile: in a fresh process without the interpreter, build each distinct launch with
   ``triton.compile`` for target cuda:90, in bf16 (for fp16) under every autotune config the
   kernel's prune keeps (the configs the GPU autotuner compiles; the config's tiles replace the
   interpreter's), and once more as recorded (fp16) under the first of them. fp16 and bf16 take
   the same bytes, so their layouts and shared memory agree per config; the fp16 build checks
   the instruction selection that differs. A launch fails when a build fails, or when every
   config needs more shared memory than a block may have.

Every kernel of ops/ is reached (nsa's dk/dv segment merge through g = 16; CASES names each
case's kernels and the script fails when one is not launched). Cases are independent, so the
test runs them as separate items; exit status 1 when any launch fails; prints one line per kernel.

    python scripts/check_sm90_compile.py [--case NAME ...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import inspect
import json
import os
import subprocess
import sys

TARGET = ("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory one block may opt into on the H100/H200
def _is_constexpr(annotation) -> bool:
    return "constexpr" in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation)))


# name -> runs of (selection impl, head dim, g, branches run by triton kernels, kernels the run must
# launch, as "<module of ops>.<kernel>"). (d, g) are the models' g = 4 and 5 at d 64 and 128 and
# the extremes of the tested range (d 256 with g 1, g 16). The other
# branches run the reference: the compression kernels' launches depend on (d, g), the window's
# and the gate's on d only, decode's on (d, g), none on the selection impl.
# tests/test_sm90_compile.py checks that the cases together name every kernel src/fsalab launches.
_ALL = ("compression", "window", "gate", "decode")
_COMPRESSION = ("compress_kv._cu_cmp_kernel", "compress_kv._compress_fwd_kernel", "compress_kv._compress_dx_kernel",
                "compress_kv._compress_dw_kernel", "compress_kv._compress_dpe_kernel", "block_select._select_kernel",
                "flash._fwd_kernel", "flash._dq_kernel", "flash._dkdv_kernel", "flash._stats_kernel")
_GATE = ("fused._gated_sum_fwd", "fused._gated_sum_bwd")
_DECODE = ("step._append_kernel", "step._compress_step_kernel", "step._cmp_partial_kernel", "step._score_kernel", "step._topk_kernel",
           "step._sw_partial_kernel", "step._combine_kernel")
_PLAN = ("index_kernels._entry_keys_kernel", "index_kernels._csr_kernel",
         "worklist._row_scan_kernel", "worklist._items_kernel")
_FSA = _PLAN + ("fsa_partials._partial_kernel", "fsa_partials._merge_kernel", "fsa_partials._nonfinite_blocks_kernel",
                "fsa_bwd._delta_kernel", "fsa_bwd._dkdv_kernel", "fsa_bwd._dkdv_merge_kernel")
_NSA = _PLAN + ("index_kernels._token_start_kernel", "nsa._fwd_kernel", "nsa._bwd_dq_kernel", "nsa._bwd_dkdv_kernel")
CASES: dict[str, list[tuple[str, int, int, tuple[str, ...], tuple[str, ...]]]] = {
    "fsa-d64-g4": [("fsa", 64, 4, _ALL, _COMPRESSION + _GATE + _DECODE + _FSA)],
    "fsa-d128-g5": [("fsa", 128, 5, _ALL, _COMPRESSION + _GATE + _DECODE + _FSA)],
    "fsa-d256-g1": [("fsa", 256, 1, _ALL, _COMPRESSION + _GATE + _DECODE + _FSA)],
    # window and gate at d = 64 run in fsa-d64-g4; the segment merge needs MERGE_LENGTHS (below)
    "nsa-d64-g16": [("nsa", 64, 16, ("compression", "decode"), _COMPRESSION + _DECODE + _NSA),
                    ("nsa", 64, 16, (), ("nsa._bwd_dkdv_merge_kernel",))],
    "fsa_paper": [("fsa_paper", 64, 4, (), _FSA), ("fsa_paper", 128, 5, (), _FSA)],
    "nsa": [("nsa", 64, 4, (), _NSA), ("nsa", 128, 5, (), _NSA)],
}


# The packed sequences the module runs: 70 tokens (two 64-token blocks, the second partial) and
# one token. A run that must reach nsa's dk/dv segment merge (g = 16) needs the sink's list past
# one segment: 130 tokens; it runs with the reference branches, whose Triton launches the
# shorter run records (the same set as one run of everything at 130 tokens, in half the time).
# Each case records the same set of launches at these lengths as with [130, 40, 1], in a third
# to a half of the interpreter time.
LENGTHS = [70, 1]
MERGE_LENGTHS = [130, 1]


def record(cases: list[str]) -> list[dict]:
    """Launches of the module's forward and backward under the interpreter, deduplicated."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime.jit import mangle_type

    from fsalab.config import NSAConfig
    from fsalab.modules import NativeSparseAttention
    from fsalab.ops.selected import fsa_plan
    from fsalab.testing import LaunchCounter, cu_seqlens_of

    seen: dict[str, dict] = {}
    launched: set[str] = set()

    def record_launch(kernel, args, kwargs):
        params = inspect.signature(kernel.fn).parameters
        bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        sig, const = {}, {}
        for name, value in bound.items():
            if _is_constexpr(params[name].annotation):
                const[name] = value.value if hasattr(value, "value") else value
            elif value is None:
                const[name] = None
            else:
                sig[name] = mangle_type(value)
        launch = {"module": kernel.fn.__module__, "name": kernel.fn.__name__, "signature": sig, "constexprs": const,
                  "options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}}
        seen.setdefault(json.dumps(launch, sort_keys=True, default=str), launch)
        launched.add(f"{launch['module'].rsplit('.', 1)[-1]}.{launch['name']}")

    # FSA's kernels launch with planned tiles, not autotune configs: plan them as on the GPU, so
    # the tiles built here are the H200's (the interpreter's own plan never runs on a device).
    interpreter_plan = fsa_plan.bwd_tiles(4, 128, 64)
    fsa_plan.interpreting = lambda: False
    if fsa_plan.bwd_tiles(4, 128, 64) == interpreter_plan:
        raise SystemExit("fsa_plan no longer plans through fsa_plan.interpreting(): this check would "
                         "build the interpreter's tiles, not the GPU's")
    cfg = NSAConfig(topk=4, window_size=64)
    missing = []
    for impl, d, g, branches, expected in (run for name in cases for run in CASES[name]):
        launched.clear()
        lengths = MERGE_LENGTHS if "nsa._bwd_dkdv_merge_kernel" in expected else LENGTHS
        with LaunchCounter(on_triton_launch=record_launch):
            torch.manual_seed(0)
            h_kv = 2 if impl == "nsa" else 1  # nsa's kernels take the KV head count as a constexpr, fsa's do not
            heads = h_kv * g
            kind = {b: "triton" if b in branches else "reference" for b in _ALL}
            module = NativeSparseAttention(d * heads, heads, h_kv, head_dim=d, config=cfg, selection_impl=impl,
                                           compression_impl=kind["compression"], window_impl=kind["window"],
                                           gate_impl=kind["gate"], dtype=torch.float16)
            x = torch.randn(sum(lengths), d * heads, dtype=torch.float16, requires_grad=True)
            module(x, cu_seqlens_of(lengths)).float().square().mean().backward()
            if "decode" in branches:
                record_decode(cfg, lengths, d, g, h_kv)
        missing += [f"{impl} (d {d}, g {g}): {k}" for k in expected if k not in launched]
    if missing:
        raise SystemExit("kernels a case should launch and did not: " + "; ".join(missing))
    return list(seen.values())


def record_decode(cfg, lengths: list[int], d: int, g: int, h_kv: int) -> None:
    """One decode step (ops/decode/step.py: ``append_token``'s two kernels and the five attention
    kernels) of a module with ``h_kv`` KV heads filled from a prefill of ``lengths``."""
    import torch

    from fsalab.modules import NativeSparseAttention
    from fsalab.testing import cu_seqlens_of

    torch.manual_seed(0)
    heads = h_kv * g
    module = NativeSparseAttention(d * heads, heads, h_kv, head_dim=d, config=cfg, decode_impl="triton",
                                   dtype=torch.float16)
    cache = module.new_cache(len(lengths), max(lengths) + 8)
    with torch.no_grad():
        module(torch.randn(sum(lengths), d * heads, dtype=torch.float16), cu_seqlens_of(lengths), cache=cache)
        module.decode(torch.randn(len(lengths), d * heads, dtype=torch.float16), cache)


def _kernel(module: str, name: str):
    """The launchable object and the configs a GPU would build it with: those the kernel's
    autotune prune keeps (the launch's constexprs are what the prune reads), or None."""
    obj = getattr(importlib.import_module(module), name)
    configs = getattr(obj, "configs", None)
    jit = obj
    while not hasattr(jit, "arg_names") or hasattr(jit, "configs") or hasattr(jit, "values"):
        jit = jit.fn
    return jit, configs, getattr(obj, "early_config_prune", None)


def _build(build: tuple[dict, bool]) -> tuple[list[str], int]:
    """Compile one recorded launch for sm_90 under each config the autotuner would try (the first
    only when ``first_only``); the error messages and the most shared memory a build took (bytes,
    Triton's compile-time count).

    A config over the shared-memory limit is skipped by the autotuner at run time, so it fails
    the launch only when every config of the kernel is over.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch, first_only = build
    jit, configs, prune = _kernel(launch["module"], launch["name"])
    if configs and prune is not None:
        configs = prune(configs, dict(launch["constexprs"]), **launch["constexprs"])
    configs = (configs or [None])[:1] if first_only else configs or [None]
    errors, over, most = [], [], 0
    for cfg in configs:
        const = dict(launch["constexprs"])
        options = dict(launch["options"])
        if cfg is not None:
            const.update(cfg.kwargs)
            options.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        names = jit.arg_names
        sig = {n: launch["signature"].get(n, "constexpr") for n in names}
        src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in const.items() if k in names})
        try:
            shared = triton.compile(src, target=GPUTarget(*TARGET), options=options).metadata.shared
            most = max(most, shared)
            if shared > SHARED_LIMIT:
                over.append(f"{launch['name']} {cfg or ''}: {shared} B of shared memory > {SHARED_LIMIT}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none is fatal here
            root = exc
            while root.__cause__ is not None:  # the front end wraps the real error once per call level
                root = root.__cause__
            where = {k: const[k] for k in ("G", "G_P", "HEAD_DIM", "BLOCK_M", "BLOCK_N") if k in const}
            errors.append(f"{launch['name']} {where} warps {options.get('num_warps')}: {type(root).__name__}: "
                          f"{(str(root).strip().splitlines() or [''])[-1][:300]}")
    return errors + (over if len(over) == len(configs) and not first_only else []), most


def _builds(launch: dict) -> list[tuple[dict, bool]]:
    """(launch, first config only) pairs: an fp16 launch in bf16 under every config, then as
    recorded under the first; any other launch as recorded under every config."""
    if not any(t == "*fp16" for t in launch["signature"].values()):
        return [(launch, False)]
    swapped = {k: ("*bf16" if t == "*fp16" else t) for k, t in launch["signature"].items()}
    return [(launch | {"signature": swapped}, False), (launch, True)]


def compile_all(launches: list[dict], jobs: int) -> int:
    builds = [b for launch in launches for b in _builds(launch)]
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        results = list(pool.map(_build, builds))
    per_kernel: dict[str, list[int]] = {}
    for (launch, _), (errors, shared) in zip(builds, results):
        counts = per_kernel.setdefault(f"{launch['module']}.{launch['name']}", [0, 0, 0])
        counts[0] += 1
        counts[1] += bool(errors)
        counts[2] = max(counts[2], shared)
        for err in errors:
            failures += 1
            print(f"[FAIL] {err}", flush=True)
    for kernel, (n, bad, shared) in sorted(per_kernel.items()):
        print(f"{'ok  ' if not bad else 'FAIL'} {kernel}: {n - bad}/{n} launches compiled for sm_{TARGET[1]}"
              f" (shared memory up to {shared} B)")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="a case of CASES (repeatable; default all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--compile-from", help=argparse.SUPPRESS)  # internal: the second process
    args = ap.parse_args(argv)
    if args.compile_from:
        with open(args.compile_from) as fh:
            return 1 if compile_all(json.load(fh), args.jobs) else 0
    launches = record(args.case or list(CASES))
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fsalab-sm90-launches-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(launches, fh, default=str)
    # The compiler, not the interpreter; autotuning stays on (its default), so every config is built.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    print(f"{len(launches)} distinct launches recorded; compiling for sm_{TARGET[1]}", flush=True)
    try:
        return subprocess.call([sys.executable, __file__, "--jobs", str(args.jobs), "--compile-from", path], env=env)
    finally:
        os.remove(path)


if __name__ == "__main__":
    sys.exit(main())
