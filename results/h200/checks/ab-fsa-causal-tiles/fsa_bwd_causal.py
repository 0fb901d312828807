"""The dK/dV counterpart of partials_causal.py: a variant of ops/selection/fsa_bwd.py generated
from the tree's source (so it tracks the code it is compared with), whose ``_dkdv_subtile``
applies the causal and key-range mask only to the tiles that need it. A CSR row lists the
tokens that selected one KV block in ascending order, so only its first entries — tokens inside
the block, before its last key — can miss part of it; every later tile sees all the block's keys
and needs no mask (a padding row loads q = dO = 0 and adds nothing; its dq partial is not
stored). A partial block (the sequence's last) keeps the mask everywhere. The tile loop is
written twice from the tree's loop body: tiles [0, n_masked) as they are, [n_masked, n_mt)
without the mask.

For the A/B in ab_fsa_causal_tiles.py; not part of the library.
    python fsa_bwd_causal.py OUT.py   # writes the variant module (e.g. for sass_loop_count --source)
"""
import pathlib
import sys

TREE = pathlib.Path(__file__).resolve().parents[4] / "src" / "fsalab" / "ops" / "selection" / "fsa_bwd.py"

# Entries that may miss a key of the block: tokens before its last key (fewer than the block's
# keys, all at the row's start); every entry of a partial block.
N_MASKED = '''    own = tl.arange(0, BLOCK_N * NUM_KT)
    tok0 = tl.load(token_ids + p_row + own, mask=own < row_len, other=2147483647)
    n_own = tl.sum((tok0 < kb + block_size - 1).to(tl.int32), 0)
    n_own = tl.where(kl < block_size, row_len, n_own)
    n_masked = tl.minimum(tl.maximum(tl.cdiv(n_own - c0, TOK), 0), n_mt)
'''
MASK_LINES = ('        live = valid[:, None] & (c < kl)[None, :] & ((kb + c)[None, :] <= tok[:, None])\n',
              '        p = tl.exp2(tl.where(live, s, float("-inf")) - lse2[:, None])\n')
PLAIN_LINE = '        p = tl.exp2(s - lse2[:, None])\n'


def variant_source(src: str) -> str:
    def once(old, new):
        nonlocal src
        assert src.count(old) == 1, old
        src = src.replace(old, new)

    # n_masked next to n_mt, in the subtile's signature and both calls.
    assert src.count("c0, n_mt, split,") == 3
    src = src.replace("c0, n_mt, split,", "c0, n_mt, n_masked, split,")
    once("    kl = tl.load(blk_len + gb)\n\n    if FUSED_DQ:\n", "    kl = tl.load(blk_len + gb)\n" + N_MASKED + "\n    if FUSED_DQ:\n")
    # The tile loop: the tree's body for the masked tiles, the same body without the mask after.
    start = src.index("    for mt in range(n_mt):\n")
    end = src.index("    dk_acc = dk_acc * sm_scale\n", start)
    body = src[start + len("    for mt in range(n_mt):\n"):end]
    assert all(body.count(line) == 1 for line in MASK_LINES)
    plain = body.replace(MASK_LINES[0], "").replace(MASK_LINES[1], PLAIN_LINE)
    loops = "    for mt in range(n_masked):\n" + body + "    for mt in range(n_masked, n_mt):\n" + plain
    return src[:start] + loops + src[end:]


def write_variant(module_path, out_path):
    pathlib.Path(out_path).write_text(variant_source(pathlib.Path(module_path).read_text()))


if __name__ == "__main__":
    write_variant(TREE, sys.argv[1])
