"""Static SASS of block_select's ``_select_kernel`` built for sm_90a on CPU (no GPU): registers,
spill bytes and the instructions of its score loop (the largest loop body: per thread and chunk
of blocks), by opcode, for each tile config. Triton's own ptxas and cuobjdump do the work.

A count, not a timing: it says where the loop's instructions go and how a variant changes them
(``--source`` builds another version of ops/block_select.py, ``--replace`` edits the source
first, e.g. to take a part out and see its share); whether the kernel is issue-bound is for the
device to tell (docs/perf-log.md, Open, the select item).

    python scripts/sass_loop_count.py [--source FILE] [--replace OLD NEW ...] [--config G_HI,BLOCK_M,WARPS ...]

Constexprs are those of 64K tokens at the defaults: d = 128, (64, 16), l = 32, s = 16, bf16.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fsalab.ops._triton import dot_precision  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "lse_ptr": "*fp32", "cu_ptr": "*i32", "cuc_ptr": "*i32",
            "out_ptr": "*i32"}
CONFIGS = ["1,64,4", "1,128,8", "4,64,4", "4,128,8"]  # block_select._SELECT_CONFIGS at g = 1 and 4


def load_module(source: str):
    """ops/block_select.py's text as module fsalab.ops._sass_variant (its relative imports work)."""
    fh = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    fh.write(source)
    fh.close()
    spec = importlib.util.spec_from_file_location("fsalab.ops._sass_variant", fh.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sass(module, g_hi: int, block_m: int, warps: int) -> tuple[str, str]:
    """(ptxas -v report, cuobjdump -sass text) of _select_kernel under one tile config."""
    jit = module._select_kernel
    while not hasattr(jit, "arg_names") or hasattr(jit, "configs"):  # unwrap the autotuner
        jit = jit.fn
    const = dict(G=g_hi, G_HI=g_hi, G_LO_P=0, HEAD_DIM=128, D_PAD=128, L=32, S=16, BS=64, TOPK=16, T_P=16, BB=16,
                 INIT=1, LOCAL=2, BLOCK_M=block_m, DOT_PREC=dot_precision(torch.bfloat16))
    names = jit.arg_names
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS}
    src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in const.items() if k in names},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2}).asm["ptx"]
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
    ap.add_argument("--source", default=str(ROOT / "src/fsalab/ops/block_select.py"))
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="replace OLD (must occur once) by NEW in the source before building")
    ap.add_argument("--config", action="append", help="G_HI,BLOCK_M,WARPS (default: %s)" % " ".join(CONFIGS))
    args = ap.parse_args(argv)
    source = pathlib.Path(args.source).read_text()
    for old, new in args.replace:
        if source.count(old) != 1:
            raise SystemExit(f"--replace: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    module = load_module(source)
    for config in args.config or CONFIGS:
        g_hi, block_m, warps = (int(x) for x in config.split(","))
        report, text = sass(module, g_hi, block_m, warps)
        regs = re.search(r"Used (\d+) registers", report).group(1)
        spills = re.search(r"(\d+) bytes spill stores", report).group(1)
        counts = loop_body(text)
        n = sum(counts.values())
        top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
        per_token = n * 32 * warps // (block_m // g_hi)
        print(f"G_HI={g_hi} BLOCK_M={block_m} warps={warps}: {regs} registers, {spills} B spilled; loop {n} "
              f"instructions per thread and chunk ({per_token} per token, all threads): {top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
