"""The int32-key variant of ops/block_select.py, generated from the tree's module source (so it
tracks the code it is compared with): ranking keys of 32 bits instead of 64.

Key of a block (scores are >= +0): the score's exponent window [2^-24, 2^8) as 5 bits (below: 0;
inf/NaN: the top value) and its mantissa, 28 bits in all, shifted right by KB - 3 and followed by
KB bits of (2^KB - 1 - block), KB = max(3, bit length of the token's own block index), per row at
run time: a token's keys depend on its position only (prefill and decode would tie alike) and
nothing recompiles per length. A score keeps 26 - KB mantissa bits (the last token of 64K with
blocks of 64: 16 bits, <= 1.5e-5 relative); blocks whose scores differ by less than that, or both
lie below 2^-24, tie and go to the lower block.

Measured by ab_select_key32.py on the H200 (ab_key32.log; docs/perf-log.md, "32-bit ranking keys
in the block selection") and landed afterwards as ``_block_key``; the substitutions below match
the module of 570fc02 only. On CPU at that commit: `python select_key32.py OUT.py` writes the
variant, e.g. for `scripts/sass_loop_count.py --source OUT.py`."""
import pathlib
import sys

TREE = pathlib.Path(__file__).resolve().parents[4] / "src" / "fsalab" / "ops" / "block_select.py"


def variant_source(src: str) -> str:
    subs = [
        ("_KEY_NONE = tl.constexpr(-(2**62))", "_KEY_NONE = tl.constexpr(-(2**30))"),
        ("run = (col[None, :] - 2 - T_P).to(tl.int64) + tl.zeros([BLOCK_T, T_P], dtype=tl.int64)",
         "run = (col[None, :] - 2 - T_P).to(tl.int32) + tl.zeros([BLOCK_T, T_P], dtype=tl.int32)"),
        ("key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)",
         "key = _key32(score, blk, kb[:, None])"),
        ("blocks = tl.where(chosen, 0x7FFFFFFF - (run & 0x7FFFFFFF), 0x7FFFFFFF).to(tl.int32)",
         "blocks = tl.where(chosen, ((1 << kb[:, None]) - 1) - (run & ((1 << kb[:, None]) - 1)), 0x7FFFFFFF).to(tl.int32)"),
        ("    own = pos // BS\n",
         "    own = pos // BS\n"
         "    # key bits of the block index: bit_length(own) (from the fp32 exponent), at least 3\n"
         "    kb = tl.maximum((own.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 3)\n"),
    ]
    for old, new in subs:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    helper = '''

@triton.jit
def _key32(score, blk, kb):
    """int32 ranking key of blocks blk with scores >= +0 (see the variant's docstring)."""
    bits = score.to(tl.int32, bitcast=True)
    e = bits >> 23
    v = tl.where(e < 103, 0, ((e - 103) << 23) | (bits & 0x7FFFFF))
    v = tl.where((e >= 255) | (v > 0x0FFFFFFF), 0x0FFFFFFF, v)
    return ((v >> (kb - 3)) << kb) | (((1 << kb) - 1) - blk)

'''
    anchor = "@triton.jit\ndef _merge_topk("
    assert src.count(anchor) == 1
    return src.replace(anchor, helper.lstrip("\n") + "\n" + anchor)


def write_variant(module_path, out_path):
    pathlib.Path(out_path).write_text(variant_source(pathlib.Path(module_path).read_text()))


if __name__ == "__main__":
    write_variant(TREE, sys.argv[1])
