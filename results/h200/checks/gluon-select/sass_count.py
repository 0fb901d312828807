"""Static SASS (sm_90a, built on CPU; nothing runs) of select_gluon.select_kernel_gl at 64K's
constexprs ((64, 16) and (128, 8)) and a one-sequence launch's integer arguments: registers and
the instructions of its loops per thread and chunk (128 tokens over 128 threads, so also per token); compare with
`scripts/sass_loop_count.py --kernel select --loops 2` for the Triton kernel (per token: twice
its per-thread count at g = 1, 64 tokens over 128 threads).

    python results/h200/checks/gluon-select/sass_count.py   (repo root)
"""
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
for path in (HERE.parents[3] / "src", HERE, HERE.parents[3] / "scripts"):
    sys.path.insert(0, str(path))

import sass_loop_count as slc  # noqa: E402  (first: it clears TRITON_INTERPRET before triton loads)
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import select_gluon  # noqa: E402

D = 128
ints = dict(batch=1, s_qt=4 * D, s_qh=D, s_kt=4 * D, s_kh=D, s_lt=4, s_lh=1)
pointers = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "lse_ptr": "*fp32", "cu_ptr": "*i32", "cuc_ptr": "*i32",
            "out_ptr": "*i32"}
jit = select_gluon.select_kernel_gl
for bs, topk in ((64, 16), (128, 8)):
    log = topk.bit_length() - 1
    const = dict(G=1, D=D, L=32, S=16, BS=bs, TOPK=topk, T_P=topk, LOG=log, BB=topk, INIT=1, LOCAL=2, BLOCK_T=128)
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in jit.arg_names}
    report, text = slc.build_sass(slc.launch_source(GluonASTSource, jit, sig, const,
                                                    {**ints, "s_ot": 4 * topk, "s_oh": topk}), 4)
    print(f"({bs}, {topk}):", re.findall(r"Used \d+ registers.*", report))
    for i, body in enumerate(slc.loop_bodies(text, 2)):
        top = ", ".join(f"{k} {v}" for k, v in sorted(body.items(), key=lambda kv: -kv[1])[:14])
        print(f"  loop {i + 1}: {sum(body.values())} per thread and chunk = per token (128 tokens / 128 threads): {top}")
