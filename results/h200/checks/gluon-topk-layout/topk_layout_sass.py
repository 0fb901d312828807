"""Static SASS (sm_90a, built on CPU) of the select kernel's top-T merge in isolation: per row and
merge of 16 candidates into a run of 16 int32 keys, a loop of n_iter merges in three layouts --
Gluon with a row in one thread's registers (the bitonic network written out as
reshape/permute/split/join with min/max: sort the candidates, max with the reversed run, merge),
Triton's tl.topk + tl.bitonic_merge on a blocked (load) layout, and on an MMA result's layout as
in ops/block_select.py. Counts the loop body with scripts/sass_loop_count.py's helpers; nothing
runs. network_check.py checks the same network in numpy (it sorts and merges).

    python results/h200/checks/gluon-topk-layout/topk_layout_sass.py   (repo root, CPU)
"""
import os, sys, tempfile, subprocess, pathlib, re
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.compiler import GPUTarget


@gluon.jit
def _swap_bits(x, s: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    y = gl.permute(gl.reshape(x, [ROWS, N // (2 * s), 2, s]), [0, 1, 3, 2])
    a, b = gl.split(y)
    return gl.reshape(gl.permute(gl.join(b, a), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _cx(x, j: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    y = gl.permute(gl.reshape(x, [ROWS, N // (2 * j), 2, j]), [0, 1, 3, 2])
    a, b = gl.split(y)
    return gl.reshape(gl.permute(gl.join(gl.minimum(a, b), gl.maximum(a, b)), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _flip_upper(x, s: gl.constexpr, k: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    y = gl.permute(gl.reshape(x, [ROWS, N // k, 2, k // 2]), [0, 1, 3, 2])
    lo, up = gl.split(y)
    up = gl.reshape(_swap_bits(gl.reshape(up, [ROWS, N // 2]), s, ROWS, N // 2), [ROWS, N // k, k // 2])
    up = gl.convert_layout(up, lo.type.layout)
    return gl.reshape(gl.permute(gl.join(lo, up), [0, 1, 3, 2]), [ROWS, N])


@gluon.jit
def _flip_cx(x, LK: gl.constexpr, ROWS: gl.constexpr, N: gl.constexpr):
    """Compare-exchange of i and k - 1 - i in blocks of k = 2^LK."""
    k: gl.constexpr = 1 << LK
    for l in gl.static_range(LK - 1):
        x = _flip_upper(x, 1 << l, k, ROWS, N)
    x = _cx(x, k // 2, ROWS, N)
    for l in gl.static_range(LK - 1):
        x = _flip_upper(x, 1 << l, k, ROWS, N)
    return x


@gluon.jit
def _sort_asc(x, ROWS: gl.constexpr, N: gl.constexpr, LOG: gl.constexpr):
    for lk in gl.static_range(1, LOG + 1):
        x = _flip_cx(x, lk, ROWS, N)
        for i in gl.static_range(lk - 1):
            x = _cx(x, 1 << (lk - 2 - i), ROWS, N)
    return x


@gluon.jit
def _rev(x, ROWS: gl.constexpr, N: gl.constexpr, LOG: gl.constexpr):
    for l in gl.static_range(LOG):
        x = _swap_bits(x, 1 << l, ROWS, N)
    return x


@gluon.jit
def gl_merge(keys, out, n_iter, ROWS: gl.constexpr, T_P: gl.constexpr, LOG: gl.constexpr, NW: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, T_P], threads_per_warp=[32, 1], warps_per_cta=[NW, 1], order=[1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, T_P, layout=gl.SliceLayout(0, layout))
    offs = r[:, None] * T_P + c[None, :]
    cand = gl.load(keys + offs)
    run = gl.load(keys + offs + ROWS * T_P)
    for it in range(n_iter):
        srt = _sort_asc(cand ^ it, ROWS, T_P, LOG)
        m = gl.maximum(run, _rev(srt, ROWS, T_P, LOG))
        for i in gl.static_range(LOG):
            m = _cx(m, (T_P // 2) >> i, ROWS, T_P)
        run = m
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
def tri_merge_mma(a_ptr, b_ptr, out, n_iter, ROWS: tl.constexpr, T_P: tl.constexpr, LOG: tl.constexpr, NW: tl.constexpr):
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


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4] / "scripts"))
import sass_loop_count as slc

def count(src, warps):
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        p, cub = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        pathlib.Path(p).write_text(ptx)
        rep = subprocess.run([slc.BIN / "ptxas", "-arch=sm_90a", "-v", p, "-o", cub], check=True, capture_output=True, text=True).stderr
        text = subprocess.run([slc.BIN / "cuobjdump", "-sass", cub], check=True, capture_output=True, text=True).stdout
    body = slc.loop_bodies(text, 1)[0]
    regs = re.search(r"Used (\d+) registers", rep).group(1)
    return regs, sum(body.values()), ", ".join(f"{k} {v}" for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:8])

if __name__ == "__main__":
    for rows, warps in [(128, 4), (64, 2)]:
        c = {(4,): rows, (5,): 16, (6,): 4, (7,): warps}
        sig = {"keys": "*i32", "out": "*i32", "n_iter": "i32", "ROWS": "constexpr", "T_P": "constexpr", "LOG": "constexpr", "NW": "constexpr"}
        cg = {(3,): rows, (4,): 16, (5,): 4, (6,): warps}
        regs, n, top = count(GluonASTSource(fn=gl_merge, signature=sig, constexprs=cg), warps)
        print(f"gluon, a row per thread, {rows} rows / {warps} warps: {regs} regs, {n} loop instructions per thread = per row: {top}")
        regs, n, top = count(triton.compiler.ASTSource(fn=tri_merge, signature=sig, constexprs=cg), warps)
        print(f"triton, blocked load layout, {rows} rows / {warps} warps: {regs} regs, {n} per thread ({n * warps * 32 / rows:.0f} per row): {top}")
        sig2 = {"a_ptr": "*fp16", "b_ptr": "*fp16", "out": "*i32", "n_iter": "i32", "ROWS": "constexpr", "T_P": "constexpr", "LOG": "constexpr", "NW": "constexpr"}
        regs, n, top = count(triton.compiler.ASTSource(fn=tri_merge_mma, signature=sig2, constexprs=c), warps)
        print(f"triton, MMA result layout, {rows} rows / {warps} warps: {regs} regs, {n} per thread ({n * warps * 32 / rows:.0f} per row): {top}")
