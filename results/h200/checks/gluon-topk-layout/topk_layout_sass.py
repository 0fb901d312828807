"""Static SASS (sm_90a, built on CPU) of the select kernel's top-T merge in isolation: per row and
merge of 16 candidates into a run of 16 int32 keys, a loop of n_iter merges in three layouts --
Gluon with a row in one thread's registers (the bitonic network of src/fsalab/ops/block_select_gluon.py,
written out as reshape/permute/split/join with min/max: sort the candidates, max with the
reversed run, merge), Triton's tl.topk + tl.bitonic_merge on a blocked (load) layout, and on an
MMA result's layout as in ops/block_select.py. Counts the loop body with
scripts/sass_loop_count.py's helpers; nothing runs. network_check.py checks the same network in
numpy (it sorts and merges).

    python results/h200/checks/gluon-topk-layout/topk_layout_sass.py   (repo root, CPU)
"""
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
for path in (HERE.parents[3] / "src", HERE.parents[3] / "scripts"):
    sys.path.insert(0, str(path))

import sass_loop_count as slc  # noqa: E402  (first: it clears TRITON_INTERPRET before triton loads)
import re  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fsalab.ops.block_select_gluon import _merge_run  # noqa: E402


@gluon.jit
def gl_merge(keys, out, n_iter, ROWS: gl.constexpr, T_P: gl.constexpr, LOG: gl.constexpr, NW: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, T_P], threads_per_warp=[32, 1],
                                            warps_per_cta=[NW, 1], order=[1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, T_P, layout=gl.SliceLayout(0, layout))
    offs = r[:, None] * T_P + c[None, :]
    cand = gl.load(keys + offs)
    run = gl.load(keys + offs + ROWS * T_P)
    for it in range(n_iter):
        run = gl.convert_layout(_merge_run(run, cand ^ it, ROWS, T_P, LOG), layout)
    gl.store(out + offs, run)


@triton.jit
def tri_merge(keys, out, n_iter, ROWS: tl.constexpr, T_P: tl.constexpr, LOG: tl.constexpr, NW: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, T_P)
    offs = r[:, None] * T_P + c[None, :]
    cand = tl.load(keys + offs)
    run = tl.load(keys + offs + ROWS * T_P)
    for it in range(n_iter):
        run = tl.bitonic_merge(tl.maximum(run, tl.topk(cand ^ it, T_P)))
    tl.store(out + offs, run)


@triton.jit
def tri_merge_mma(a_ptr, b_ptr, out, n_iter, ROWS: tl.constexpr, T_P: tl.constexpr, LOG: tl.constexpr,
                  NW: tl.constexpr):
    """Candidates in the layout of an MMA result, as in the select kernel."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, T_P)
    dd = tl.arange(0, 64)
    a = tl.load(a_ptr + r[:, None] * 64 + dd[None, :])
    b = tl.load(b_ptr + dd[:, None] * T_P + c[None, :])
    cand = tl.dot(a, b).to(tl.int32, bitcast=True)
    run = cand + 1
    for it in range(n_iter):
        run = tl.bitonic_merge(tl.maximum(run, tl.topk(cand ^ it, T_P)))
    tl.store(out + r[:, None] * T_P + c[None, :], run)


def count(source_cls, jit, pointers: dict, rows: int, warps: int) -> tuple[str, int, str]:
    const = dict(ROWS=rows, T_P=16, LOG=4, NW=warps)
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in jit.arg_names}
    report, text = slc.build_sass(slc.launch_source(source_cls, jit, sig, const, {}), warps)
    body = slc.loop_bodies(text, 1)[0]
    top = ", ".join(f"{k} {v}" for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:8])
    return re.search(r"Used (\d+) registers", report).group(1), sum(body.values()), top


if __name__ == "__main__":
    keys = {"keys": "*i32", "out": "*i32"}
    for rows, warps in [(128, 4), (64, 2)]:
        regs, n, top = count(GluonASTSource, gl_merge, keys, rows, warps)
        print(f"gluon, a row per thread, {rows} rows / {warps} warps: {regs} regs, {n} loop instructions per "
              f"thread = per row: {top}")
        regs, n, top = count(triton.compiler.ASTSource, tri_merge, keys, rows, warps)
        print(f"triton, blocked load layout, {rows} rows / {warps} warps: {regs} regs, {n} per thread "
              f"({n * warps * 32 / rows:.0f} per row): {top}")
        regs, n, top = count(triton.compiler.ASTSource, tri_merge_mma, {"a_ptr": "*fp16", "b_ptr": "*fp16",
                                                                         "out": "*i32"}, rows, warps)
        print(f"triton, MMA result layout, {rows} rows / {warps} warps: {regs} regs, {n} per thread "
              f"({n * warps * 32 / rows:.0f} per row): {top}")
