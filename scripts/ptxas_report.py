"""Registers and spill bytes of one Triton kernel built for sm_90a on CPU (no GPU), by ptxas -v.

For kernels ``sass_loop_count.py`` has no plan for: any ``@triton.jit`` function (or autotuned
one) of a module or of a file, built with the given constexprs, warps and stages. Arguments
named like pointers (starting with an upper-case letter or ending in ``_ptr``) are ``*bf16``
unless ``--ptr NAME=TYPE`` says otherwise, ``--float`` names fp32 scalars, the rest are i32;
pointers get the 16-byte divisibility hint the launcher gives aligned tensors. ``--int
PATTERN=VALUE`` gives runtime integers (fnmatch patterns, e.g. ``'stride*=16'``) a value that the
launcher's specialisation sees (1 becomes a constant, a multiple of 16 a divisibility hint; the
kernel's ``do_not_specialize`` arguments are left alone); without it they are plain i32.

    python scripts/ptxas_report.py fsalab.ops.flash:_fwd_kernel --const D=128 --const D_PAD=128 \\
        --const PRECISION=tf32 --const BLOCK_M=128 --const BLOCK_N=128 --ptr LSE=fp32 --ptr CU_Q=i32 \\
        --ptr CU_K=i32 --float scale_log2 --int 'stride*=16' --warps 8 --stages 3
    python scripts/ptxas_report.py path/to/variant.py:_my_kernel ...

Prints ``<registers> registers, <bytes> B spilled``.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import sass_loop_count as slc  # noqa: E402  (sets up src/ on the path, the interpreter off)
from triton.compiler import ASTSource  # noqa: E402


def load(target: str):
    """The jit function ``module:name`` or ``path/to/file.py:name`` (an autotuner's inner function)."""
    where, name = target.rsplit(":", 1)
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(pathlib.Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name)
    return fn.fn if hasattr(fn, "configs") else fn  # triton.autotune wraps the JITFunction


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def report(target: str, const: dict, ptr: dict, floats: set, ints: dict, warps: int, stages: int) -> tuple[int, int]:
    """(registers, spill-store bytes) of ``target`` built for sm_90a; ``ints``: pattern -> value."""
    jit = load(target)
    fixed = {jit.arg_names[i] if isinstance(i, int) else i for i in getattr(jit, "do_not_specialize", ())}
    sig = {}
    for n in jit.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in floats:
            sig[n] = "fp32"
        elif n in ptr or n[0].isupper() or n.endswith("_ptr"):
            sig[n] = "*" + ptr.get(n, "bf16")
        else:
            sig[n] = "i32"
    values = {n: v for pattern, v in ints.items() for n in fnmatch.filter(jit.arg_names, pattern)
              if sig.get(n) == "i32" and n not in fixed}
    src = slc.launch_source(ASTSource, jit, sig, const, values)
    text, _ = slc.build_sass(src, warps, stages)
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    return regs, spills


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="module:kernel or file.py:kernel")
    ap.add_argument("--const", action="append", default=[], metavar="NAME=VALUE", help="a constexpr (int or str)")
    ap.add_argument("--ptr", action="append", default=[], metavar="NAME=TYPE", help="a pointer's element type")
    ap.add_argument("--float", action="append", default=[], metavar="NAME", help="an fp32 scalar argument")
    ap.add_argument("--int", action="append", default=[], metavar="PATTERN=VALUE",
                    help="runtime ints the launcher specialises (fnmatch pattern)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args(argv)
    const = {k: _value(v) for k, v in (c.split("=", 1) for c in args.const)}
    ptr = dict(p.split("=", 1) for p in args.ptr)
    ints = {k: int(v) for k, v in (i.split("=", 1) for i in args.int)}
    regs, spills = report(args.target, const, ptr, set(args.float), ints, args.warps, args.stages)
    print(f"{regs} registers, {spills} B spilled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
