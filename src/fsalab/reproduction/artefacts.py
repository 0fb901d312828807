"""Every numbered artefact of the paper as claims (``verdicts.Claim``): REPRODUCTION.md's table.

``claims(platform)`` walks the paper in order (abstract, Theorem, Figures 2-11, Tables 2-15)
and gives each quantitative statement a row: the paper's number (the H200 one where the paper
gives one per GPU; the text's all-GPU number, labelled so, where it does not), ours from
``results/<platform>/``, and the ``git_commit`` fields of the rows behind ours. What cannot be
measured here is a row too, with the reason. Experiments not yet run (their CSV missing or
empty) give "not attempted" rows that turn into measured ones once the runner's rows exist:
``compile`` (Table 11), ``decode`` (Table 10) and ``inference`` (Tables 8-9), whose rows
carry ``impl`` (fsa, nsa, a full-attention impl or ``flash_decoding``), ``N`` and
``median_ms`` (decode: one generated token; inference: the whole request).
"""

from __future__ import annotations

import functools
import re
import statistics
from dataclasses import replace

import pandas as pd

from .. import results, theory
from ..bench.decode_points import FULL_IMPLS
from . import metrics as m
from .verdicts import Claim, paper_gpu

NO_H20 = "needs an H20 GPU; only H200s here"
NO_4_8_GPUS = "needs 4 or 8 GPUs of one host; at most 2 here"
NO_CHECKPOINTS = "needs pretrained Llama-3 checkpoints and the LongBench datasets; none here"
NO_DECODE = "no measured rows"
NO_DECODE_LOOP_ORDER = ("one decode kernel: with one query token per sequence the FSA / NSA loop orders coincide, "
                        "so there is no NSA decode to compare")
DECODE_BASELINES = (*FULL_IMPLS["decode_step"], "flash_decoding")


def not_run(experiment: str) -> str:
    return f"`{experiment}` not run on this platform yet"


class Tables:
    """The result tables of one platform (and its multi-GPU hosts), each read once."""

    def __init__(self, platform: str, results_dir=None):
        self.platform, self.results_dir = platform, results_dir

    @functools.cache
    def __call__(self, experiment: str) -> pd.DataFrame:
        return results.load_table(self.platform, experiment, self.results_dir)

    @functools.cache
    def multi(self, experiment: str) -> pd.DataFrame:
        return results.multi_gpu_table(self.platform, experiment, self.results_dir)


def _stat_pair(artefact: str, claim: str, ref: dict, series: pd.Series, kind: str,
               beyond: dict[str, pd.Series] | None = None, **kw) -> list[Claim]:
    """Two claims (max, mean) of one measured series against the paper's {max, mean}; ``beyond``
    names series of what fsalab adds, whose max / mean stand beside the verdict's."""
    st = m.stat(series)
    extra = {name: m.stat(s) for name, s in (beyond or {}).items()}
    if not st["n"] and not kw.get("reason") and kw.get("impls"):
        kw = {**kw, "reason": f"no rows of {' / '.join(kw['impls'])} measured at one commit"}
    return [Claim(artefact, f"{claim}, {what}", ref[what], st[what], kind, points=st["n"] or None,
                  beyond=tuple((name, e[what]) for name, e in extra.items()), **kw)
            for what in ("max", "mean")]


def _pct_speedups(cells: dict, which: int) -> list[float]:
    """Speedups 1 + x/100 from decoded "+x %" labels (``e2e_h200`` layout), column ``which``
    (0: NSA, 1: full attention)."""
    return [1 + pair[which] / 100 for by_bt in cells.values() for pairs in by_bt.values() for pair in pairs]


def _max_mean(values: list[float]) -> dict:
    return {"max": max(values), "mean": statistics.fmean(values)}


PAPER_IMPLS = (m.PAPER_FSA, "nsa", *m.PAPER_FULL)


def _rows_kw(t: Tables, rows: pd.DataFrame, *experiments: str, **extra) -> dict:
    """The Claim fields naming where ours comes from: platform, the rows' commits, experiments;
    the reason "not run" where the first experiment has no rows on this platform at all."""
    extra.setdefault("reason", "" if len(t(experiments[0])) else not_run(experiments[0]))
    return dict(platform=t.platform, commits=m.commits_of(rows), experiments=experiments, **extra)


def _beyond_nsa(rows: pd.DataFrame, op: str, at=None) -> dict[str, pd.Series]:
    """fsalab's FSA variant and ``auto`` against NSA, on the verdict's rows."""
    out = {}
    for impl in m.BEYOND_FSA:
        sp = m.speedups(rows, op=op, fsa=impl)
        out[f"{impl} vs NSA"] = (at(sp) if at else sp)["vs_nsa"]
    return out


def _beyond_full(rows: pd.DataFrame, op: str, at=None) -> dict[str, pd.Series]:
    """The paper's FSA against the stronger full-attention baselines, and ``auto`` against cuDNN."""
    out = {}
    for name, fsa, full in ((f"vs {m.BEYOND_FULL[0]}", m.PAPER_FSA, m.BEYOND_FULL[:1]),
                            (f"vs {m.BEYOND_FULL[1]}", m.PAPER_FSA, m.BEYOND_FULL[1:]),
                            (f"auto vs {m.BEYOND_FULL[1]}", "auto", m.BEYOND_FULL[1:])):
        sp = m.speedups(rows, op=op, fsa=fsa, full=full)
        out[name] = (at(sp) if at else sp)["vs_full"]
    return out


def abstract_and_kernel(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Abstract and §4.2 (Figure 4): whole NSA attention (compression, selection, selected and
    window attention) of the paper's FSA kernel against NSA's and against the paper's
    full-attention baseline, per direction, over the kernel grid's rows of one commit."""
    kern = t("kernel")
    kern = kern[kern["op"].isin(["nsa_attention", "full_attention"])] if "op" in kern else kern
    rows = m.one_commit(kern, PAPER_IMPLS)
    sp = m.speedups(rows)
    kw = _rows_kw(t, rows, "kernel", paper_gpu=gpu.upper(), impls=PAPER_IMPLS)
    out = []
    for direction, name in (("fwd+bwd", "forward and backward"), ("fwd", "forward")):
        at = sp[sp["direction"] == direction]

        def pick(frame, direction=direction):
            return frame[frame["direction"] == direction]

        if direction == "fwd+bwd":
            out += [replace(c, counted=False) for c in _stat_pair(
                "Abstract", f"kernel FSA vs NSA, {name} (text: up to {pv['headline']['kernel']['max']}×, mean "
                f"{pv['headline']['kernel']['mean']}× over H20 and H200; {gpu.upper()} values of §4.2; the same "
                "measurement as Figure 4's, counted there)", pv["kernel"]["vs_nsa"][gpu], at["vs_nsa"], "higher",
                _beyond_nsa(rows, "nsa_attention", pick), **kw)]
        out += _stat_pair("Figure 4 (§4.2)", f"FSA vs NSA, {name}", pv["kernel"]["vs_nsa"][gpu], at["vs_nsa"],
                          "higher", _beyond_nsa(rows, "nsa_attention", pick), **kw)
        out += _stat_pair("Figure 4 (§4.2)", f"FSA vs full attention (Triton FlashAttention-2), {name}",
                          pv["kernel"]["vs_full"][gpu], at["vs_full"], "higher",
                          _beyond_full(rows, "nsa_attention", pick), **kw)
    # §4.2: "at 32K with g = 1, NSA consistently falls short of full attention, while FSA" beats it.
    at = sp[(sp["N"] == 32768) & (sp["g"] == 1)].dropna(subset=["vs_full", "vs_nsa"])
    reason = "" if len(at) else f"no {' / '.join(PAPER_IMPLS)} rows at 32K, g = 1 of one commit"
    out.append(Claim("Figure 4 (§4.2)", "FSA faster than full attention at 32K, g = 1: smallest full/FSA latency",
                     1.0, at["vs_full"].min() if len(at) else None, "at_least", points=len(at) or None,
                     **{**kw, "reason": kw["reason"] or reason}))
    out.append(Claim("Figure 4 (§4.2)", "NSA slower than full attention at 32K, g = 1: largest full/NSA latency",
                     1.0, (at["vs_full"] / at["vs_nsa"]).max() if len(at) else None, "at_most",
                     points=len(at) or None, **{**kw, "reason": kw["reason"] or reason}))
    out.append(Claim("Figure 4 (§4.2)", "H20 panels", pv["kernel"]["vs_nsa"]["h20"]["mean"], None, "higher",
                     paper_gpu="H20", reason=NO_H20))
    return out


def theorem(t: Tables, pv: dict) -> list[Claim]:
    """The Theorem (§3.3, §3.5) from the formulas, and its premise in measured DRAM bytes."""
    r = theory.ratios(theory.Shape(N=65536, h_kv=4, g=4, block_size=64, topk=16), "paper")
    kw = dict(paper_gpu="formula", platform="formula")
    out = [Claim("Theorem (§3.5)", "FSA/NSA memory at g = 4, (64, 16), 64K (formulas)",
                 pv["theorem"]["memory_ratio"], r["memory_ratio"], "magnitude", **kw),
           Claim("Theorem (§3.5)", "FSA/NSA FLOPs at g = 4, (64, 16), 64K (formulas)",
                 pv["theorem"]["flops_ratio"], r["flops_ratio"], "magnitude", **kw)]
    worst = max(theory.ratios(theory.Shape(65536, 4, g), "paper")["flops_ratio"] for g in (1, 2, 4, 8))
    out.append(Claim("Theorem (§3.3)", "FSA FLOPs below NSA's for g ∈ {1, 2, 4, 8}: largest FSA/NSA of the formulas",
                     1.0, worst, "at_most", **kw))
    dram = m.one_commit(t("dram"), (m.PAPER_FSA, "nsa"))
    ratios = m.dram_ratios(dram)
    fwd = ratios[(ratios["direction"] == "fwd") & (ratios["block_size"] == 64) & (ratios["topk"] == 16)]
    kw = _rows_kw(t, dram, "dram", paper_gpu="formula", impls=(m.PAPER_FSA, "nsa"))
    reason = kw.pop("reason") or ("" if len(fwd) else f"no {m.PAPER_FSA} / nsa forward rows of one commit")
    out.append(Claim("Theorem (§3.3), measured", "FSA memory below NSA's: largest measured DRAM bytes FSA (paper "
                     "variant) / NSA, forward, (64, 16), 64K", 1.0, fwd["bytes_ratio"].max() if len(fwd) else None,
                     "at_most", points=len(fwd) or None, reason=reason, **kw))
    at4 = fwd[fwd["g"] == 4]["bytes_ratio"]
    out.append(Claim("Theorem (§3.5), measured", "DRAM bytes FSA (paper variant) / NSA at g = 4, (64, 16), 64K",
                     pv["theorem"]["memory_ratio"], float(at4.iloc[0]) if len(at4) else None, "lower",
                     reason=reason or ("" if len(at4) else "point g = 4 of `dram` not measured"), **kw))
    return out


def figure2(t: Tables) -> list[Claim]:
    """Figure 2's memory bars (formulas, (64, 16), 64K) beside the measured DRAM bytes per g."""
    dram = m.one_commit(t("dram"), (m.PAPER_FSA, "nsa"))
    ratios = m.dram_ratios(dram)
    out = []
    for g in (1, 2, 4, 8):
        model = theory.ratios(theory.Shape(65536, 4, g), "paper")["memory_ratio"]
        at = ratios[(ratios["direction"] == "fwd") & (ratios["g"] == g) & (ratios["block_size"] == 64)
                    & (ratios["topk"] == 16)]["bytes_ratio"]
        out.append(Claim("Figure 2", f"FSA/NSA memory at g = {g}: formula bar vs measured DRAM bytes (FSA paper "
                         "variant, forward)", model, float(at.iloc[0]) if len(at) else None, "lower",
                         **_rows_kw(t, dram, "dram", paper_gpu="formula", impls=(m.PAPER_FSA, "nsa"),
                                    reason="" if len(at) else f"point g = {g} of `dram` not measured")))
    return out


def figure3(t: Tables) -> list[Claim]:
    """Figure 3 / §3.3: the paper's FSA selected attention faster than NSA's for g < 8 (64K,
    (64, 16)), fwd and bwd, from the rows of one commit."""
    kern = t("kernel")
    kern = kern[kern["op"] == "selected"] if "op" in kern else kern
    rows = m.one_commit(kern, (m.PAPER_FSA, "nsa"))

    def at(sp):
        return sp[(sp["N"] == 65536) & (sp["block_size"] == 64) & (sp["topk"] == 16) & (sp["g"] < 8)].dropna(
            subset=["vs_nsa"])

    sel = at(m.speedups(rows, op="selected"))["vs_nsa"]
    beyond = {name: s.min() if len(s) else None for name, s in _beyond_nsa(rows, "selected", at).items()}
    return [Claim("Figure 3 (§3.3)", "FSA's selected attention faster than NSA's for g < 8 at 64K, (64, 16): "
                  "smallest NSA/FSA latency over g and direction", 1.0, sel.min() if len(sel) else None, "at_least",
                  points=len(sel) or None, beyond=tuple(beyond.items()),
                  **_rows_kw(t, rows, "kernel", impls=(m.PAPER_FSA, "nsa"),
                             reason="" if len(sel) else f"no {m.PAPER_FSA} / nsa rows of one commit"))]


E2E_IMPLS = (m.PAPER_FSA, "nsa", *m.E2E_PAPER_FULL)


def end_to_end(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Abstract, §4.3, Figures 5 and 6: training step and prefill, the paper's FSA against NSA and
    FlashAttention-2 (SDPA's flash backend) from one commit's rows; the paper's H200 numbers are
    the decoded panel labels (PAPER.md §5.5)."""
    out = []
    for key, exp, fig in (("training", "train", "Figure 5 (§4.3)"), ("prefill", "prefill", "Figure 6 (§4.3)")):
        rows = m.one_commit(t(exp), E2E_IMPLS)
        kw = _rows_kw(t, rows, exp, impls=E2E_IMPLS)
        h200 = pv["e2e_h200"][key]
        ref_nsa, ref_full = _max_mean(_pct_speedups(h200, 0)), _max_mean(_pct_speedups(h200, 1))
        head = pv["headline"][key]
        out += _stat_pair("Abstract", f"end-to-end {key} FSA vs NSA (text: up to {head['max']}×, mean {head['mean']}× "
                          "over H20 and H200; H200 panels of " + fig.split(" (")[0] + ", decoded)",
                          ref_nsa, m.e2e_vs_nsa(rows), "higher",
                          {f"{i} vs NSA": m.e2e_vs_nsa(rows, fsa=i) for i in m.BEYOND_FSA},
                          paper_gpu="H200 (decoded)", **kw)
        out += _stat_pair(fig, f"{key} FSA vs full attention (FlashAttention-2; H200 panels, decoded)", ref_full,
                          m.e2e_vs_full(rows), "higher",
                          {f"fsa vs {m.E2E_BEYOND_FULL[0]}": m.e2e_vs_full(rows, "fsa", m.E2E_BEYOND_FULL)},
                          paper_gpu="H200 (decoded)", **kw)
        out.append(Claim(fig, f"{key} FSA vs full attention, H20 panels (paper value: §4.3's mean over both GPUs)",
                         pv["e2e_vs_full"][key]["mean"], None, "higher", paper_gpu="H20, H200", reason=NO_H20))
    fsdp = t.multi("train_fsdp")
    rows = m.one_commit(fsdp, E2E_IMPLS)
    hosts = ", ".join(sorted(fsdp["host"].unique())) if "host" in fsdp else ""
    h200 = pv["e2e_h200"]["training"]
    kw = dict(paper_gpu="H200 (decoded)", platform=hosts or "—", commits=m.commits_of(rows), experiments=("train_fsdp",),
              impls=E2E_IMPLS, reason="" if len(results.ok(fsdp)) else not_run("train_fsdp"))
    out += _stat_pair("Figure 5 (§4.3)", "training FSA vs NSA, every layer measured (FSDP2)",
                      _max_mean(_pct_speedups(h200, 0)), m.e2e_vs_nsa(rows), "higher",
                      {"fsa vs NSA": m.e2e_vs_nsa(rows, fsa="fsa")}, **kw)
    out += _stat_pair("Figure 5 (§4.3)", "training FSA vs full attention, every layer measured (FSDP2)",
                      _max_mean(_pct_speedups(h200, 1)), m.e2e_vs_full(rows), "higher",
                      {f"fsa vs {m.E2E_BEYOND_FULL[0]}": m.e2e_vs_full(rows, "fsa", m.E2E_BEYOND_FULL)}, **kw)
    return out


BREAKDOWN_IMPLS = (m.PAPER_FSA, "nsa", *m.PAPER_FULL)


def breakdowns(t: Tables, pv: dict) -> list[Claim]:
    """§4.4: Figures 7 (fwd/bwd), 8 (branches), 9 (ablation), 10 (attention part of training);
    the paper's numbers cover its H20 and H200 panels together."""
    out = []
    bd = m.one_commit(t("breakdown"), BREAKDOWN_IMPLS)
    sp = m.speedups(bd)
    kw = _rows_kw(t, bd, "breakdown", paper_gpu="H20, H200", impls=BREAKDOWN_IMPLS)
    for direction, key in (("fwd", "forward"), ("bwd", "backward")):
        sub = sp[sp["direction"] == direction]
        ref = pv["breakdown"][key]

        def pick(frame, direction=direction):
            return frame[frame["direction"] == direction]

        for col, name, tag, beyond in (("vs_nsa", "vs NSA", "nsa", _beyond_nsa(bd, "nsa_attention", pick)),
                                       ("vs_full", "vs full attention (Triton FlashAttention-2)", "full",
                                        _beyond_full(bd, "nsa_attention", pick))):
            out += _stat_pair("Figure 7 (§4.4)", f"{key} FSA {name}",
                              {"max": ref[f"vs_{tag}_max"], "mean": ref[f"vs_{tag}_mean"]}, sub[col], "higher",
                              beyond, **kw)
    # The share is NSA's: how much of NSA attention's time its selected branch takes.
    out += _stat_pair("Figure 8 (§4.4)", "selected attention's share of NSA attention time (NSA's rows)",
                      pv["breakdown"]["selection_share"], m.branch_breakdown(bd, impls=("nsa",))["selection_share"],
                      "magnitude", **{**kw, "impls": ("nsa",)})
    out += _stat_pair("Figure 8 (§4.4)", "FSA selected attention vs NSA's", pv["breakdown"]["selection_vs_nsa"],
                      m.speedups(bd, op="selected")["vs_nsa"], "higher", _beyond_nsa(bd, "selected"),
                      **{**kw, "impls": (m.PAPER_FSA, "nsa")})
    ab_table = m.one_commit(t("ablation"), (m.PAPER_FSA,))
    ab = m.ablation_slowdowns(ab_table)
    for label, key in (("w/o Inner Loop", "inner_loop"), ("w/o Early Return", "early_return")):
        series = ab[ab["label"] == label]["slowdown"] if len(ab) else pd.Series(dtype=float)
        out += _stat_pair("Figure 9 (§4.4)", f"{label}: slowdown of the FSA kernel (t / t_FSA - 1)",
                          pv["ablation"][key], series, "magnitude", baseline=0.0,
                          **_rows_kw(t, ab_table, "ablation", paper_gpu="H20, H200", impls=(m.PAPER_FSA,)))
    train = m.one_commit(t("train"), E2E_IMPLS)
    parts = m.attention_part_ratios(train)
    parts = parts[(parts["block_size"] == 128) & (parts["topk"] == 8)]
    fsalab = m.attention_part_ratios(train, fsa="fsa", full=m.E2E_BEYOND_FULL)
    fsalab = fsalab[(fsalab["block_size"] == 128) & (fsalab["topk"] == 8)]
    for col, name in (("vs_nsa", "vs NSA"), ("vs_full", "vs full attention (FlashAttention-2)")):
        out += _stat_pair("Figure 10 (§4.4)", f"attention part of the training step, FSA {name} ((128, 8), one "
                          "layer's attention timed alone)", pv["figure10"][col], parts[col], "higher",
                          {"fsa" + (" vs NSA" if col == "vs_nsa" else f" vs {m.E2E_BEYOND_FULL[0]}"): fsalab[col]},
                          **_rows_kw(t, train, "train", paper_gpu="H20, H200", impls=E2E_IMPLS))
    return out


def convergence(t: Tables) -> list[Claim]:
    """Figure 11 and Tables 2-4 need checkpoints; the convergence experiment stands in for
    Figure 11's claim (FSA's loss curve matches NSA's and full attention's) on a synthetic
    needle-retrieval task and on byte-level text (the Python standard library's sources), trained
    from random weights: the FSA-NSA and FSA-full loss gaps against the gap between two NSA runs
    that differ only in rounding (the noise floor), the largest ratio over the tasks. It shows
    whether FSA trains the same function as NSA, to rounding; not how NSA's quality compares with
    full attention's at the paper's scale. The loss is a property of the function, which fsalab's
    FSA kernel and the paper's compute alike, so the runs use fsalab's. Each task's rows come from
    one commit (``one_commit``), the tasks' commits may differ: each is run on its own."""
    out = [Claim("Figure 11 (App. D)", "Llama3-8B fine-tuning loss, FSA vs NSA vs full attention", None, None,
                 "magnitude", paper_gpu="—", reason=NO_CHECKPOINTS)]
    table = t("convergence")
    conv = (pd.concat([m.one_commit(rows, ("fsa", "nsa")) for _, rows in table.groupby(m.convergence_task(table))])
            if len(table) else table)
    gaps = m.convergence_gaps(conv)
    kw = dict(paper_gpu="—", platform=t.platform, commits=m.commits_of(conv), experiments=("convergence",),
              impls=("fsa", "nsa", "sdpa_flash"))
    tasks = ("synthetic needle task" if gaps["task"].eq("retrieval").all()
             else "synthetic needle and byte-level text tasks")
    for name, gap, claim in (("NSA's", "fsa_nsa", "FSA's loss matches NSA's"),
                             ("full attention's", "fsa_full", "FSA's loss matches full attention's")):
        both = gaps.dropna(subset=[f"{gap}_median_gap", "nsa_nsa_median_gap"])
        ratio = (both[f"{gap}_median_gap"] / both["nsa_nsa_median_gap"]).max() if len(both) else None
        out.append(Claim("Figure 11, stand-in", f"{claim}: median |loss_FSA - loss of {name} run| over the noise "
                         f"floor (two NSA runs differing in rounding), {tasks} from random weights, "
                         "below 1", 1.0, ratio, "at_most", points=len(both) or None,
                         reason="" if len(both) else not_run("convergence"), **kw))
    for table, what in (("Table 2", "converged loss"), ("Table 3", "perplexity"), ("Table 4", "QA F1")):
        out.append(Claim(f"{table} (App. D)", f"{what}, FSA vs NSA vs full attention (LongBench)", None, None,
                         "magnitude", paper_gpu="—", reason=NO_CHECKPOINTS))
    return out


def table5(t: Tables, pv: dict) -> list[Claim]:
    """Table 5: FSA's buffer overhead (peak memory of one fwd+bwd call minus NSA's), paper variant."""
    buf_table = m.one_commit(t("buffers"), (m.PAPER_FSA, "nsa"))
    buf = m.buffer_overhead(buf_table)
    out = []
    for bt, cells in pv["buffers"].items():
        b, k = (int(x) for x in bt.split("x"))
        for n, gb in cells.items():
            sub = buf[(buf["block_size"] == b) & (buf["topk"] == k) & (buf["N"] == int(n)) & (buf["impl"] == "fsa_paper")
                      & (buf["direction"] == "fwd+bwd")] if len(buf) else buf
            out.append(Claim("Table 5 (App. E)", f"FSA buffer overhead, GB, ({b}, {k}), {int(n) // 1024}K",
                             gb, float(sub["overhead_gb"].max()) if len(sub) else None, "magnitude", baseline=0.0,
                             **_rows_kw(t, buf_table, "buffers", paper_gpu="H20, H200", impls=(m.PAPER_FSA, "nsa"),
                                        reason="" if len(sub) else f"no {m.PAPER_FSA} / nsa rows of one commit")))
    return out


def long_context(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Appendix F.1: Tables 6 (H20) and 7 (H200), 128K and 256K, the paper's FSA vs NSA."""
    impls = (m.PAPER_FSA, "nsa")
    rows = m.one_commit(t("longctx"), impls)
    lc = m.speedups(rows)
    out = [Claim("Table 6 (App. F.1)", "H20 prefill and training at 128K/256K", pv["longctx"]["summary"]["prefill"]["h20"]["mean"],
                 None, "higher", paper_gpu="H20", reason=NO_H20)]
    for direction, key in (("fwd", "prefill"), ("fwd+bwd", "training")):

        def pick(frame, direction=direction):
            return frame[frame["direction"] == direction]

        out += _stat_pair("Table 7 (App. F.1)", f"{key} ({direction}) FSA vs NSA, 128K/256K",
                          pv["longctx"]["summary"][key][gpu], pick(lc)["vs_nsa"], "higher",
                          _beyond_nsa(rows, "nsa_attention", pick),
                          **_rows_kw(t, rows, "longctx", paper_gpu=gpu.upper(), impls=impls))
    return out


def inference_and_decode(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Appendix F.2 (Tables 8-9: end-to-end inference) and G (Table 10: one decode step); full
    attention is FlashAttention-2 (SDPA's flash backend) in the verdicts, the rest beside."""
    out = [Claim("Table 8 (App. F.2)", "H20 end-to-end inference", pv["inference"]["vs_nsa"]["h20"]["mean"], None,
                 "higher", paper_gpu="H20", reason=NO_H20)]
    impls = (m.PAPER_FSA, "nsa", *m.E2E_PAPER_FULL)
    inf = m.one_commit(t("inference"), impls)
    keys = [k for k in ("N", "g", "block_size", "topk") if k in inf]
    kw = _rows_kw(t, inf, "inference", paper_gpu=gpu.upper(), impls=impls,
                  reason="" if len(results.ok(t("inference"))) else NO_DECODE)
    out += _stat_pair("Table 9 (App. F.2)", "end-to-end inference FSA vs NSA (512 generated tokens)",
                      pv["inference"]["vs_nsa"][gpu], m.impl_ratio(inf, keys, "median_ms", "nsa", den=m.PAPER_FSA),
                      "higher", {"fsa vs NSA": m.impl_ratio(inf, keys, "median_ms", "nsa", den="fsa")}, **kw)
    out += _stat_pair("Table 9 (App. F.2)", "end-to-end inference FSA vs full attention (FlashAttention-2)",
                      pv["inference"]["vs_full"][gpu],
                      m.impl_ratio(inf, keys, "median_ms", m.E2E_PAPER_FULL, den=m.PAPER_FSA), "higher",
                      {"fsa vs fastest full attention": m.impl_ratio(inf, keys, "median_ms", DECODE_BASELINES, den="fsa")},
                      **kw)
    dec = t("decode")
    if "op" in dec:
        # The paper's Table 10 is batch 1; the batch-8/32 rows answer another question.
        dec = dec[(dec["op"] == "decode_step") & (dec["batch"] == 1)]
    impls = ("triton", *m.E2E_PAPER_FULL)
    dec = m.one_commit(dec, impls)
    keys = [k for k in ("N", "batch", "g", "h_kv", "block_size", "topk") if k in dec]
    kw = _rows_kw(t, dec, "decode", paper_gpu=gpu.upper(), impls=impls,
                  reason="" if len(results.ok(t("decode"))) else NO_DECODE)
    cells = pv["decode"][gpu].values()
    # One decode kernel: with one query per sequence FSA's and NSA's loop orders coincide.
    fastest = m.stat(m.impl_ratio(dec, keys, "median_ms", DECODE_BASELINES, den="triton"))["mean"]
    out.append(Claim("Table 10 (App. G)", "decode step FSA (fsalab's Triton step) vs FlashAttention-2 decode, batch 1, "
                     "mean", pv["decode"]["vs_flash_decoding_mean"][gpu],
                     m.stat(m.impl_ratio(dec, keys, "median_ms", m.E2E_PAPER_FULL, den="triton"))["mean"], "higher",
                     beyond=(("vs fastest full-attention decode", fastest),), **kw))
    out.append(Claim("Table 10 (App. G)", "decode step FSA vs NSA (\"matches NSA\"), mean of the table's NSA/FSA",
                     statistics.fmean(c[1] / c[2] for c in cells), None, "magnitude", paper_gpu=gpu.upper(),
                     reason=NO_DECODE_LOOP_ORDER))
    return out


def compile_overhead(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Appendix H, Table 11: one-time compile + autotune seconds of the paper's FSA kernel, as
    seconds (a size: no ratio to 1), and its FSA / NSA ratio per N."""
    impls = (m.PAPER_FSA, "nsa")
    comp = m.one_commit(t("compile"), impls)
    times = m.compile_times(comp)
    times = times[times["op"] == "selected"]
    kw = _rows_kw(t, comp, "compile", paper_gpu=gpu.upper(), impls=impls,
                  reason="" if len(times) else not_run("compile"))
    cells = pv["compile"][gpu]
    wide = times.pivot_table(index=["N", "block_size", "topk"], columns="impl", values="compile_s") if len(times) else None
    fsa = wide[m.PAPER_FSA] if wide is not None and m.PAPER_FSA in wide else pd.Series(dtype=float)
    beyond = (("fsa", m.stat(wide["fsa"])["mean"] if wide is not None and "fsa" in wide else None),)
    out = [Claim("Table 11 (App. H)", "first-call compile + autotune time, FSA, mean over N, s",
                 statistics.fmean(c[0] for c in cells.values()), m.stat(fsa)["mean"], "magnitude", baseline=0.0,
                 beyond=beyond, **{**kw, "reason": kw["reason"] or ("" if len(fsa) else f"no {m.PAPER_FSA} rows")})]
    both = wide is not None and {m.PAPER_FSA, "nsa"} <= set(wide.columns)
    ratio = (wide[m.PAPER_FSA] / wide["nsa"]).dropna() if both else pd.Series(dtype=float)
    for n, (fsa_s, nsa_s) in sorted(cells.items(), key=lambda kv: int(kv[0])):
        ours = ratio[ratio.index.get_level_values("N") == int(n)] if len(ratio) else ratio
        out.append(Claim("Table 11 (App. H)", f"first-call compile + autotune time FSA / NSA at {int(n) // 1024}K",
                         fsa_s / nsa_s, float(ours.mean()) if len(ours) else None, "magnitude",
                         points=len(ours) or None,
                         **{**kw, "reason": kw["reason"] or ("" if len(ours) else "no FSA and NSA pair measured")}))
    return out


def tensor_parallel(t: Tables, pv: dict, gpu: str) -> list[Claim]:
    """Appendix I: Tables 12-13 (attention module) and 14-15 (Llama3-8B prefill) by TP degree;
    the paper's mean is taken over the (B_K, T, N, TP) cells measured here."""
    tp_table = m.one_commit(t.multi("prefill_tp"), (m.PAPER_FSA, "nsa"))
    tp = m.tp_prefill(pd.concat([tp_table, m.one_commit(t("prefill"), (m.PAPER_FSA, "nsa"))], ignore_index=True))
    tp = tp[tp["world_size"] > 1]
    dist = pv["distributed"]
    out = [Claim("Tables 12, 14 (App. I)", "H20 tensor parallelism", dist["summary"]["attention_module_vs_nsa"]["h20"],
                 None, "higher", paper_gpu="H20", reason=NO_H20)]
    hosts = ", ".join(sorted(tp_table["host"].unique())) if "host" in tp_table else "—"
    for artefact, key, col in (("Table 13 (App. I.1)", "attention_module_ms", "attn_vs_nsa"),
                               ("Table 15 (App. I.2)", "prefill_s", "vs_nsa")):
        measured = tp.dropna(subset=[col])
        paper = [cell["nsa"][dist["tp"].index(r.world_size)] / cell["fsa"][dist["tp"].index(r.world_size)]
                 for r in measured.itertuples()
                 for cell in [dist[key][gpu][f"{r.block_size}x{r.topk}"][r.N]]]
        what = "attention module" if col == "attn_vs_nsa" else "Llama3-8B prefill"
        out.append(Claim(artefact, f"{what} FSA vs NSA at TP = 2, mean (paper: its cells at the same points)",
                         statistics.fmean(paper) if paper else dist["summary"][
                             "attention_module_vs_nsa" if col == "attn_vs_nsa" else "prefill_vs_nsa"][gpu],
                         m.stat(measured[col])["mean"], "higher", paper_gpu=gpu.upper(), platform=hosts,
                         commits=m.commits_of(tp_table), points=len(measured) or None,
                         experiments=("prefill_tp", "prefill"), impls=(m.PAPER_FSA, "nsa"),
                         reason="" if len(measured) else not_run("prefill_tp")))
    out.append(Claim("Tables 13, 15 (App. I)", "TP = 4 and 8", dist["summary"]["attention_module_vs_nsa"][gpu], None,
                     "higher", paper_gpu=gpu.upper(), reason=NO_4_8_GPUS))
    return out


# The paper's numbered artefacts in its order; a claim's artefact starts with one of these names.
ORDER = ("Abstract", "Theorem", *(f"Figure {i}" for i in range(2, 12)), *(f"Table {i}" for i in range(2, 16)))


def artefact_names(artefact: str) -> list[str]:
    """The numbered artefacts a claim's ``artefact`` label names: "Tables 12, 14 (App. I)" ->
    ["Table 12", "Table 14"]; "Figure 11, stand-in" -> ["Figure 11"]; "Theorem (§3.3)" -> ["Theorem"]."""
    head = artefact.split(" (")[0]
    match = re.fullmatch(r"(Figures?|Tables?) (\d+(?:, \d+)*)(?:, .*)?", head)
    if match is None:
        return [head.split(",")[0]]
    kind = match.group(1).rstrip("s")
    return [f"{kind} {n}" for n in match.group(2).split(", ")]


def _order(claim: Claim) -> int:
    return ORDER.index(artefact_names(claim.artefact)[0])


def claims(platform: str, results_dir=None) -> list[Claim]:
    """Every artefact's claims, in the paper's order."""
    pv = results.paper_values()
    gpu = paper_gpu(platform)
    t = Tables(platform, results_dir)
    found = [*abstract_and_kernel(t, pv, gpu), *theorem(t, pv), *figure2(t), *figure3(t), *end_to_end(t, pv, gpu),
             *breakdowns(t, pv), *convergence(t), *table5(t, pv), *long_context(t, pv, gpu),
             *inference_and_decode(t, pv, gpu), *compile_overhead(t, pv, gpu), *tensor_parallel(t, pv, gpu)]
    return sorted(found, key=_order)
