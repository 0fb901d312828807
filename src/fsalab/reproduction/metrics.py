"""Metrics shared by the analysis notebooks and REPRODUCTION.md (``artefacts``, ``document``).

Speedups, breakdown shares, ablation slowdowns, buffer overheads, DRAM byte ratios, attention
time ratios of the training step, compile times: a number in a figure and the same number in
REPRODUCTION.md or README are computed once, here. Inputs are the tidy tables of
``fsalab.results``; only rows with status ``ok`` count. Speedup = other latency / FSA latency.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from .. import results
from ..bench.flops import H200_CEILINGS, compulsory_bytes
from ..ops.impls import FULL_ATTENTION_IMPLS

SHAPE_KEYS = ["direction", "N", "batch", "h_kv", "g", "d", "dtype"]
BT_KEYS = ["block_size", "topk"]
# Every full-attention impl a table may hold.
FULL_IMPLS = (*FULL_ATTENTION_IMPLS, "reference")
# What the paper's claims are judged with: its own FSA kernel against NSA's, and its
# full-attention baseline, a Triton FlashAttention-2 kernel (it timed the Triton fused-attention
# tutorial "for fair comparison"; fsalab's Triton flash kernel plays that part).
PAPER_FSA = "fsa_paper"
PAPER_FULL = ("triton",)
# Beyond the paper, shown beside its verdicts and never judged: fsalab's FSA variant and its
# dispatcher, and the stronger full-attention baselines (SDPA's FlashAttention-2 and cuDNN).
BEYOND_FSA = ("fsa", "auto")
BEYOND_FULL = ("sdpa_flash", "sdpa_cudnn")
# In a whole model the full-attention layers run through torch SDPA (or flash-attn), not a bare
# Triton kernel: there the paper's baseline is FlashAttention-2 itself, SDPA's flash backend.
E2E_PAPER_FULL = ("sdpa_flash",)
E2E_BEYOND_FULL = ("sdpa_cudnn",)


def _median(df: pd.DataFrame, keys: list[str], column: str) -> pd.DataFrame:
    if df.empty:
        return pd.DataFrame(columns=keys + [column])
    return df.groupby(keys, as_index=False)["median_ms"].min().rename(columns={"median_ms": column})


def full_baseline(df: pd.DataFrame, impls: tuple[str, ...] = FULL_IMPLS) -> pd.DataFrame:
    """Fastest full-attention impl of ``impls`` per shape: columns SHAPE_KEYS + full_ms, full_impl.

    Where an impl was timed as ``fwd`` and ``bwd`` but not as ``fwd+bwd``, the sum of the two
    stands in for ``fwd+bwd`` (impl labelled "<impl> (fwd + bwd)")."""
    full = results.ok(df)
    full = full[(full["op"] == "full_attention") & full["impl"].isin(impls)] if not full.empty else full
    if full.empty:
        return pd.DataFrame(columns=SHAPE_KEYS + ["full_ms", "full_impl"])
    keys = [k for k in SHAPE_KEYS if k != "direction"] + ["impl"]
    parts = full.groupby(keys + ["direction"])["median_ms"].min().unstack("direction")
    if {"fwd", "bwd"} <= set(parts.columns):
        have = parts["fwd+bwd"] if "fwd+bwd" in parts.columns else pd.Series(float("nan"), index=parts.index)
        summed = (parts["fwd"] + parts["bwd"])[have.isna()].dropna().rename("median_ms").reset_index()
        summed = summed.assign(direction="fwd+bwd", impl=summed["impl"] + " (fwd + bwd)")
        full = pd.concat([full, summed], ignore_index=True)
    best = full.loc[full.groupby(SHAPE_KEYS)["median_ms"].idxmin()]
    return best[SHAPE_KEYS + ["median_ms", "impl"]].rename(columns={"median_ms": "full_ms", "impl": "full_impl"})


def speedups(df: pd.DataFrame, op: str = "nsa_attention", fsa: str = PAPER_FSA, nsa: str = "nsa",
             full: tuple[str, ...] = PAPER_FULL) -> pd.DataFrame:
    """Per shape and (B, T): fsa_ms, nsa_ms, full_ms, vs_nsa = nsa/fsa, vs_full = full/fsa, where
    ``fsa`` and ``nsa`` name the two selected-attention impls and ``full`` the full-attention
    impls whose fastest is the baseline (the paper's kernel and baseline by default)."""
    ok = results.ok(df)
    ok = ok[ok["op"] == op] if not ok.empty else ok
    keys = SHAPE_KEYS + BT_KEYS
    a = _median(ok[ok["impl"] == fsa] if not ok.empty else ok, keys, "fsa_ms")
    b = _median(ok[ok["impl"] == nsa] if not ok.empty else ok, keys, "nsa_ms")
    out = a.merge(b, on=keys, how="outer").merge(full_baseline(df, full), on=SHAPE_KEYS, how="left")
    out["vs_nsa"] = out["nsa_ms"] / out["fsa_ms"]
    out["vs_full"] = out["full_ms"] / out["fsa_ms"]
    return out.sort_values(keys).reset_index(drop=True)


def one_commit(df: pd.DataFrame, impls: tuple[str, ...] = ()) -> pd.DataFrame:
    """The rows one verdict may read: ok, not marked dirty (a row that records no dirtiness, from
    a copied tree named by its commit, counts as clean), and of one commit only: the one that
    measured the most impls of ``impls``, the newest (by its latest row's ``timestamp``) among
    equals. So an artefact's FSA, NSA and full-attention rows run the same code."""
    ok = results.ok(df)
    if ok.empty or "git_commit" not in ok:
        return ok
    if "git_dirty" in ok:
        ok = ok[ok["git_dirty"].ne(True) & ok["git_dirty"].astype(str).ne("True")]
    ok = ok[ok["git_commit"].notna()]
    if ok.empty:
        return ok
    latest = ok.groupby("git_commit")["timestamp"].max().astype(str) if "timestamp" in ok else None
    covered = ok.groupby("git_commit")["impl"].agg(lambda names: len(set(impls) & set(names)))
    best = max(covered.index, key=lambda c: (covered[c], latest[c] if latest is not None else ""))
    return ok[ok["git_commit"] == best]


def stat(series: pd.Series) -> dict:
    """max and arithmetic mean of the finite values (None when there are none)."""
    s = pd.to_numeric(series, errors="coerce").dropna()
    return {"max": float(s.max()), "mean": float(s.mean()), "n": len(s)} if len(s) else {"max": None, "mean": None, "n": 0}


def branch_breakdown(df: pd.DataFrame, impls=("fsa", "nsa")) -> pd.DataFrame:
    """Figure 8: per (impl, shape, B, T): compressed_ms, selected_ms, window_ms, selection_share."""
    ok = results.ok(df)
    keys = SHAPE_KEYS + BT_KEYS
    if ok.empty:
        return pd.DataFrame(columns=["impl"] + keys + ["compressed_ms", "selected_ms", "window_ms", "selection_share"])
    cmp_ = _median(ok[ok["op"] == "compressed"], keys, "compressed_ms")
    win = _median(ok[ok["op"] == "window"], SHAPE_KEYS, "window_ms")
    parts = []
    for impl in impls:
        sel = _median(ok[(ok["op"] == "selected") & (ok["impl"] == impl)], keys, "selected_ms")
        if sel.empty:
            continue
        parts.append(sel.merge(cmp_, on=keys, how="left").merge(win, on=SHAPE_KEYS, how="left").assign(impl=impl))
    if not parts:
        return pd.DataFrame(columns=["impl"] + keys + ["compressed_ms", "selected_ms", "window_ms", "selection_share"])
    out = pd.concat(parts, ignore_index=True)
    out["selection_share"] = out["selected_ms"] / out[["compressed_ms", "selected_ms", "window_ms"]].sum(axis=1, min_count=3)
    return out


def floors(df: pd.DataFrame, tflops: float = H200_CEILINGS["tflops"],
           tbps: float = H200_CEILINGS["tbps"]) -> pd.DataFrame:
    """Each ok row's floor beside its time: its useful FLOPs at ``tflops`` (TFLOP/s) and its
    compulsory bytes (``bench.flops.compulsory_bytes``) at ``tbps`` (TB/s); ``floor_ms`` is the
    larger, ``of_floor`` the measured median over it (1.0 = at the ceiling)."""
    ok = results.ok(df)
    cols = ["op", "impl", "direction", "N", "g", "block_size", "topk", "median_ms", "useful_flops"]
    out = ok[[c for c in cols if c in ok.columns]].copy()
    out["compulsory_bytes"] = [
        compulsory_bytes(r.op, r.direction, int(r.N) * int(r.batch), int(r.h), int(r.h_kv), int(r.d),
                         int(r.kernel_size), int(r.topk), 4 if r.dtype == "float32" else 2)
        for r in ok.itertuples()
    ]
    out["flop_floor_ms"] = pd.to_numeric(out["useful_flops"], errors="coerce") / (tflops * 1e12) * 1e3
    out["byte_floor_ms"] = out["compulsory_bytes"] / (tbps * 1e12) * 1e3
    out["floor_ms"] = out[["flop_floor_ms", "byte_floor_ms"]].max(axis=1)
    out["of_floor"] = out["median_ms"] / out["floor_ms"]
    return out.reset_index(drop=True)


def ablation_slowdowns(df: pd.DataFrame, base_label: str = "FSA") -> pd.DataFrame:
    """Figure 9: latency increase of each variant over the full FSA, t_variant / t_FSA - 1."""
    ok = results.ok(df)
    keys = SHAPE_KEYS + BT_KEYS
    if ok.empty or "label" not in ok:
        return pd.DataFrame(columns=keys + ["label", "median_ms", "slowdown"])
    base = _median(ok[ok["label"] == base_label], keys, "base_ms")
    out = ok[keys + ["label", "median_ms"]].merge(base, on=keys, how="left")
    out["slowdown"] = out["median_ms"] / out["base_ms"] - 1
    return out


def buffer_overhead(df: pd.DataFrame, fsa_impls=("fsa_paper", "fsa"), baseline: str = "nsa") -> pd.DataFrame:
    """Table 5: peak memory of each FSA impl minus NSA's at the same point, in GiB and GB."""
    ok = results.ok(df)
    keys = SHAPE_KEYS + BT_KEYS
    if ok.empty or ok["peak_mem_gib"].isna().all():
        return pd.DataFrame(columns=keys + ["impl", "overhead_gib", "overhead_gb"])
    base = ok[ok["impl"] == baseline].groupby(keys, as_index=False)["peak_mem_gib"].min().rename(columns={"peak_mem_gib": "base_gib"})
    out = ok[ok["impl"].isin(fsa_impls)][keys + ["impl", "peak_mem_gib"]].merge(base, on=keys, how="left")
    out["overhead_gib"] = out["peak_mem_gib"] - out["base_gib"]
    out["overhead_gb"] = out["overhead_gib"] * 2**30 / 1e9
    return out


def _e2e_ms(df: pd.DataFrame) -> pd.DataFrame:
    """ok rows of a train or prefill table with ``ms`` = full_depth_ms (else median_ms)."""
    ok = results.ok(df)
    if ok.empty:
        return ok
    ms = ok["full_depth_ms"].fillna(ok["median_ms"]) if "full_depth_ms" in ok else ok["median_ms"]
    return ok.assign(ms=ms)


def e2e_vs_nsa(df: pd.DataFrame, fsa: str = PAPER_FSA) -> pd.Series:
    """NSA / FSA end-to-end time (``full_depth_ms``, else ``median_ms``) per (model, B_K, T, N)
    of a train or prefill table, FSA being impl ``fsa``; empty when either side is missing."""
    ok = _e2e_ms(df)
    if ok.empty:
        return pd.Series(dtype=float)
    wide = ok.pivot_table(index=["model", "block_size", "topk", "N"], columns="impl", values="ms", aggfunc="min")
    if not {fsa, "nsa"} <= set(wide.columns):
        return pd.Series(dtype=float)
    return (wide["nsa"] / wide[fsa]).dropna()


def e2e_vs_full(df: pd.DataFrame, fsa: str = PAPER_FSA, full: tuple[str, ...] = E2E_PAPER_FULL) -> pd.Series:
    """Fastest full-attention impl of ``full`` / FSA (impl ``fsa``) end-to-end time per (model,
    B_K, T, N); full attention does not depend on (B_K, T), so one full row per (model, N) serves
    both panels."""
    ok = _e2e_ms(df)
    if ok.empty:
        return pd.Series(dtype=float)
    full = ok[ok["impl"].isin(full)].groupby(["model", "N"])["ms"].min().rename("full_ms")
    fsa = ok[ok["impl"] == fsa].groupby(["model", "block_size", "topk", "N"], as_index=False)["ms"].min()
    if full.empty or fsa.empty:
        return pd.Series(dtype=float)
    merged = fsa.merge(full.reset_index(), on=["model", "N"], how="inner")
    return (merged["full_ms"] / merged["ms"]).dropna()


TP_KEYS = ["block_size", "topk", "N", "world_size"]


def tp_prefill(df: pd.DataFrame, fsa: str = PAPER_FSA) -> pd.DataFrame:
    """Llama3-8B prefill by tensor-parallel degree, FSA beside NSA: one row per (B_K, T, N,
    world_size) with the end-to-end prefill of impl ``fsa`` and of NSA (``fsa_s``, ``nsa_s``,
    ``vs_nsa``) and one attention
    module in isolation (``fsa_attn_ms``, ``nsa_attn_ms``, ``attn_vs_nsa``). ``df``: rows of
    ``prefill_tp`` (and single-GPU ``prefill`` rows as TP = 1, used only where ``prefill_tp`` has
    no TP = 1 row of that impl, so FSA and NSA of one row come from the same runner where it can).
    Attention-module times count only from rows whose all-reduce was waited on inside the timed
    call (``split_kind`` set); earlier rows timed a call that ended before its all-reduce did."""
    cols = TP_KEYS + ["fsa_s", "nsa_s", "vs_nsa", "fsa_attn_ms", "nsa_attn_ms", "attn_vs_nsa"]
    ok = results.ok(df)
    if "model" in ok:
        ok = ok[ok["model"] == "llama3-8b"]
    ok = ok[ok["impl"].isin([fsa, "nsa"])] if not ok.empty else ok
    ok = ok.assign(impl=ok["impl"].replace({fsa: "fsa"})) if not ok.empty else ok
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok = ok.assign(world_size=ok["world_size"].fillna(1).astype(int) if "world_size" in ok else 1,
                   tp_run=ok["experiment"].eq("prefill_tp") if "experiment" in ok else False)
    ok = ok[ok["tp_run"] == ok.groupby(TP_KEYS + ["impl"])["tp_run"].transform("max")]
    wide = ok.pivot_table(index=TP_KEYS, columns="impl", values="median_ms", aggfunc="min")
    out = pd.DataFrame(index=wide.index)
    for impl in ("fsa", "nsa"):
        out[f"{impl}_s"] = wide[impl] / 1e3 if impl in wide else math.nan
    out["vs_nsa"] = out["nsa_s"] / out["fsa_s"]
    waited = ok[ok["split_kind"].notna()] if "split_kind" in ok else ok.iloc[0:0]
    attn = (waited.pivot_table(index=TP_KEYS, columns="impl", values="attention_ms_per_layer", aggfunc="min")
            if len(waited) else pd.DataFrame(index=out.index))
    for impl in ("fsa", "nsa"):
        out[f"{impl}_attn_ms"] = attn[impl].reindex(out.index) if impl in attn else math.nan
    out["attn_vs_nsa"] = out["nsa_attn_ms"] / out["fsa_attn_ms"]
    return out.reset_index()[cols]


def full_depth_vs_estimate(single: pd.DataFrame, multi: pd.DataFrame) -> pd.DataFrame:
    """Full-depth training steps measured with FSDP2 (``multi``: ``train_fsdp`` rows) beside the
    single-GPU estimate of the same point (``single``: ``train`` rows, whose ``full_depth_ms``
    extrapolates a slice of layers): ``estimate_s``, ``measured_s``, ``measured_vs_estimate``.
    Each FSDP2 rank trains its own sequence, so both are the time of one sequence's step."""
    keys = ["model", "impl", "N", "batch", "block_size", "topk"]
    cols = keys + ["world_size", "estimate_s", "measured_s", "measured_vs_estimate"]
    est, meas = results.ok(single), results.ok(multi)
    if est.empty or meas.empty or "full_depth_kind" not in est:
        return pd.DataFrame(columns=cols)
    est = est[est["full_depth_kind"].astype(str).str.startswith("estimate")]
    est = est.groupby(keys, as_index=False)["full_depth_ms"].min().rename(columns={"full_depth_ms": "est_ms"})
    meas = meas.groupby(keys + ["world_size"], as_index=False)["median_ms"].min()
    both = meas.merge(est, on=keys, how="inner")
    both["estimate_s"], both["measured_s"] = both["est_ms"] / 1e3, both["median_ms"] / 1e3
    both["measured_vs_estimate"] = both["median_ms"] / both["est_ms"]
    return both[cols]


def run_label(row) -> str:
    """A convergence run's name: its selection impl, plus any compression, window or gate branch
    other than ``auto`` (``nsa (gate reference)``: the same NSA model rounded differently)."""
    label = str(row["impl"])
    for key, name in (("compression_impl", "compression"), ("window_impl", "window"), ("gate_impl", "gate")):
        value = row.get(key)
        if isinstance(value, str) and value != "auto":
            label += f" ({name} {value})"
    return label


def curve_of(row) -> dict:
    """A convergence row's loss/accuracy curve, whether the table holds it parsed or as JSON text."""
    curve = row["curve"]
    return json.loads(curve) if isinstance(curve, str) else curve


def loss_gaps(a: dict, b: dict) -> pd.Series:
    """|loss_a - loss_b| at the steps both curves logged (``{"step": [...], "loss": [...]}``),
    indexed by step."""
    la, lb = (pd.Series(c["loss"], index=c["step"], dtype=float) for c in (a, b))
    return (la - lb).abs().dropna().sort_index()


def convergence_task(df: pd.DataFrame) -> pd.Series:
    """Each convergence row's task: its ``task`` (``retrieval`` or ``text``), ``retrieval`` for
    rows written before the text task existed (they lack the column)."""
    return df["task"].fillna("retrieval") if "task" in df else pd.Series("retrieval", index=df.index, dtype=object)


def convergence_gaps(df: pd.DataFrame, threshold: float = 0.02) -> pd.DataFrame:
    """Per convergence task (``task``, ``needle_span``, ``steps``): final far-needle accuracy of
    FSA, NSA and full attention (NaN for the text task, which has no far split), FSA's and NSA's
    final loss over the task's chance loss (near 1: the run did not learn the task), the FSA-NSA
    training-loss gap (median, max, first step above ``threshold``), where a second NSA run
    differing only in rounding exists (another compression, window or gate branch) the same gap
    between the two NSA runs: the noise floor the FSA-NSA gap is judged against, the same gap
    between FSA and full attention, and for the text task each run's final held-out loss
    (``eval_loss_*``). ``df``: convergence rows with their ``curve``."""
    cols = ["task", "needle_span", "steps", "acc_far_fsa", "acc_far_nsa", "acc_far_full", "loss_over_chance_fsa",
            "loss_over_chance_nsa", "fsa_nsa_median_gap",
            "fsa_nsa_max_gap", "fsa_nsa_first_step_over", "nsa_nsa_median_gap", "nsa_nsa_max_gap",
            "nsa_nsa_first_step_over", "fsa_full_median_gap", "fsa_full_max_gap", "fsa_full_first_step_over",
            "eval_loss_fsa", "eval_loss_nsa", "eval_loss_full"]
    ok = results.ok(df)
    if ok.empty or "curve" not in ok:
        return pd.DataFrame(columns=cols)
    ok = ok.assign(task=convergence_task(ok),
                   needle_span=ok["needle_span"].fillna(1).astype(int) if "needle_span" in ok else 1,
                   label=[run_label(r) for _, r in ok.iterrows()])
    rows = []
    for (name, span, steps), task in ok.groupby(["task", "needle_span", "steps"]):
        runs = {r["label"]: r for _, r in task.iterrows()}
        row = {"task": name, "needle_span": span, "steps": steps}
        full = [lab for lab in runs if lab.startswith("sdpa") or lab == "flash_attn"]
        for key, lab in (("fsa", "fsa"), ("nsa", "nsa"), ("full", full[0] if full else None)):
            run = runs.get(lab)
            row[f"acc_far_{key}"] = run["final_accuracy_far"] if run is not None else math.nan
            held = run.get("final_eval_loss") if run is not None else None
            row[f"eval_loss_{key}"] = float(held) if held is not None else math.nan
        for key in ("fsa", "nsa"):
            run = runs.get(key)
            row[f"loss_over_chance_{key}"] = (run.get("final_loss", math.nan) / run.get("chance_loss", math.nan)
                                              if run is not None else math.nan)
        twins = [lab for lab in runs if lab.startswith("nsa (")]
        for key, pair in (("fsa_nsa", ("fsa", "nsa")), ("nsa_nsa", ("nsa", twins[0] if twins else None)),
                          ("fsa_full", ("fsa", full[0] if full else None))):
            gap = loss_gaps(curve_of(runs[pair[0]]), curve_of(runs[pair[1]])) if set(pair) <= set(runs) else pd.Series(dtype=float)
            over = gap.index[gap > threshold]
            row[f"{key}_median_gap"] = float(gap.median()) if len(gap) else math.nan
            row[f"{key}_max_gap"] = float(gap.max()) if len(gap) else math.nan
            row[f"{key}_first_step_over"] = int(over[0]) if len(over) else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=cols)


def convergence_gap_table(gaps: pd.DataFrame) -> pd.DataFrame:
    """``convergence_gaps`` as the notebook and REPRODUCTION.md show it: the text task's columns
    (``task``, ``eval_loss_*``) only where a text run is in the table, so a table of retrieval
    runs alone reads as it did before the text task existed."""
    if gaps["task"].eq("retrieval").all():
        return gaps.drop(columns=["task", "eval_loss_fsa", "eval_loss_nsa", "eval_loss_full"])
    return gaps


def commits_of(*frames: pd.DataFrame) -> tuple[str, ...]:
    """The short (7-character) ``git_commit`` fields of the ok rows of ``frames``, sorted, as
    the rows give them (a device copy's stale HEAD included, which need not be the commit of the
    code it ran), marked "(dirty)" where the row's ``git_dirty`` says so."""
    seen = set()
    for df in frames:
        ok = results.ok(df)
        if "git_commit" not in ok:
            continue
        dirty = ok["git_dirty"].eq(True) if "git_dirty" in ok else pd.Series(False, index=ok.index)  # NaN: clean
        for commit, is_dirty in zip(ok["git_commit"], dirty):
            if isinstance(commit, str):
                seen.add(commit[:7] + (" (dirty)" if is_dirty else ""))
    return tuple(sorted(seen))


def dram_ratios(df: pd.DataFrame, fsa: str = "fsa_paper", nsa: str = "nsa") -> pd.DataFrame:
    """Measured DRAM bytes of ``fsa`` over ``nsa`` per (direction, g, B_K, T, N) of a ``dram``
    table: columns fsa_bytes, nsa_bytes, bytes_ratio (FSA / NSA); empty without both sides."""
    keys = ["direction", "g", "block_size", "topk", "N"]
    cols = keys + ["fsa_bytes", "nsa_bytes", "bytes_ratio"]
    ok = results.ok(df)
    if ok.empty or "dram_bytes" not in ok:
        return pd.DataFrame(columns=cols)
    wide = ok.pivot_table(index=keys, columns="impl", values="dram_bytes", aggfunc="min")
    if not {fsa, nsa} <= set(wide.columns):
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame({"fsa_bytes": wide[fsa], "nsa_bytes": wide[nsa]}).dropna()
    out["bytes_ratio"] = out["fsa_bytes"] / out["nsa_bytes"]
    return out.reset_index()[cols]


def attention_part_ratios(df: pd.DataFrame, fsa: str = PAPER_FSA, full: tuple[str, ...] = E2E_PAPER_FULL) -> pd.DataFrame:
    """Figure 10: the attention part of a training step (one layer's attention fwd + fwd+bwd,
    timed alone: ``attention_ms_per_layer``) of NSA and of the fastest full attention of
    ``full`` over FSA's (impl ``fsa``), per (model, N, B_K, T) of FSA's split rows: columns
    fsa_ms, nsa_ms, full_ms, vs_nsa, vs_full. Full attention does not depend on (B_K, T): one
    row per (model, N)."""
    keys = ["model", "N", "block_size", "topk"]
    cols = keys + ["fsa_ms", "nsa_ms", "full_ms", "vs_nsa", "vs_full"]
    ok = results.ok(df)
    if ok.empty or "attention_ms_per_layer" not in ok:
        return pd.DataFrame(columns=cols)
    ok = ok.dropna(subset=["attention_ms_per_layer"])
    part = "attention_ms_per_layer"
    fsa = ok[ok["impl"] == fsa].groupby(keys, as_index=False)[part].min().rename(columns={part: "fsa_ms"})
    nsa = ok[ok["impl"] == "nsa"].groupby(keys, as_index=False)[part].min().rename(columns={part: "nsa_ms"})
    full = ok[ok["impl"].isin(full)].groupby(["model", "N"], as_index=False)[part].min()
    out = fsa.merge(nsa, on=keys, how="left").merge(full.rename(columns={part: "full_ms"}), on=["model", "N"], how="left")
    out["vs_nsa"] = out["nsa_ms"] / out["fsa_ms"]
    out["vs_full"] = out["full_ms"] / out["fsa_ms"]
    return out[cols].sort_values(keys).reset_index(drop=True)


def impl_ratio(df: pd.DataFrame, keys: list[str], value: str, num, den: str = "fsa") -> pd.Series:
    """``num`` / ``den`` of column ``value`` per ``keys`` (the minimum over repeated rows);
    ``num`` is an impl name or a tuple of names (the fastest of them counts: the full-attention
    baselines). Empty when either side is missing."""
    ok = results.ok(df)
    names = (num,) if isinstance(num, str) else tuple(num)
    if ok.empty or value not in ok or not set(keys) <= set(ok.columns):
        return pd.Series(dtype=float)
    a = ok[ok["impl"].isin(names)].groupby(keys)[value].min()
    b = ok[ok["impl"] == den].groupby(keys)[value].min()
    return (a / b).dropna()


def compile_times(df: pd.DataFrame) -> pd.DataFrame:
    """Table 11: per (op, impl, direction, N, B_K, T) of a ``compile`` table, the cold first
    call's compile + autotune seconds (``compile_s``), the cached one's (``cached_compile_s``)
    and the steady call (``median_ms``)."""
    keys = ["op", "impl", "direction", "N", "block_size", "topk"]
    cols = keys + ["compile_s", "cached_compile_s", "first_call_s", "median_ms"]
    ok = results.ok(df)
    if ok.empty or "compile_s" not in ok:
        return pd.DataFrame(columns=cols)
    return ok.groupby(keys, as_index=False)[cols[len(keys):]].min()


VERSUS_TIMINGS = {"replayed": "graph_ratio_to_cudnn", "eager": "ratio_to_cudnn"}


def versus_crossovers(df: pd.DataFrame, impl: str = "auto", block_size: int = 64, topk: int = 16) -> pd.DataFrame:
    """Where whole NSA attention overtakes cuDNN, from a ``versus`` table: per (direction,
    timing, g), ``from_N`` = the smallest N from which ``impl``'s ratio to cuDNN (cuDNN time /
    NSA time; timing "replayed" = graph-replayed, "eager") is >= 1 at every larger N measured
    (NaN when it loses at the largest), and the last N below it that lost: ``lost_N``, its
    ``lost_ratio`` and ``lost_replayed_ratio``, and ``lost_eager_over_replayed`` = NSA's eager
    time over its replayed time there (how far the host's launches stretch the eager call);
    ``wins_below``: the N below ``lost_N`` where it won all the same (a tuple, mostly empty)."""
    cols = ["direction", "timing", "g", "from_N", "lost_N", "lost_ratio", "lost_replayed_ratio",
            "lost_eager_over_replayed", "wins_below"]
    ok = results.ok(df)
    if ok.empty or "graph_ratio_to_cudnn" not in ok:
        return pd.DataFrame(columns=cols)
    ok = ok[(ok["impl"] == impl) & (ok["block_size"] == block_size) & (ok["topk"] == topk)]
    rows = []
    for (direction, g), at in ok.groupby(["direction", "g"]):
        at = at.sort_values("N")
        for timing, column in VERSUS_TIMINGS.items():
            timed = at.dropna(subset=[column])
            wins = (timed[column] >= 1.0).to_numpy()
            # Index of the first point from which every later point wins (len(wins) when none).
            start = len(wins)
            while start > 0 and wins[start - 1]:
                start -= 1
            row = {"direction": direction, "timing": timing, "g": g,
                   "from_N": timed["N"].iloc[start] if start < len(wins) else math.nan,
                   "wins_below": tuple(int(n) for n, w in zip(timed["N"].iloc[:max(start - 1, 0)], wins) if w)}
            if start > 0:
                lost = timed.iloc[start - 1]
                row.update(lost_N=lost["N"], lost_ratio=lost[column], lost_replayed_ratio=lost["graph_ratio_to_cudnn"],
                           lost_eager_over_replayed=lost["median_ms"] / lost["graph_median_ms"])
            rows.append(row)
    return pd.DataFrame(rows, columns=cols)
