"""The forward-partial counterpart of fsa_bwd_causal.py, generated from the tree's
ops/selection/fsa_partials.py (so it tracks the code it is compared with): ``_partial_tiles``
walks the program's tiles as two ranges, the row's first tiles (tokens inside the block, before
its last key; every tile of a partial block) with the causal / key-range mask, the rest without
(all keys visible; a padding row computes on zeros and is not stored). The containment pass
(CONTAIN) keeps the mask everywhere. The two ranges each load the block's K/V (a second 32 KB
per program at d = 128, (64, ·)).

For the A/B in ab_fsa_causal_tiles.py; not part of the library.
    python partials_causal.py OUT.py   # writes the variant module (e.g. for sass_loop_count --source)
"""
import pathlib
import sys

TREE = pathlib.Path(__file__).resolve().parents[4] / "src" / "fsalab" / "ops" / "selection" / "fsa_partials.py"

WRAPPER = '''

@triton.jit
def _partial_tiles(
    q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, n_mt, base, kb, kl, hk, jp,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d, qk_scale, sm_scale,
    G: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr,
    D: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, CONTAIN: tl.constexpr,
):
    """Tiles [0, n_masked) of the program with the mask, [n_masked, n_mt) without."""
    own = tl.arange(0, BLOCK_N * NUM_KT)
    tok0 = tl.load(token_ids + p_row + own, mask=own < row_len, other=2147483647)
    n_own = tl.sum((tok0 < kb + BLOCK_N * NUM_KT - 1).to(tl.int32), 0)
    n_own = tl.where(kl < BLOCK_N * NUM_KT, row_len, n_own)
    n_masked = tl.minimum(tl.maximum(tl.cdiv(n_own - c0, TOK), 0), n_mt)
    _partial_tiles_range(q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, 0, n_masked, base, kb,
                         kl, hk, jp, stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d, qk_scale,
                         sm_scale, G, TOK, BLOCK_M, BLOCK_N, NUM_KT, D, MODE, PREC, CONTAIN, True)
    _partial_tiles_range(q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, n_masked, n_mt, base,
                         kb, kl, hk, jp, stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d,
                         qk_scale, sm_scale, G, TOK, BLOCK_M, BLOCK_N, NUM_KT, D, MODE, PREC, CONTAIN, CONTAIN)
'''


def variant_source(src: str) -> str:
    subs = [
        ("def _partial_tiles(\n    q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, n_mt, base,",
         "def _partial_tiles_range(\n    q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, mt_lo, n_mt, base,"),
        ("    D: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, CONTAIN: tl.constexpr,\n):\n    \"\"\"The n_mt tiles",
         "    D: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, CONTAIN: tl.constexpr, MASK: tl.constexpr,\n):\n    \"\"\"The n_mt tiles"),
        ("    for mt in range(n_mt):\n        valid, pos, tok, qp, qmask, lp = _gather_rows(",
         "    for mt in range(mt_lo, n_mt):\n        valid, pos, tok, qp, qmask, lp = _gather_rows("),
        ("            s = tl.where(live, s, float(\"-inf\"))\n",
         "            if MASK:\n                s = tl.where(live, s, float(\"-inf\"))\n"),
    ]
    for old, new in subs:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    anchor = "\n\n@triton.jit\ndef _merge_kernel("
    assert src.count(anchor) == 1
    return src.replace(anchor, WRAPPER + anchor)


def write_variant(module_path, out_path):
    pathlib.Path(out_path).write_text(variant_source(pathlib.Path(module_path).read_text()))


if __name__ == "__main__":
    write_variant(TREE, sys.argv[1])
