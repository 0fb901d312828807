"""Compile every Triton kernel fsalab launches for the H200 (sm_90), on a machine without a GPU.

The Triton interpreter runs the kernels' Python, not the GPU front end: a kernel can pass every
CPU test and still fail to compile for the GPU (a constexpr reassigned inside a static loop,
a shape the layout pass rejects). This check closes that gap without a device:

1. record: under TRITON_INTERPRET=1, run NativeSparseAttention forward and backward (fp16, every
   selected-attention impl of ours at (d, g) = (64, 4) and (128, 5), fsa at (256, 1), nsa at
   (64, 16); the triton compression/window/gate branches) and record each kernel launch: its
   function, the types of its runtime arguments, its constexprs;
2. compile: in a fresh process without the interpreter, build each distinct launch with
   ``triton.compile`` for target cuda:90 under every autotune config of that kernel (the
   config's tiles replace the interpreter's), once as recorded and once with bf16 for fp16. A
   launch fails when a config does not build, or when every config needs more shared memory
   than a block may have.

Every kernel of ops/ is reached (nsa's dk/dv segment merge through g = 16; the decode step's
kernels through one decode step per (d, g)). Exit status 1 when
any launch fails; prints one line per kernel.

    python scripts/check_sm90_compile.py [--jobs 2] [--part all|prefill|decode]
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


PARTS = ("all", "prefill", "decode")


def record(part: str = "all") -> list[dict]:
    """Launches under the interpreter, deduplicated: the module's forward and backward (part
    "prefill"), its decode step (part "decode"), or both ("all")."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime.jit import mangle_type

    from fsalab.config import NSAConfig
    from fsalab.models.patch import SELECTION_IMPLS
    from fsalab.modules import NativeSparseAttention
    from fsalab.testing import LaunchCounter, cu_seqlens_of

    seen: dict[str, dict] = {}

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

    with LaunchCounter(on_triton_launch=record_launch):
        cfg = NSAConfig(topk=4, window_size=64)
        lengths = [130, 40, 1]
        ours = [i for i in SELECTION_IMPLS if i not in ("auto", "reference")]
        # (impl, head dim, g) over 2 KV heads: the models' g = 4 and 5 at d 64 and 128, and the
        # extremes of the tested range (d 256 with g 1, g 16).
        cases = [(i, d, g) for i in ours for d, g in ((64, 4), (128, 5))] + [("fsa", 256, 1), ("nsa", 64, 16)]
        for impl, d, g in cases if part != "decode" else ():
            torch.manual_seed(0)
            heads = 2 * g
            module = NativeSparseAttention(d * heads, heads, 2, head_dim=d, config=cfg, selection_impl=impl,
                                           compression_impl="triton", window_impl="triton", gate_impl="triton",
                                           dtype=torch.float16)
            x = torch.randn(sum(lengths), d * heads, dtype=torch.float16, requires_grad=True)
            module(x, cu_seqlens_of(lengths)).float().square().mean().backward()
        if part != "prefill":
            record_decode(cfg, lengths, {(d, g) for _, d, g in cases})
    return list(seen.values())


def record_decode(cfg, lengths: list[int], shapes: set[tuple[int, int]]) -> None:
    """One decode step (ops/decode.py: ``append_token``'s two kernels and the five attention
    kernels) of a module filled from a prefill of ``lengths``, per (d, g) in ``shapes``."""
    import torch

    from fsalab.modules import NativeSparseAttention
    from fsalab.testing import cu_seqlens_of

    for d, g in sorted(shapes):
        torch.manual_seed(0)
        heads = 2 * g
        module = NativeSparseAttention(d * heads, heads, 2, head_dim=d, config=cfg, decode_impl="triton",
                                       dtype=torch.float16)
        cache = module.new_cache(len(lengths), max(lengths) + 8)
        with torch.no_grad():
            module(torch.randn(sum(lengths), d * heads, dtype=torch.float16), cu_seqlens_of(lengths), cache=cache)
            module.decode(torch.randn(len(lengths), d * heads, dtype=torch.float16), cache)


def _kernel(module: str, name: str):
    """The launchable object and the configs it would be built with on a GPU."""
    obj = getattr(importlib.import_module(module), name)
    configs = getattr(obj, "configs", None)
    jit = obj
    while not hasattr(jit, "arg_names") or hasattr(jit, "configs") or hasattr(jit, "values"):
        jit = jit.fn
    return jit, configs


def _build(launch: dict) -> list[str]:
    """Compile one recorded launch for sm_90 under each config; the error messages.

    A config over the shared-memory limit is pruned by the autotuner at run time, so it fails
    the launch only when every config of the kernel is over.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit, configs = _kernel(launch["module"], launch["name"])
    errors, over = [], []
    for cfg in configs or [None]:
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
            if shared > SHARED_LIMIT:
                over.append(f"{launch['name']} {cfg or ''}: {shared} B of shared memory > {SHARED_LIMIT}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none is fatal here
            root = exc
            while root.__cause__ is not None:  # the front end wraps the real error once per call level
                root = root.__cause__
            where = {k: const[k] for k in ("G", "G_P", "HEAD_DIM", "BLOCK_M", "BLOCK_N") if k in const}
            errors.append(f"{launch['name']} {where} warps {options.get('num_warps')}: {type(root).__name__}: "
                          f"{(str(root).strip().splitlines() or [''])[-1][:300]}")
    return errors + (over if len(over) == len(configs or [None]) else [])


def _with_bf16(launch: dict) -> dict | None:
    if not any(t == "*fp16" for t in launch["signature"].values()):
        return None
    swapped = {k: ("*bf16" if t == "*fp16" else t) for k, t in launch["signature"].items()}
    return launch | {"signature": swapped}


def compile_all(launches: list[dict], jobs: int) -> int:
    builds = [b for launch in launches for b in (launch, _with_bf16(launch)) if b is not None]
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        results = list(pool.map(_build, builds))
    per_kernel: dict[str, list[int]] = {}
    for build, errors in zip(builds, results):
        counts = per_kernel.setdefault(f"{build['module']}.{build['name']}", [0, 0])
        counts[0] += 1
        counts[1] += bool(errors)
        for err in errors:
            failures += 1
            print(f"[FAIL] {err}", flush=True)
    for kernel, (n, bad) in sorted(per_kernel.items()):
        print(f"{'ok  ' if not bad else 'FAIL'} {kernel}: {n - bad}/{n} launches compiled for sm_{TARGET[1]}")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--part", choices=PARTS, default="all",
                    help="the launches to check: the module's forward and backward, its decode step, or both")
    ap.add_argument("--compile-from", help=argparse.SUPPRESS)  # internal: the second process
    args = ap.parse_args(argv)
    if args.compile_from:
        with open(args.compile_from) as fh:
            return 1 if compile_all(json.load(fh), args.jobs) else 0
    launches = record(args.part)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fsalab-sm90-launches-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(launches, fh, default=str)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    print(f"{len(launches)} distinct launches recorded; compiling for sm_{TARGET[1]}", flush=True)
    try:
        return subprocess.call([sys.executable, __file__, "--jobs", str(args.jobs), "--compile-from", path], env=env)
    finally:
        os.remove(path)


if __name__ == "__main__":
    sys.exit(main())
