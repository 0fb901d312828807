"""Static SASS of a kernel built for sm_90a on CPU (no GPU): registers, spill bytes and the
instructions of its main loop (the largest loop body), by opcode, for each tile config. Triton's
own ptxas and cuobjdump do the work. Kernels:

- ``select``: block_select's ``_select_kernel``; the loop is the score loop, counted per thread
  and chunk of 16 blocks, and per token over all threads.
- ``fsa_partial``: FSA's forward ``_partial_kernel`` in its FAST mode (work list, no containment
  pass), and ``fsa_dkdv``: the fused backward's ``_dkdv_kernel`` (dK/dV and the dq partials);
  the loop is one tile of TOK tokens x G heads, counted per thread and tile, and per (token,
  head) row over all threads. Default configs: the tiles ``selection.fsa_plan`` plans on the
  GPU for g = 1, 4, 5, 8.

A count, not a timing: it says where the loop's instructions go and how a variant changes them
(``--source`` builds another version of the kernel's module, ``--replace`` edits the source
first, e.g. to take a part out and see its share); whether the kernel is issue-bound is for the
device to tell (docs/perf-log.md, Open).

    python scripts/sass_loop_count.py [--kernel select|fsa_partial|fsa_dkdv] [--source FILE]
        [--replace OLD NEW ...] [--config G,BLOCK_M,WARPS[,STAGES] ...]

Constexprs and integer arguments are those of one sequence of 64K tokens at the defaults:
4 KV heads, d = 128, (64, 16), l = 32, s = 16, bf16. The integer arguments are specialised as
Triton's launcher does (a value of 1 becomes a constant, a multiple of 16 gets the divisibility
hint that lets gathers vectorise).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from fsalab.ops._triton import dot_precision, search_steps  # noqa: E402
from fsalab.ops.selection.fsa_plan import bwd_tiles, fwd_tiles  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
N, H_KV, D, BS, TOPK = 65536, 4, 128, 64, 16
CAP = N // BS + 1  # selection.index.block_capacity of one sequence
PREC = dot_precision(torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """How to build one kernel: its module and function, pointer element types (others: *bf16),
    the integer arguments of a 64K launch and the constexprs, both from (G, BLOCK_M)."""

    module: str
    function: str
    pointers: dict[str, str]
    floats: tuple[str, ...]
    ints: Callable[[int], dict[str, int]]
    const: Callable[[int, int], dict]
    configs: list[str]
    unit: str  # what the loop counts per: "chunk" (select) or "tile" (FSA)
    rows: Callable[[int, int], int]  # tokens (select) or (token, head) rows (FSA) per loop pass


def _fsa_configs(plan) -> list[str]:
    return [f"{g},{t.block_m},{t.num_warps},{t.num_stages}" for g in (1, 4, 5, 8) for t in [plan(g)]]


_FSA_INTS = lambda g: dict(stride_qt=4 * g * D, stride_qh=D, stride_kt=H_KV * D, stride_kh=D,  # noqa: E731
                           stride_lt=4 * g, r_begin=0, r_end=H_KV * CAP, cap=CAP, g=g, d=D)
_FSA_I32 = {n: "*i32" for n in ("row_ptr", "token_ids", "blk_start", "blk_len", "blk_local", "first", "item_row",
                                "item_sub", "max_rest", "slot_first", "v_bad_rows")}

KERNELS = {
    "select": Kernel(
        "fsalab.ops.block_select", "_select_kernel",
        {"lse_ptr": "*fp32", "cu_ptr": "*i32", "cuc_ptr": "*i32", "out_ptr": "*i32"}, ("qk_scale",),
        lambda g: dict(batch=1, steps=search_steps(1), s_qt=4 * g * D, s_qh=D, s_kt=H_KV * D, s_kh=D, s_lt=4 * g,
                       s_lh=1, s_ot=H_KV * TOPK, s_oh=TOPK),
        lambda g, bm: dict(G=g, G_HI=g, G_LO_P=0, HEAD_DIM=D, D_PAD=D, L=32, S=16, BS=BS, TOPK=TOPK, T_P=16, BB=16,
                           INIT=1, LOCAL=2, BLOCK_M=bm, DOT_PREC=PREC),
        ["1,64,4", "1,128,8", "4,64,4", "4,128,8"],  # block_select._SELECT_CONFIGS at g = 1 and 4
        "chunk", lambda g, bm: bm // g),
    "fsa_partial": Kernel(
        "fsalab.ops.selection.fsa_partials", "_partial_kernel",
        {"lse": "*fp32", "delta": "*fp32", "lbuf": "*fp32", **_FSA_I32}, ("qk_scale", "sm_scale"),
        lambda g: {**_FSA_INTS(g), "j0": 0, "Gc": g, "n_sub": 1},
        lambda g, bm: dict(HP=1, G=g, TOK=bm // g, BLOCK_M=bm, NUM_MT=4, BLOCK_N=BS, NUM_KT=1, D=D, MODE=2,
                           TABLE=True, EARLY_RETURN=True, PREC=PREC, CONTAIN=False),
        _fsa_configs(lambda g: fwd_tiles(g, D, BS, paper=False)),
        "tile", lambda g, bm: bm // g * g),
    "fsa_dkdv": Kernel(
        "fsalab.ops.selection.fsa_bwd", "_dkdv_kernel",
        {"lse": "*fp32", "delta": "*fp32", "dkp": "*fp32", "dvp": "*fp32", **_FSA_I32}, ("qk_scale", "sm_scale"),
        lambda g: {**_FSA_INTS(g), "block_size": BS},
        lambda g, bm: dict(G=g, TOK=bm // g, BLOCK_M=bm, NUM_MT=16, BLOCK_N=BS, NUM_KT=1, D=D, FUSED_DQ=True,
                           PREC=PREC),
        _fsa_configs(lambda g: bwd_tiles(g, D, BS)),
        "tile", lambda g, bm: bm // g * g),
}


def load_module(kernel: Kernel, source: str):
    """Source text as a sibling module of the kernel's (its relative imports work)."""
    fh = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    fh.write(source)
    fh.close()
    name = kernel.module.rsplit(".", 1)[0] + "._sass_variant"
    spec = importlib.util.spec_from_file_location(name, fh.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sass(kernel: Kernel, module, g: int, block_m: int, warps: int, stages: int) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of the kernel under one tile config."""
    jit = getattr(module, kernel.function)
    while not hasattr(jit, "arg_names") or hasattr(jit, "configs"):  # unwrap the autotuner
        jit = jit.fn
    names = jit.arg_names
    const = {k: v for k, v in kernel.const(g, block_m).items() if k in names}
    sig = {n: "constexpr" if n in const else "fp32" if n in kernel.floats else kernel.pointers.get(n, "i32")
           for n in names}
    ints = kernel.ints(g)
    for n in names:  # arguments neither integers nor listed pointers: bf16 tensors (q, k, v, dO, outputs)
        if sig[n] == "i32" and n not in ints:
            sig[n] = "*bf16"
    hinted = {n for n in names if sig[n].startswith("*")}
    for name, value in ints.items():
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            sig[name], const[name] = "constexpr", spec
        elif spec == "D":
            hinted.add(name)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        pathlib.Path(ptx_path).write_text(ptx)
        report = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx_path, "-o", cubin], check=True,
                                capture_output=True, text=True).stderr
        return report, subprocess.run([BIN / "cuobjdump", "-sass", cubin], check=True, capture_output=True,
                                      text=True).stdout


def loop_body(text: str) -> dict[str, int]:
    """Opcode counts between the largest backward branch and its target."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", text)]
    best = (0, 0, -1)
    for addr, op in ins:
        target = re.search(r"0x([0-9a-f]+)", op) if "BRA" in op else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            best = max(best, (sum(lo <= a <= addr for a, _ in ins), lo, addr))
    counts: dict[str, int] = {}
    for addr, op in ins:
        if best[1] <= addr <= best[2]:
            name = re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="select")
    ap.add_argument("--source", help="another version of the kernel's module (default: the tree's)")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="replace OLD (must occur once) by NEW in the source before building")
    ap.add_argument("--config", action="append", help="G,BLOCK_M,WARPS[,STAGES] (stages default 2)")
    args = ap.parse_args(argv)
    kernel = KERNELS[args.kernel]
    path = args.source or importlib.util.find_spec(kernel.module).origin
    source = pathlib.Path(path).read_text()
    for old, new in args.replace:
        if source.count(old) != 1:
            raise SystemExit(f"--replace: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    module = load_module(kernel, source)
    for config in args.config or kernel.configs:
        g, block_m, warps, *rest = (int(x) for x in config.split(","))
        stages = rest[0] if rest else 2
        report, text = sass(kernel, module, g, block_m, warps, stages)
        regs = re.search(r"Used (\d+) registers", report).group(1)
        spills = re.search(r"(\d+) bytes spill stores", report).group(1)
        counts = loop_body(text)
        n = sum(counts.values())
        top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
        rows = kernel.rows(g, block_m)
        per_row = n * 32 * warps // rows
        what = "token" if kernel.unit == "chunk" else "(token, head) row"
        print(f"{args.kernel} G={g} BLOCK_M={block_m} warps={warps} stages={stages}: {regs} registers, {spills} B "
              f"spilled; loop {n} instructions per thread and {kernel.unit} ({per_row} per {what}, all threads): "
              f"{top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
