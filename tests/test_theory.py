"""The memory/FLOP model (fsalab.theory) against the FSA paper's printed formulas and claims."""

import pytest

from fsalab import theory

PAPER_BT = [(64, 16), (128, 8)]


def test_theorem_numbers_g4_64_16():
    """§3.5: FSA needs 21.3 % of NSA's memory traffic and 56.2 % of its FLOPs at g=4, (64,16)."""
    r = theory.ratios(theory.Shape(N=65536, h_kv=4, g=4, d=128, block_size=64, topk=16), "paper")
    assert r["memory_ratio"] == pytest.approx(0.213, abs=5e-4)
    assert r["flops_ratio"] == pytest.approx(0.5625, abs=1e-12)


@pytest.mark.parametrize("g", [1, 2, 4, 8])
@pytest.mark.parametrize("bt", PAPER_BT)
def test_paper_closed_forms(g, bt):
    """Per-kernel sums equal the paper's printed totals (Appendix E)."""
    b, t = bt
    s = theory.Shape(N=32768, h_kv=2, g=g, d=96, block_size=b, topk=t)
    d, n, h, hk = s.d, s.N, s.h, s.h_kv
    fsa = theory.fsa_total(s, "paper")
    assert fsa.memory_bytes == d * n * (6 * h + 2 * hk) * (1 + t)
    assert fsa.flops == d * n * b * t * (4 * h + 2 * hk)
    nsa = theory.nsa_selected(s, "paper")
    assert nsa.memory_bytes == 2 * d * hk * n * (b * t + g + 8)
    assert nsa.flops == 32 * d * hk * n * b * t
    # The ratios of PAPER.md §3.6, which do not depend on N, d or h_kv.
    r = theory.ratios(s, "paper")
    assert r["memory_ratio"] == pytest.approx((6 * g + 2) * (1 + t) / (2 * (b * t + g + 8)))
    assert r["flops_ratio"] == pytest.approx((4 * g + 2) / 32)


def test_figure2_data():
    """Figure 2 bars (NSA relative to FSA = 1): memory favours FSA for every g; FLOPs only for g < 8
    (the printed FLOP formulas give 34/32 at g = 8, contradicting the Theorem's wording)."""
    rows = theory.table([65536], [1, 2, 4, 8], [(64, 16)], models=["paper"])
    totals = {(r["impl"], r["g"]): r for r in rows if r["kernel"] in ("selected", "total") and
              (r["impl"] == "nsa") == (r["kernel"] == "selected")}
    for g in (1, 2, 4, 8):
        nsa, fsa = totals[("nsa", g)], totals[("fsa", g)]
        assert nsa["memory_bytes"] / fsa["memory_bytes"] > 1
        assert (nsa["flops"] / fsa["flops"] > 1) == (g < 8)
    assert {r["cost_model"] for r in rows} == {"paper"}


def test_causal_fraction():
    assert theory.causal_fraction(64, 64, 16) == pytest.approx(1 / 16)
    b = 65536 // 64
    expected = (sum(range(1, 17)) + (b - 16) * 16) / (b * 16)
    assert theory.causal_fraction(65536, 64, 16) == pytest.approx(expected)


@pytest.mark.parametrize("g", [1, 2, 4, 5, 8, 16])
def test_consistent_models(g):
    """The causal model keeps the paper's FLOP ratio (the factor cancels); fsalab's FSA does g
    heads per KV load with Triton's 16-row MMA minimum for NSA, so its FLOP ratio is g / max(g, 16)."""
    s = theory.Shape(N=16384, h_kv=4, g=g, block_size=64, topk=16)
    causal = theory.ratios(s, "causal")
    pad8 = max(g, 8)
    assert causal["flops_ratio"] == pytest.approx((4 * g + 2) / (4 * pad8))
    assert causal["memory_ratio"] < 1
    fast = theory.ratios(s, "fsalab")
    assert fast["flops_ratio"] == pytest.approx(g / max(g, 16))
    assert fast["memory_ratio"] < causal["memory_ratio"] * 1.01


def test_buffer_estimate_and_bad_model():
    assert theory.fsa_buffer_bytes(65536, 128, 16) == 2**28  # 0.25 GiB, not the paper's "1 GB"
    with pytest.raises(ValueError, match="model"):
        theory.ratios(theory.Shape(N=1024, h_kv=1, g=1), "bogus")
