"""Compile the planning kernels (index_kernels, worklist) and the gated sum (ops/gate/fused.py) for a
CUDA target, without a GPU.

The tests run every kernel through the Triton interpreter, which accepts code the compiler may
reject. This script runs the real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the
ptxas bundled in Triton's wheel) for each kernel variant the code launches, including the
variants where integer arguments equal to 1 become constants (the launcher specialises them).

    PYTHONPATH=src python scripts/compile_kernels.py [--arch 90]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fsalab.ops.gate import fused as gate
from fsalab.ops.selected import index_kernels as ik
from fsalab.ops.selected import worklist as wl

P32, P64 = "*i32", "*i64"


def variants():
    """(kernel, pointer types, constexprs, num_warps) of every launch configuration."""
    keys_ptrs = dict.fromkeys(("block_idx", "cu_seqlens", "keys", "block_offsets"), P32)
    csr_ptrs = dict.fromkeys(("sorted_key", "token_ids", "entry_slot", "slot_pos", "row_ptr", "blk_start", "blk_len",
                              "blk_local", "block_offsets", "cu_seqlens"), P32) | {"order": P64}  # fmt: skip
    scan_ptrs = dict.fromkeys(("row_ptr", "first", "second", "blk_local", "max_rest"), P32)
    item_ptrs = dict.fromkeys(("first", "item_row", "item_sub"), P32)
    ones = dict.fromkeys
    for ht, ht_pad, tok in ((64, 64, 16), (15, 16, 64), (1, 1, 1024)):
        yield ik._entry_keys_kernel, keys_ptrs, {"HT": ht, "HT_PAD": ht_pad, "TOK": tok, "BLOCK_B": 1024}, 4
    yield ik._entry_keys_kernel, keys_ptrs, {"HT": 1, "HT_PAD": 1, "TOK": 1024, "BLOCK_B": 1024} | ones(
        ("total", "batch", "batch_steps", "topk", "pad_key"), 1), 4
    yield ik._csr_kernel, csr_ptrs, {"BLOCK_E": 1024, "BLOCK_R": 128}, 4
    csr_ints = ("n_entries", "entry_steps", "per_token", "topk", "total", "cap", "rows", "batch", "batch_steps",
                "pad_key")  # fmt: skip
    yield ik._csr_kernel, csr_ptrs, {"BLOCK_E": 1024, "BLOCK_R": 128} | ones(csr_ints, 1), 4
    yield ik._token_start_kernel, {"cu_seqlens": P32, "tok_start": P32}, {"BLOCK": 1024}, 4
    yield ik._token_start_kernel, {"cu_seqlens": P32, "tok_start": P32}, {"BLOCK": 1024} | ones(
        ("total", "batch", "batch_steps"), 1), 4
    for first, second, rest in ((wl.ITEMS, wl.NONE, False), (wl.ITEMS_MIN_ONE, wl.SPLIT, False),
                                (wl.EXTRA, wl.NONE, False), (wl.NONE, wl.NONE, True)):  # fmt: skip
        yield wl._row_scan_kernel, scan_ptrs, {"FIRST": first, "SECOND": second, "MAX_REST": rest, "BLOCK": 1024}, 8
    yield wl._row_scan_kernel, scan_ptrs, {"FIRST": wl.ITEMS_MIN_ONE, "SECOND": wl.SPLIT, "MAX_REST": True,
                                           "BLOCK": 1024} | ones(("rows", "per_item", "cap"), 1), 8  # fmt: skip
    for sub in (True, False):
        yield wl._items_kernel, item_ptrs, {"WITH_SUB": sub, "BLOCK": 1024}, 4
    yield wl._items_kernel, item_ptrs, {"WITH_SUB": True, "BLOCK": 1024} | ones(("rows", "n_items", "steps"), 1), 4
    # The gated sum as the module launches it (outputs and logits in the model's dtype; fp32 logits
    # beside bf16 outputs), d = 128 and d = 96 (padded), and the one-row call (n_rows = 1).
    for out_t, gate_t in (("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*bf16", "*fp32")):
        for d, extra in ((128, {}), (96, {}), (128, {"n_rows": 1})):
            tiles = {"D": d, "D_PAD": triton.next_power_of_2(d), "BLOCK_R": 4096 // triton.next_power_of_2(d)}
            fwd = dict.fromkeys(("o1_ptr", "o2_ptr", "o3_ptr", "out_ptr"), out_t) | {"g_ptr": gate_t}
            bwd = dict.fromkeys(("do_ptr", "o1_ptr", "o2_ptr", "o3_ptr", "d1_ptr", "d2_ptr", "d3_ptr"), out_t)
            yield gate._gated_sum_fwd, fwd, tiles | extra, 4
            yield gate._gated_sum_bwd, bwd | {"g_ptr": gate_t, "dg_ptr": gate_t}, tiles | extra, 4


def compile_variant(kernel, ptrs: dict, constexprs: dict, num_warps: int, target: GPUTarget):
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else ptrs.get(p, "i32") for p in params}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=target, options={"num_warps": num_warps})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for kernel, ptrs, constexprs, num_warps in variants():
        out = compile_variant(kernel, ptrs, constexprs, num_warps, target)
        shown = {k: getattr(v, "value", v) for k, v in constexprs.items()}
        print(f"ok {kernel.fn.__name__:20s} cubin {len(out.asm['cubin']):6d} B  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
