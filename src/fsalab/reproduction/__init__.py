"""The paper's claims against our measurements.

- ``metrics``: numbers computed from the result tables (speedups, shares, slowdowns, buffer
  overheads, DRAM ratios, compile times), shared by the notebooks and the documents;
- ``verdicts``: the verdict rules, written once (``Claim``, ``verdict``);
- ``artefacts``: ``claims``, one claim per quantitative statement of every numbered artefact of the paper;
- ``document``: REPRODUCTION.md and README's generated blocks.
"""

from .artefacts import claims
from .document import readme_blocks, render_readme, reproduction_text, update_readme, write_reproduction
from .metrics import (
    BT_KEYS, FULL_IMPLS, SHAPE_KEYS, TP_KEYS, ablation_slowdowns, attention_part_ratios, branch_breakdown,
    buffer_overhead, commits_of, compile_times, convergence_gap_table, convergence_gaps, convergence_task,
    curve_of, dram_ratios, e2e_vs_full, e2e_vs_nsa, full_baseline, full_depth_vs_estimate, impl_ratio, loss_gaps,
    run_label, speedups, stat, tp_prefill,
)
from .verdicts import Claim, paper_gpu, verdict

__all__ = [
    "BT_KEYS", "FULL_IMPLS", "SHAPE_KEYS", "TP_KEYS", "Claim", "ablation_slowdowns", "attention_part_ratios",
    "branch_breakdown", "buffer_overhead", "claims", "commits_of", "compile_times", "convergence_gap_table",
    "convergence_gaps", "convergence_task", "curve_of", "dram_ratios", "e2e_vs_full", "e2e_vs_nsa", "full_baseline",
    "full_depth_vs_estimate", "impl_ratio", "loss_gaps", "paper_gpu", "readme_blocks", "render_readme",
    "reproduction_text", "run_label", "speedups", "stat", "tp_prefill", "update_readme", "verdict", "write_reproduction",
]
