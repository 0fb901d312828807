"""Variants of ops/block_select.py as of 916ed66 (../ab-select-unmasked/block_select_916ed66.py)
for splitting the selection kernel's per-chunk cost by static instruction counts
(scripts/sass_loop_count.py --kernel select --source VARIANT; counts.log beside this file).

Counting-only variants (their selections are wrong; they drop one part of the per-chunk work and
keep the rest's data dependences):
  no_merge     the top-T merge (``tl.topk`` + ``tl.bitonic_merge``) replaced by an element-wise max
  sort_only    the merge without its ``tl.bitonic_merge`` (the candidates' sort kept)
  no_gather    the overlap stencil's shift of the spill to the next block (``tl.gather``) dropped
A candidate (selections compared with the tree's):
  mma_stencil  the overlap stencil as one product: block scores = ps [tokens, BB * r] @ W
               [BB * r, BB], W holding each compressed token's weight in its own block and the
               next (the spill), in tf32x3 (fp32-level accuracy; W's small integers are exact); the
               carry into the next chunk is the last block's spill, a weighted row sum. Replaces
               the reshape-sums and the gather. Needs BB >= 16 (the MMA's N): (64, 16) and wider.

    python select_parts.py DIR   writes DIR/_block_select_<variant>.py for each variant

no_gather's count is not a clean split: without the gather the compiler lays the chunk out
differently and the loop grew (counts.log). mma_stencil passed the CPU selection checks but
counted more instructions than the tree and was not timed.
"""
import pathlib
import sys

TREE = pathlib.Path(__file__).resolve().parent.parent / "ab-select-unmasked" / "block_select_916ed66.py"

MERGE = "        run = _merge_topk(run, key, T_P)\n"
GATHER = "tl.gather(spill, prev, axis=1)"
STENCIL = """        p3 = tl.reshape(ps, (BLOCK_T, BB, R))
        own_part = tl.sum(p3 * w_own[None, None, :], axis=2)
        spill = tl.sum(p3 * w_spill[None, None, :], axis=2)
        score = own_part + tl.where(bb[None, :] == 0, carry[:, None], tl.gather(spill, prev, axis=1))
        carry = tl.sum(tl.where(bb[None, :] == BB - 1, spill, 0.0), axis=1)
"""
MMA_STENCIL = """        score = tl.dot(ps, stencil, input_precision="tf32x3") + tl.where(bb[None, :] == 0, carry[:, None], 0.0)
        carry = tl.sum(ps * w_carry[None, :], axis=1)
"""
PROLOGUE = "    run = _empty_run(BLOCK_T, T_P)  # ascending; its last TOPK columns are the top TOPK\n"
MMA_PROLOGUE = PROLOGUE + """    # W [BLOCK_C, BB]: compressed token j = bR + i weighs w_own[i] in block b and w_spill[i] in b + 1
    jc = tl.arange(0, BLOCK_C)
    j_own = tl.minimum(MP, R - jc % R).to(tl.float32)
    j_spill = tl.maximum(jc % R + MP - R, 0).to(tl.float32)
    stencil = (tl.where((jc // R)[:, None] == bb[None, :], j_own[:, None], 0.0)
               + tl.where((jc // R + 1)[:, None] == bb[None, :], j_spill[:, None], 0.0))
    w_carry = tl.where(jc // R == BB - 1, j_spill, 0.0)  # the chunk's last block spills into the next chunk
"""

VARIANTS = {
    "no_merge": [(MERGE, "        run = tl.maximum(run, key)\n")],
    "sort_only": [(MERGE, "        run = tl.maximum(run, tl.topk(key, T_P))\n")],
    "no_gather": [(GATHER, "spill")],
    "mma_stencil": [(STENCIL, MMA_STENCIL), (PROLOGUE, MMA_PROLOGUE)],
}


def variant_source(src: str, name: str) -> str:
    for old, new in VARIANTS[name]:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    return src


def write_variants(out_dir) -> dict:
    """{variant: path} of the variant modules written into out_dir (a package such as fsalab/ops)."""
    src = TREE.read_text()
    paths = {}
    for name in VARIANTS:
        path = pathlib.Path(out_dir) / f"_block_select_{name}.py"
        path.write_text(variant_source(src, name))
        paths[name] = path
    return paths


if __name__ == "__main__":
    print(write_variants(sys.argv[1]))
