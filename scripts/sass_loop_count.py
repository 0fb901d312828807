"""Static SASS of a kernel built for sm_90a on CPU (no GPU): registers, spill bytes and the
instructions of its main loop (the largest loop body), by opcode, for each tile config. Triton's
own ptxas and cuobjdump do the work. Kernels:

- ``select``: block_select's ``_select_kernel``; the loops are the score loop's bodies (with
  masks, at the sequence's start and the tile's diagonal, and without, for the chunks in
  between: ``--loops 2``), counted per thread and chunk of 16 blocks, and per token over all
  threads.
- ``select_gluon``: block_select_gluon's ``select_kernel`` (Gluon, 4 warps, 128 tokens a program
  with one token's row per thread or 64 with each row in two threads: ``--config G,BLOCK_T,4``;
  the keys' prefetch as the launch's rule sets it), the same loops counted likewise, and
  the shared memory the build asks for (``block_select_gluon.shared_bytes`` estimates it).
- ``fsa_partial``: FSA's forward ``_partial_kernel`` in its FAST mode (work list, no containment
  pass), and ``fsa_dkdv``: the fused backward's ``_dkdv_kernel`` (dK/dV and the dq partials);
  the loop is one tile of TOK tokens x G heads (the backward: of one power-of-two part of the
  group, so g = 5 has two tile loops, ``--loops 2``), counted per thread and tile, and per
  (token, head) row over all threads. Default configs: the tiles ``selected.fsa_plan`` plans on the
  GPU for g = 1, 4, 5, 8.

A count, not a timing: it says where the loop's instructions go and how a variant changes them
(``--source`` builds another version of the kernel's module, ``--replace`` edits the source
first, e.g. to take a part out and see its share); whether the kernel is issue-bound is for the
device to tell.

    python scripts/sass_loop_count.py [--kernel select|select_gluon|fsa_partial|fsa_dkdv] [--source FILE]
        [--function NAME] [--const NAME=VALUE ...] [--rows N] [--loops K] [--same-as FILE]
        [--replace OLD NEW ...] [--config G,BLOCK_M,WARPS[,STAGES] ...]

``--function`` builds another kernel of the (``--source``) module with the same arguments plus
the constexprs ``--const`` adds (a variant kernel written for an A/B);
``--rows`` overrides the tile rows the per-row count divides by; ``--loops K`` reports the K
largest loops (a variant with two tile loops); ``--same-as FILE`` says whether each config's
whole SASS equals that of FILE's version of the module (``--const`` picks the variant, e.g.
``--const MODE=1 --const TABLE=0`` for fsa_paper's PAPER pass on the paper's grid). Each loop's count names its local-memory
reloads (LDL: spilled registers read back inside the loop).

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
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from fsalab.ops._triton import dot_precision, next_pow2, search_steps  # noqa: E402
from fsalab.ops.selected.fsa_plan import bwd_tiles, fwd_tiles, head_parts, split_tiles  # noqa: E402
from fsalab.ops.topk.block_select_gluon import prefetches  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
N, H_KV, D, BS, TOPK = 65536, 4, 128, 64, 16
CAP = N // BS + 1  # selected.index.block_capacity of one sequence
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
    gluon: bool = False  # a @gluon.jit kernel


def _fsa_configs(plan) -> list[str]:
    return [f"{g},{t.block_m},{t.num_warps},{t.num_stages}" for g in (1, 4, 5, 8) for t in [plan(g)]]


def _fsa_ints(g: int) -> dict[str, int]:
    """Integer arguments FSA's tile kernels share at 64K (one chunk of every KV head)."""
    return dict(stride_qt=4 * g * D, stride_qh=D, stride_kt=H_KV * D, stride_kh=D, stride_lt=4 * g, r_begin=0,
                r_end=H_KV * CAP, cap=CAP, g=g, d=D)


def _dkdv_const(g: int, bm: int) -> dict:
    """Constexprs of the fused backward's _dkdv_kernel at 64K: head parts and items as fsa plans them."""
    g_hi, g_lo = head_parts(g)
    tok = bwd_tiles(g, D, BS).tok
    return dict(G=g, G_HI=g_hi, G_LO=g_lo, G_LO_P=next_pow2(g_lo), PER_ITEM=tok * split_tiles(tok, N * TOPK * H_KV, BS, D),
                BLOCK_M=bm, BLOCK_N=BS, NUM_KT=1, D=D, FUSED_DQ=True, PREC=PREC)


_FSA_I32 = {n: "*i32" for n in ("row_ptr", "token_ids", "blk_start", "blk_len", "blk_local", "first", "item_row",
                                "item_sub", "max_rest", "slot_first", "v_bad_rows")}

KERNELS = {
    "select": Kernel(
        "fsalab.ops.topk.block_select", "_select_kernel",
        {"lse_ptr": "*fp32", "cu_ptr": "*i32", "cuc_ptr": "*i32", "out_ptr": "*i32"}, ("qk_scale",),
        lambda g: dict(batch=1, steps=search_steps(1), s_qt=4 * g * D, s_qh=D, s_kt=H_KV * D, s_kh=D, s_lt=4 * g,
                       s_lh=1, s_ot=H_KV * TOPK, s_oh=TOPK),
        lambda g, bm: dict(G=g, G_HI=g, G_LO_P=0, HEAD_DIM=D, D_PAD=D, L=32, S=16, BS=BS, TOPK=TOPK, T_P=16, BB=16,
                           INIT=1, LOCAL=2, BLOCK_M=bm, DOT_PREC=PREC),
        ["1,64,4", "1,128,8", "4,64,4", "4,128,8"],  # block_select._SELECT_CONFIGS at g = 1 and 4
        "chunk", lambda g, bm: bm // g),
    "select_gluon": Kernel(
        "fsalab.ops.topk.block_select_gluon", "select_kernel",
        {"lse_ptr": "*fp32", "cu_ptr": "*i32", "cuc_ptr": "*i32", "out_ptr": "*i32"}, ("qk_scale",),
        lambda g: dict(batch=1, steps=search_steps(1), s_qt=4 * g * D, s_qh=D, s_kt=H_KV * D, s_kh=D, s_lt=4 * g,
                       s_lh=1, s_ot=H_KV * TOPK, s_oh=TOPK),
        lambda g, bm: dict(G=g, D=D, L=32, S=16, BS=BS, TOPK=TOPK, T_P=16, LOG=4, BB=16, INIT=1, LOCAL=2, BLOCK_T=bm,
                           PREFETCH=prefetches(bm)),
        ["1,128,4", "2,128,4", "4,64,4", "5,64,4", "8,64,4"],  # G,BLOCK_T,warps as tokens_per_program picks
        "chunk", lambda g, bm: bm, gluon=True),
    "fsa_partial": Kernel(
        "fsalab.ops.selected.fsa_partials", "_partial_kernel",
        {"lse": "*fp32", "delta": "*fp32", "lbuf": "*fp32", **_FSA_I32}, ("qk_scale", "sm_scale"),
        lambda g: {**_fsa_ints(g), "j0": 0, "Gc": g, "n_sub": 1},
        lambda g, bm: dict(HP=1, G=g, TOK=bm // g, BLOCK_M=bm, NUM_MT=4, BLOCK_N=BS, NUM_KT=1, D=D, MODE=2,
                           TABLE=True, EARLY_RETURN=True, PREC=PREC, CONTAIN=False),
        _fsa_configs(lambda g: fwd_tiles(g, D, BS, paper=False)),
        "tile", lambda g, bm: bm // g * g),
    "fsa_dkdv": Kernel(
        "fsalab.ops.selected.fsa_bwd", "_dkdv_kernel",
        {"lse": "*fp32", "delta": "*fp32", "dkp": "*fp32", "dvp": "*fp32", **_FSA_I32}, ("qk_scale", "sm_scale"),
        lambda g: {**_fsa_ints(g), "block_size": BS},
        lambda g, bm: _dkdv_const(g, bm),
        _fsa_configs(lambda g: bwd_tiles(g, D, BS)),
        "tile", lambda g, bm: bm),
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


def sass(kernel: Kernel, module, g: int, block_m: int, warps: int, stages: int, function: str | None = None,
         extra_const: dict | None = None) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of the kernel (or ``function`` of its module, with
    ``extra_const`` added to its constexprs) under one tile config."""
    jit = getattr(module, function or kernel.function)
    while not hasattr(jit, "arg_names") or hasattr(jit, "configs"):  # unwrap the autotuner
        jit = jit.fn
    names = jit.arg_names
    const = {k: v for k, v in {**kernel.const(g, block_m), **(extra_const or {})}.items() if k in names}
    sig = {n: "constexpr" if n in const else "fp32" if n in kernel.floats else kernel.pointers.get(n, "i32")
           for n in names}
    ints = kernel.ints(g)
    for n in names:  # arguments neither integers nor listed pointers: bf16 tensors (q, k, v, dO, outputs)
        if sig[n] == "i32" and n not in ints:
            sig[n] = "*bf16"
    src = launch_source(GluonASTSource if kernel.gluon else ASTSource, jit, sig, const, ints)
    report, text = build_sass(src, warps, None if kernel.gluon else stages)
    if kernel.gluon:  # dynamic shared memory, which ptxas -v does not report
        shared = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).metadata.shared
        report += f"\nshared memory {shared} bytes"
    return report, text


def launch_source(source_cls, jit, sig: dict, const: dict, ints: dict):
    """``source_cls`` (Triton's ASTSource, or Gluon's) of ``jit`` with the integer arguments ``ints``
    specialised as Triton's launcher does: a value of 1 becomes a constant, a multiple of 16 (and
    every pointer) gets the divisibility hint. ``sig``: argument -> type ("constexpr" for ``const``'s)."""
    names, sig, const = jit.arg_names, dict(sig), dict(const)
    hinted = {n for n in names if sig[n].startswith("*")}
    for name, value in ints.items():
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            sig[name], const[name] = "constexpr", spec
        elif spec == "D":
            hinted.add(name)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    return source_cls(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)


def build_sass(src, warps: int, stages: int | None = None) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of a Triton or Gluon source built for sm_90a."""
    options = {"num_warps": warps, **({} if stages is None else {"num_stages": stages})}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        pathlib.Path(ptx_path).write_text(ptx)
        report = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx_path, "-o", cubin], check=True,
                                capture_output=True, text=True).stderr
        return report, subprocess.run([BIN / "cuobjdump", "-sass", cubin], check=True, capture_output=True,
                                      text=True).stdout


def loop_bodies(text: str, k: int = 1) -> list[dict[str, int]]:
    """Opcode counts of the k largest loops (between a backward branch and its target), largest
    first; a loop nested in a larger one is not counted again."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", text)]
    loops = []
    for addr, op in ins:
        target = re.search(r"0x([0-9a-f]+)", op) if "BRA" in op else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            loops.append((sum(lo <= a <= addr for a, _ in ins), lo, addr))
    chosen: list[tuple] = []
    for loop in sorted(loops, reverse=True):
        if len(chosen) < k and not any(c[1] <= loop[1] and loop[2] <= c[2] for c in chosen):
            chosen.append(loop)
    out = []
    for _, lo, hi in chosen:
        counts: dict[str, int] = {}
        for addr, op in ins:
            if lo <= addr <= hi:
                name = re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0]
                counts[name] = counts.get(name, 0) + 1
        out.append(counts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="select")
    ap.add_argument("--source", help="another version of the kernel's module (default: the tree's)")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="replace OLD (must occur once) by NEW in the source before building")
    ap.add_argument("--config", action="append", help="G,BLOCK_M,WARPS[,STAGES] (stages default 2)")
    ap.add_argument("--function", help="another kernel of the module, with the same arguments")
    ap.add_argument("--const", action="append", default=[], metavar="NAME=VALUE", help="an added constexpr (int)")
    ap.add_argument("--rows", type=int, help="tile rows per loop pass (default: the kernel's)")
    ap.add_argument("--loops", type=int, default=1, help="report the K largest loops")
    ap.add_argument("--same-as", metavar="FILE", help="also build FILE's version of the module and say whether "
                    "each config's whole SASS equals it (a refactor that must leave a kernel as it was)")
    args = ap.parse_args(argv)
    extra = {name: int(value) for name, value in (c.split("=", 1) for c in args.const)}
    kernel = KERNELS[args.kernel]
    path = args.source or importlib.util.find_spec(kernel.module).origin
    source = pathlib.Path(path).read_text()
    for old, new in args.replace:
        if source.count(old) != 1:
            raise SystemExit(f"--replace: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    module = load_module(kernel, source)
    other = load_module(kernel, pathlib.Path(args.same_as).read_text()) if args.same_as else None
    for config in args.config or kernel.configs:
        g, block_m, warps, *rest = (int(x) for x in config.split(","))
        stages = rest[0] if rest else 2
        report, text = sass(kernel, module, g, block_m, warps, stages, args.function, extra)
        regs = re.search(r"Used (\d+) registers", report).group(1)
        spills = re.search(r"(\d+) bytes spill stores", report).group(1)
        shared = re.search(r"shared memory \d+ bytes", report)
        if shared:
            print(f"{args.kernel} G={g}: {shared.group(0)}", flush=True)
        rows = args.rows or kernel.rows(g, block_m)
        what = "token" if kernel.unit == "chunk" else "(token, head) row"
        for i, counts in enumerate(loop_bodies(text, args.loops)):
            n = sum(counts.values())
            top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
            name = f"{args.kernel}{':' + args.function if args.function else ''}"
            loop = "loop" if args.loops == 1 else f"loop {i + 1}"
            print(f"{name} G={g} BLOCK_M={block_m} warps={warps} stages={stages}: {regs} registers, {spills} B "
                  f"spilled; {loop} {n} instructions per thread and {kernel.unit} ({n * 32 * warps // rows} per "
                  f"{what}, all threads; {counts.get('LDL', 0)} local reloads): {top}", flush=True)
        if other is not None:
            same = _code(text) == _code(sass(kernel, other, g, block_m, warps, stages, args.function, extra)[1])
            print(f"  whole SASS {'identical to' if same else 'differs from'} {args.same_as}'s", flush=True)
    return 0


def _code(sass_text: str) -> list[str]:
    """The instruction lines of cuobjdump's listing (headers name the temporary file)."""
    return [line for line in sass_text.splitlines() if line.strip().startswith("/*")]


if __name__ == "__main__":
    sys.exit(main())
