"""Memory-access and FLOP model of the selected-attention kernels (FSA paper §3.3, Appendix E).

Three models, one per question:

``paper``
    The formulas exactly as printed in the FSA paper (PAPER.md §3.3–3.4), including their
    inconsistency: NSA's memory term assumes that causality halves the loaded blocks (T/2 per
    query), NSA's FLOP term and every FSA term do not. This is the model behind the Theorem
    (FSA/NSA = 21.3 % memory and 56.2 % FLOPs at g = 4, (B_K, T) = (64, 16)) and Figure 2.
``causal``
    The same kernel structure with one causal factor applied to every term: each query attends
    ``f·T`` valid blocks, ``f`` the expected fraction of its top-T slots that hold a causal
    block (exact for uniformly spread selections; ≈ 0.99 at 64K tokens, not the paper's 1/2).
``fsalab``
    fsalab's faster FSA variant: no statistics pass (partials carry their own max and sum and
    the reduction merges them by log-sum-exp) and each KV-block load serves all g query heads
    of the group, with ``f`` as in ``causal``. NSA is modelled as in ``causal`` with the
    query-head tile padded to Triton's MMA minimum of 16 rather than the paper's 8.

Units: memory in bytes, FLOPs counted as 2 per multiply-add. Symbols follow the paper: N tokens
(one sequence), h query heads, h_kv KV heads, g = h / h_kv, d head dim (d_K = d_V), B block size
B_K, T top-k, b = N / B blocks. Ratios FSA/NSA do not depend on N, d or h_kv in the paper model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MODELS = ("paper", "causal", "fsalab")


@dataclass(frozen=True)
class Shape:
    """One selected-attention problem; sizes in tokens and elements."""

    N: int
    h_kv: int
    g: int
    d: int = 128
    block_size: int = 64
    topk: int = 16
    bytes_per_elem: int = 2

    @property
    def h(self) -> int:
        return self.h_kv * self.g

    @property
    def blocks(self) -> int:
        """b = ceil(N / B)."""
        return -(-self.N // self.block_size)


@dataclass(frozen=True)
class Cost:
    """Memory traffic in bytes and arithmetic in FLOPs of one kernel (or a sum of kernels)."""

    memory_bytes: float
    flops: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.memory_bytes + other.memory_bytes, self.flops + other.flops)


def causal_fraction(N: int, block_size: int, topk: int) -> float:
    """Expected fraction of a query's T selection slots that hold a causal block.

    A query in block i (0-based) can select at most min(i + 1, T) blocks; averaged over the
    b = ceil(N / B) blocks of a sequence (every block holding B queries).
    """
    b = -(-N // block_size)
    return sum(min(i + 1, topk) for i in range(b)) / (b * topk)


def _fraction(s: Shape, model: str) -> float:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    return 1.0 if model == "paper" else causal_fraction(s.N, s.block_size, s.topk)


def nsa_selected(s: Shape, model: str = "paper", mma_min: int | None = None) -> Cost:
    """NSA's query-outer kernel: h_kv·N programs, each loads its token's (padded) query heads,
    the selected K/V blocks, and stores g·d outputs.

    paper (printed): memory = 2·d·h_kv·N·(B·T + g + 8) bytes, FLOPs = 32·d·h_kv·N·B·T; the
    memory term counts T/2 loaded blocks (2·B·d elements each), the FLOP term all T.
    causal/fsalab: f·T blocks in both terms; query heads padded to max(g, mma_min) with
    mma_min = 8 (paper's PTX minimum) for ``causal`` and 16 (Triton's) for ``fsalab``.
    """
    if model == "paper":
        e = s.bytes_per_elem
        memory = e * s.d * s.h_kv * s.N * (s.block_size * s.topk + s.g + 8)
        flops = 32 * s.d * s.h_kv * s.N * s.block_size * s.topk
        return Cost(memory, flops)
    f = _fraction(s, model)
    pad = max(s.g, mma_min if mma_min is not None else (16 if model == "fsalab" else 8))
    blocks = f * s.topk
    elems = s.h_kv * s.N * (blocks * 2 * s.block_size * s.d + pad * s.d + s.g * s.d)
    flops = 4 * pad * s.d * s.h_kv * s.N * s.block_size * blocks
    return Cost(elems * s.bytes_per_elem, flops)


def fsa_selected(s: Shape, model: str = "paper") -> Cost:
    """FSA main kernel: h·b programs, each loads one K/V block (2·B·d) and, per attending query,
    gathers its q (d) and stores a partial output (d). Memory = 4·d·h·N·(1 + f·T), FLOPs =
    4·d·h·N·B·f·T (f = 1 in the paper model)."""
    f = _fraction(s, model)
    e = s.bytes_per_elem
    return Cost(2 * e * s.d * s.h * s.N * (1 + f * s.topk), 4 * s.d * s.h * s.N * s.block_size * f * s.topk)


def fsa_softmax(s: Shape, model: str = "paper") -> Cost:
    """FSA statistics kernel, once per KV head, no V: memory = 2·d·h_kv·N·(1 + f·T),
    FLOPs = 2·d·h_kv·N·B·f·T."""
    f = _fraction(s, model)
    e = s.bytes_per_elem
    return Cost(e * s.d * s.h_kv * s.N * (1 + f * s.topk), 2 * s.d * s.h_kv * s.N * s.block_size * f * s.topk)


def fsa_reduction(s: Shape, model: str = "paper") -> Cost:
    """FSA reduction: per query head and token, load f·T partials and store one output:
    memory = 2·d·h·N·(1 + f·T), FLOPs negligible (counted as 0, as in the paper)."""
    f = _fraction(s, model)
    return Cost(s.bytes_per_elem * s.d * s.h * s.N * (1 + f * s.topk), 0.0)


def fsa_paper_total(s: Shape, model: str = "paper") -> Cost:
    """Selected + statistics + reduction. Paper: memory = d·N·(6h + 2h_kv)·(1 + T),
    FLOPs = d·N·B·T·(4h + 2h_kv)."""
    return fsa_selected(s, model) + fsa_softmax(s, model) + fsa_reduction(s, model)


def fsalab_fsa_total(s: Shape, stats_bytes: int = 8) -> Cost:
    """fsalab's faster FSA: one main kernel per (KV head, block) serving all g query heads, then a
    log-sum-exp reduction; no statistics pass.

    Main: K/V once per KV head (2·d·h_kv·N elements), per visit q in (d) and partial out (d) per
    query head, plus ``stats_bytes`` per partial (fp32 max and sum). Reduction: reads every
    partial with its stats, writes o (d) and lse (4 bytes) per head and token.
    """
    f = _fraction(s, "fsalab")
    e = s.bytes_per_elem
    visits = s.h * s.N * f * s.topk
    main = Cost(
        e * 2 * s.d * s.h_kv * s.N + visits * (2 * s.d * e + stats_bytes),
        4 * s.d * s.h * s.N * s.block_size * f * s.topk,
    )
    reduction = Cost(visits * (s.d * e + stats_bytes) + s.h * s.N * (s.d * e + 4), 0.0)
    return main + reduction


def fsa_total(s: Shape, model: str = "paper") -> Cost:
    """FSA cost under ``model``: the paper's three kernels, or fsalab's variant for ``fsalab``."""
    return fsalab_fsa_total(s) if model == "fsalab" else fsa_paper_total(s, model)


def ratios(s: Shape, model: str = "paper") -> dict[str, float]:
    """FSA / NSA memory and FLOP ratios (the Theorem's 21.3 % and 56.2 % at g=4, (64,16))."""
    fsa, nsa = fsa_total(s, model), nsa_selected(s, model)
    return {"memory_ratio": fsa.memory_bytes / nsa.memory_bytes, "flops_ratio": fsa.flops / nsa.flops}


def kernel_costs(s: Shape, model: str = "paper") -> dict[str, Cost]:
    """Per-kernel breakdown: {"impl/kernel": Cost} for NSA and FSA under ``model``."""
    out = {"nsa/selected": nsa_selected(s, model)}
    if model == "fsalab":
        out["fsa/total"] = fsalab_fsa_total(s)
    else:
        out.update(
            {
                "fsa/selected": fsa_selected(s, model),
                "fsa/softmax": fsa_softmax(s, model),
                "fsa/reduction": fsa_reduction(s, model),
                "fsa/total": fsa_paper_total(s, model),
            }
        )
    return out


def table(
    N: list[int], g: list[int], block_topk: list[tuple[int, int]], h_kv: int = 4, d: int = 128, models=MODELS
) -> list[dict]:
    """Tidy rows (one per model, shape and kernel) with memory_bytes, flops and the FSA/NSA
    ratios of the shape; Figure 2 is the ``paper`` rows at N = 64K, (64, 16)."""
    rows = []
    for model in models:
        for n in N:
            for gg in g:
                for bs, tk in block_topk:
                    s = Shape(N=n, h_kv=h_kv, g=gg, d=d, block_size=bs, topk=tk)
                    r = ratios(s, model)
                    for name, cost in kernel_costs(s, model).items():
                        impl, kernel = name.split("/")
                        rows.append(
                            {
                                "cost_model": model,
                                "impl": impl,
                                "kernel": kernel,
                                **{k: v for k, v in asdict(s).items() if k != "bytes_per_elem"},
                                "h": s.h,
                                "memory_bytes": cost.memory_bytes,
                                "flops": cost.flops,
                                **r,
                            }
                        )
    return rows


def fsa_buffer_bytes(N: int, d: int, topk: int, bytes_per_elem: int = 2, heads: int = 1) -> float:
    """The paper's output-buffer estimate (Appendix E): d·N·T elements per query head processed
    at a time. At N = 64K, T = 16, d = 128, 2 bytes this is 0.25 GiB, not the "1 GB" printed."""
    return float(d * N * topk * bytes_per_elem * heads)

