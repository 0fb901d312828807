"""Experiment configs, the kernel runner, aggregation and the REPRODUCTION.md writer (CPU, tiny)."""

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from fsalab import cli, reproduction, results
from fsalab.bench import grid, kernel, points, provenance, rows, timing
from fsalab.bench.repo import repo_root

EXPERIMENTS = grid.known_experiments()
SMOKE_EXPERIMENTS = sorted(grid.load_smoke()["experiments"])
PAPER_EXPERIMENTS = sorted(grid.load_overlay("paper")["experiments"])
TINY = {
    "op": "selected", "impl": "reference", "direction": "fwd+bwd", "N": 80, "batch": 2, "h_kv": 1, "g": 2, "d": 16,
    "kernel_size": 16, "kernel_stride": 16, "block_size": 16, "topk": 3, "window_size": 32, "dtype": "float32",
}
CPU_EXP = {"timing": {"method": "wallclock", "warmup": 0, "repeats": 2, "memory": False}, "check": {"max_tokens": 48}}


def _tiny_exp(**overrides) -> dict:
    exp = grid.validate(
        {"experiment": "unit", "description": "unit test", "feeds": ["none"], "runner": "kernel",
         "grid": [{k: [v] for k, v in {**TINY, **overrides}.items()}], **CPU_EXP},
        grid.load_schema("experiment"), "unit",
    )
    return exp


def _result_schema():
    return grid.load_schema("result")


@pytest.mark.parametrize("name, overlay", [(n, None) for n in EXPERIMENTS] + [(n, "smoke") for n in SMOKE_EXPERIMENTS]
                         + [(n, "paper") for n in PAPER_EXPERIMENTS])
def test_experiment_configs_validate(name, overlay):
    """Every experiment validates (defaults filled), alone and with each overlay; kernel, theory
    and end-to-end grids expand to unique ids."""
    exp = grid.load_experiment(name, smoke=overlay == "smoke", paper=overlay == "paper")
    assert exp["feeds"] and exp["timing"]["method"] in timing.METHODS  # defaults filled in
    if exp["runner"] not in ("kernel", "theory", *points.E2E_RUNNERS):
        return
    expanded = grid.expand(exp, ranks=2 if grid.is_parallel(exp) else None)
    assert expanded and len({p["id"] for p in expanded}) == len(expanded)
    if exp["runner"] in points.E2E_RUNNERS:
        op = points.E2E_RUNNERS[exp["runner"]][0]
        assert all(p["op"] == op and p["model"] and p["id"].startswith(op.replace("_", "")) for p in expanded)
    if exp["runner"] == "kernel":
        assert all(p["dtype"] in ("float16", "bfloat16", "float32") and "batch" in p for p in expanded)


@pytest.mark.parametrize("name", PAPER_EXPERIMENTS)
def test_paper_points_are_points_of_the_full_grid(name):
    """The paper profile's points share their ids, so their files, with the full grid's: the
    two profiles measure each common point once."""
    full = {p["id"] for p in grid.expand(grid.load_experiment(name))}
    paper = [p["id"] for p in grid.expand(grid.load_experiment(name, paper=True))]
    assert paper and set(paper) <= full


def test_an_experiment_takes_one_overlay():
    with pytest.raises(ValueError, match="not both"):
        grid.load_experiment("kernel", smoke=True, paper=True)
    with pytest.raises(ValueError, match="overlay must be one of"):
        grid.load_overlay("kernel")
    assert "paper" not in grid.known_experiments() and "smoke" not in grid.known_experiments()


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="op"):
        grid.expand(_tiny_exp(op="bogus"))
    with pytest.raises(ValueError, match="is not a valid config"):
        grid.validate({"experiment": "x"}, grid.load_schema("experiment"), "x")


def test_point_ids_are_stable_and_distinct():
    a = grid.expand(_tiny_exp())[0]
    b = grid.expand(_tiny_exp(variant={"options": {"inner_loop": False}}))[0]
    assert a["id"] == f"selected-reference-fwdbwd-N80-b2-hkv1-g2-d16-B16-T3-fp32-w32-{points.point_hash(a)}"
    assert b["id"].startswith(a["id"][:-9] + "-innerloop0-")
    assert grid.expand(_tiny_exp())[0]["id"] == a["id"]  # stable across expansions


def test_e2e_point_ids_carry_steps_and_rank_count(monkeypatch):
    """Convergence runs of different lengths, and parallel runs at different rank counts, write
    different files; the rank count is the point's own (``ranks``), never the environment's, so
    the workflow names a torchrun job's files before any rank starts."""

    conv = {**points.E2E_DEFAULTS, "op": "convergence", "model": "llama3-8b", "impl": "fsa", "N": 4096, "steps": 3000,
            "dtype": "bfloat16"}
    assert points.e2e_point_id(conv).endswith(f"-S3000-{points.point_hash(conv)}")
    # Another window or gate branch is another run (the convergence noise floor), named in the prefix.
    assert "-bf16-winreference-S3000-" in points.e2e_point_id({**conv, "window_impl": "reference"})
    assert "-bf16-gatereference-S3000-" in points.e2e_point_id({**conv, "gate_impl": "reference"})
    monkeypatch.setenv("WORLD_SIZE", "4")
    tp = {**points.E2E_DEFAULTS, "op": "prefill", "model": "llama3-8b", "impl": "nsa", "N": 32768, "parallel": "tp",
          "dtype": "float16", "ranks": 2}
    assert points.e2e_point_id(tp).endswith(f"-tp2-{points.point_hash(tp)}")
    # The rank count is in the prefix only: TP = 1 and TP = 2 of a point share its hash.
    assert points.point_hash(tp) == points.point_hash({**tp, "ranks": 1})
    with pytest.raises(ValueError, match="rank count"):
        points.e2e_point_id({k: v for k, v in tp.items() if k != "ranks"})
    exp = grid.load_experiment("prefill_tp")
    assert grid.is_parallel(exp) and not grid.is_parallel(grid.load_experiment("prefill"))
    assert all("-tp8-" in p["id"] and p["ranks"] == 8 for p in grid.expand(exp, ranks=8))
    with pytest.raises(ValueError, match="rank count"):
        grid.expand(exp)
    with pytest.raises(ValueError, match="launcher's rank count"):
        grid.expand({**exp, "defaults": {**exp["defaults"], "ranks": 2}}, ranks=2)


def test_committed_multi_gpu_results_keep_their_ids():
    """Every committed point file of a multi-GPU host (results/<gpu>x<GPUs>/) is named by the id
    its parameters and rank count give, and is a point of its experiment's grid at that count."""
    import subprocess

    from fsalab.results import point_of_row

    root = repo_root()
    listed = subprocess.run(["git", "ls-files", "results"], cwd=root, capture_output=True, text=True, check=True)
    files = [f for f in listed.stdout.split() if re.match(r"results/[a-z0-9]+x\d+/[^/]+/[^/]+\.json$", f)]
    if not files:
        pytest.skip("no committed multi-GPU results in this checkout")
    grids = {}
    for name in files:
        row = json.loads((root / name).read_text())
        p = {**point_of_row(row, Path(name).stem), "ranks": row["world_size"]}
        key = (row["experiment"], row["world_size"])
        if key not in grids:
            grids[key] = {q["id"] for q in grid.expand(grid.load_experiment(key[0]), ranks=key[1])}
        assert points.e2e_point_id(p) == Path(name).stem, name
        assert Path(name).stem in grids[key], name


def test_runner_refuses_a_rank_count_other_than_its_world(tmp_path, capsys):
    """A job planned for 2 ranks but launched on 1 (no torchrun: world size 1) would write the
    ids of TP = 1 points; the runner stops before measuring anything."""
    from fsalab.bench import prefill

    with pytest.raises(SystemExit) as stop:
        prefill.main(["--experiment", "prefill_tp", "--all", "--ranks", "2", "--platform", "cpu-test",
                      "--results-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "--ranks 2, but this job runs on 1 rank(s)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    assert prefill.main(["--experiment", "prefill_tp", "--list", "--ranks", "2"]) == 0
    assert all("-tp2-" in line for line in capsys.readouterr().out.split())


def test_runner_writes_valid_reference_row(tmp_path):
    exp = _tiny_exp()
    point = grid.expand(exp)[0]
    row = kernel.run_point(point, exp, torch.device("cpu"), platform="unit-cpu")
    assert row["status"] == "ok", row["message"]
    assert row["check"]["status"] == "pass" and set(row["check"]["outputs"]) == {"o", "dq", "dk", "dv"}
    assert row["n_samples"] == len(row["samples_ms"]) == 2
    assert row["useful_flops"] > 0 and row["h"] == 2
    assert "compression path" in row["inputs"]["indices_from"]
    path = rows.write_row(row, rows.result_path(tmp_path, "unit-cpu", "unit", point["id"]))
    loaded = json.loads(path.read_text())
    grid.validate(loaded, _result_schema(), str(path))
    assert all(c in loaded for c in rows.COLUMNS)


def test_unknown_impl_gives_unsupported_row():
    """A misspelt impl is a config error; a point that reaches the runner with an impl it cannot
    bind (not available here) is an ``unsupported`` row."""
    exp = _tiny_exp(impl="no_such_impl", direction="fwd")
    with pytest.raises(ValueError, match="impl of op 'selected' must be one of .*got 'no_such_impl'"):
        grid.expand(exp)
    point = dataclasses.replace(grid.expand(_tiny_exp(direction="fwd"))[0], impl="no_such_impl")
    row = kernel.run_point(point, exp, torch.device("cpu"), platform="unit-cpu")
    assert row["status"] == "unsupported" and "no_such_impl" in row["message"]
    assert row["median_ms"] is None
    grid.validate(json.loads(json.dumps(row)), _result_schema(), "row")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it comes out 1% too large."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


@pytest.mark.parametrize("perturb, direction, failing", [
    ("output", "fwd", {"o"}),
    ("output", "bwd", {"o", "dq", "dk", "dv"}),  # o x 1.01 scales every gradient by 1.01 too
    ("grad", "bwd", {"dv"}),
    ("grad", "fwd", set()),  # the forward check never looks at gradients
])
def test_correctness_check_fails_a_wrong_impl(monkeypatch, perturb, direction, failing):
    """An impl whose output is off by 1%, or whose dv is off by 1% with an exact output, gets an
    ``error`` row: the check recorded as failed, naming exactly the outputs that are wrong, and
    the row's message saying the correctness check failed. The same wrapper with nothing wrong
    where the direction looks passes (the failure comes from the perturbation alone)."""
    from dataclasses import replace

    from fsalab.bench import ops

    real_bind = ops.bind

    def bind(op, impl, options=None):
        bound = real_bind(op, "reference" if impl == "perturbed" else impl, options)
        if impl != "perturbed":
            return bound

        def fn(x):
            if perturb == "output":
                o, aux = bound.fn(x)
                return o * 1.01, aux
            return bound.fn(replace(x, tensors={**x.tensors, "v": _ScaleGrad.apply(x.tensors["v"])}))

        return ops.BoundOp(op, impl, fn, bound.reference, bound.need_indices, bound.sources)

    monkeypatch.setattr(ops, "bind", bind)
    exp = _tiny_exp(direction=direction)
    point = dataclasses.replace(grid.expand(exp)[0], impl="perturbed")
    row = kernel.run_point(point, exp, torch.device("cpu"), platform="unit-cpu")
    check = row["check"]
    expected_outputs = {"o"} if direction == "fwd" else {"o", "dq", "dk", "dv"}
    assert set(check["outputs"]) == expected_outputs and check["tokens"] == 48
    if not failing:
        assert row["status"] == "ok" and check["status"] == "pass", row["message"]
        return
    assert row["status"] == "error" and check["status"] == "fail"
    assert row["message"].startswith("correctness check failed: ")
    assert set(re.findall(r"(\w+): max error \S+ exceeds bound", check["message"])) == failing
    assert check["message"] in row["message"]
    assert all(check["outputs"][name]["max_err"] > 1e-3 for name in failing)
    grid.validate(json.loads(json.dumps(row)), _result_schema(), "row")


def test_cli_and_aggregate(tmp_path, capsys):
    point_file = tmp_path / "point.yaml"
    point_file.write_text(json.dumps({**TINY, "op": "window", "direction": "fwd"}))
    out = tmp_path / "res" / "unit-cpu" / "kernel" / "w.json"
    args = ["bench-kernel", "--experiment", "kernel", "--smoke", "--point", str(point_file), "--out", str(out),
            "--platform", "unit-cpu"]
    assert cli.main(args) == 0
    rows.write_row({**json.loads(out.read_text()), "point": "copy", "impl": "other"}, out.with_name("x.json"))
    assert cli.main(["aggregate", "--experiment", "kernel", "--platform", "unit-cpu", "--results-dir", str(tmp_path / "res")]) == 0
    df = pd.read_csv(tmp_path / "res" / "unit-cpu" / "kernel.csv")
    assert list(df.columns[: len(results.COLUMNS)]) == list(results.COLUMNS)
    assert len(df) == 2 and set(df["status"]) == {"ok"} and set(df["op"]) == {"window"}
    assert results.load_table("unit-cpu", "kernel", tmp_path / "res").shape == df.shape
    assert results.load_table("nowhere", "kernel", tmp_path / "res").empty


def test_design_lists_the_columns():
    """DESIGN §2 names the columns every table starts with: the list the rows are built from."""
    text = (repo_root() / "docs" / "DESIGN.md").read_text()
    listed = re.search(r"read it the same way:\s*`([^`]+)`", text).group(1)
    assert tuple(c.strip() for c in listed.replace("\n", " ").split(",")) == rows.COLUMNS


def test_timing_summary_and_methods():
    t = timing.Timing([1.0, 2.0, 3.0, 4.0, 5.0], "wallclock")
    s = t.summary()
    assert s["median_ms"] == 3.0 and s["p20_ms"] == pytest.approx(1.8) and s["p80_ms"] == pytest.approx(4.2)
    calls = []
    t = timing.measure(lambda: calls.append(1), torch.device("cpu"), "auto", warmup=1, repeats=3)
    assert t.method == "wallclock" and len(t.samples_ms) == 3 and len(calls) == 5  # compile call + warmup + 3
    with pytest.raises(ValueError, match="CUDA"):
        timing.resolve_method("do_bench", torch.device("cpu"))


@pytest.mark.parametrize(
    "name, expected",
    [("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GeForce RTX 4090", "rtx4090"), ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb")],
)
def test_platform_names(name, expected):
    assert provenance.platform_from_gpu_name(name) == expected


def test_provenance_fields():
    """The provenance block names this machine's stack, not placeholders (here: the CPU test run
    under the Triton interpreter)."""
    import datetime

    import triton

    info = provenance.provenance()
    assert info["torch"] == torch.__version__ and info["triton"] == triton.__version__
    assert info["triton_interpret"] is True and info["platform"] == "cpu-interpret"
    assert info["gpu"] is None and info["driver"] is None and info["gpu_count"] == 0
    assert datetime.datetime.fromisoformat(info["timestamp"]).tzinfo is not None
    if (repo_root() / ".git").exists():  # a git checkout names its commit
        assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]), info["git_commit"]


def test_end_to_end_speedups_pair_each_panel_with_its_baselines():
    import pandas as pd

    rows = [  # (model, impl, block_size, topk, N, full_depth_ms, status)
        ("m", "fsa", 64, 16, 65536, 10.0, "ok"), ("m", "nsa", 64, 16, 65536, 12.0, "ok"),
        ("m", "fsa", 128, 8, 65536, 8.0, "ok"), ("m", "nsa", 128, 8, 65536, 12.0, "ok"),
        ("m", "sdpa_cudnn", 64, 16, 65536, 20.0, "ok"), ("m", "sdpa_flash", 64, 16, 65536, 16.0, "ok"),
        ("m", "fsa", 64, 16, 32768, 5.0, "ok"), ("m", "sdpa_cudnn", 64, 16, 32768, 1.0, "oom"),
    ]
    df = pd.DataFrame(rows, columns=["model", "impl", "block_size", "topk", "N", "full_depth_ms", "status"])
    df["median_ms"] = df["full_depth_ms"] / 2
    assert sorted(reproduction.e2e_vs_nsa(df, fsa="fsa")) == [1.2, 1.5]
    # The fastest full-attention impl of (model, N) serves both (B, T) panels; failed rows never count.
    assert sorted(reproduction.e2e_vs_full(df, "fsa", ("sdpa_flash", "sdpa_cudnn"))) == [1.6, 2.0]
    # By default the paper's kernel is judged, against FlashAttention-2 (SDPA's flash backend).
    assert reproduction.e2e_vs_nsa(df).empty
    paper = df.assign(impl=df["impl"].replace({"fsa": "fsa_paper"}))
    assert sorted(reproduction.e2e_vs_nsa(paper)) == [1.2, 1.5]
    assert sorted(reproduction.e2e_vs_full(paper)) == [1.6, 2.0]


def test_tensor_parallel_prefill_table_pairs_impls_and_drops_unwaited_module_times():
    import pandas as pd

    base = {"model": "llama3-8b", "block_size": 64, "topk": 16, "N": 32768, "status": "ok"}
    df = pd.DataFrame([
        {**base, "impl": "fsa", "world_size": 2, "median_ms": 800.0, "attention_ms_per_layer": 10.0,
         "split_kind": "waited"},
        {**base, "impl": "nsa", "world_size": 2, "median_ms": 1000.0, "attention_ms_per_layer": 13.0,
         "split_kind": "waited"},
        # A row from before the all-reduce was waited on: its prefill counts, its module time does not.
        {**base, "impl": "fsa", "world_size": 4, "median_ms": 500.0, "attention_ms_per_layer": 4.0},
        {**base, "impl": "nsa", "world_size": 4, "median_ms": 600.0, "attention_ms_per_layer": 5.0},
        # Single-GPU prefill rows are TP = 1; other models and failed rows never count.
        {**base, "impl": "fsa", "world_size": None, "median_ms": 1500.0},
        {**base, "impl": "nsa", "world_size": 1, "median_ms": 1500.0, "status": "oom"},
        {**base, "impl": "fsa", "world_size": 2, "median_ms": 1.0, "model": "qwen3-14b"},
        # A TP = 1 run of the tensor-parallel runner wins over a single-GPU prefill row, even a faster one.
        {**base, "impl": "fsa", "world_size": 1, "median_ms": 900.0, "block_size": 128, "topk": 8},
        {**base, "impl": "fsa", "world_size": 1, "median_ms": 1000.0, "block_size": 128, "topk": 8,
         "experiment": "prefill_tp"},
    ])
    tp = reproduction.tp_prefill(df, fsa="fsa").set_index("world_size")
    assert tp.loc[2, "fsa_s"] == 0.8 and tp.loc[2, "vs_nsa"] == 1.25 and tp.loc[2, "attn_vs_nsa"] == 1.3
    assert tp.loc[4, "vs_nsa"] == 1.2 and tp[["fsa_attn_ms", "attn_vs_nsa"]].loc[4].isna().all()
    single = tp[tp["block_size"] == 64]
    assert single.loc[1, "fsa_s"] == 1.5 and pd.isna(single.loc[1, "nsa_s"])
    assert tp[tp["block_size"] == 128].loc[1, "fsa_s"] == 1.0


def test_full_depth_measurement_beside_its_single_gpu_estimate(tmp_path):
    import pandas as pd

    keys = {"model": "llama3-8b", "N": 65536, "batch": 1, "block_size": 64, "topk": 16, "status": "ok"}
    single = pd.DataFrame([{**keys, "impl": "fsa", "full_depth_ms": 10000.0, "full_depth_kind": "estimate: ..."},
                           {**keys, "impl": "nsa", "full_depth_ms": 12000.0, "full_depth_kind": "measured"}])
    (tmp_path / "unit-gpux2").mkdir()
    pd.DataFrame([{**keys, "impl": "fsa", "world_size": 2, "median_ms": 9900.0},
                  {**keys, "impl": "nsa", "world_size": 2, "median_ms": 12100.0}]).to_csv(
        tmp_path / "unit-gpux2" / "train_fsdp.csv", index=False)
    (tmp_path / "unit-gpu-smoke").mkdir()  # not a multi-GPU host of unit-gpu
    pd.DataFrame([{**keys, "impl": "fsa", "median_ms": 1.0}]).to_csv(tmp_path / "unit-gpu-smoke" / "train_fsdp.csv")
    assert results.multi_gpu_hosts("unit-gpu", tmp_path) == ["unit-gpux2"]
    multi = results.multi_gpu_table("unit-gpu", "train_fsdp", tmp_path)
    assert list(multi["host"]) == ["unit-gpux2", "unit-gpux2"]
    gap = reproduction.full_depth_vs_estimate(single, multi)
    # Only estimated single-GPU rows pair up (nsa's single-GPU row was measured, not estimated).
    assert list(gap["impl"]) == ["fsa"] and gap["measured_vs_estimate"].iloc[0] == 0.99
    assert results.multi_gpu_table("unit-none", "train_fsdp", tmp_path).empty


def test_full_baseline_sums_fwd_and_bwd_where_fwd_bwd_was_not_timed():
    import pandas as pd

    shape = {"N": 8192, "batch": 1, "h_kv": 4, "g": 1, "d": 128, "dtype": "bfloat16", "op": "full_attention",
             "status": "ok"}
    df = pd.DataFrame([{**shape, "impl": "sdpa_cudnn", "direction": "fwd", "median_ms": 1.0},
                       {**shape, "impl": "sdpa_cudnn", "direction": "bwd", "median_ms": 2.5},
                       {**shape, "impl": "sdpa_flash", "direction": "fwd", "median_ms": 1.5},
                       {**shape, "impl": "sdpa_flash", "direction": "bwd", "median_ms": 2.5},
                       {**shape, "impl": "sdpa_flash", "direction": "fwd+bwd", "median_ms": 3.2}])
    best = reproduction.full_baseline(df).set_index("direction")
    assert best.loc["fwd", "full_impl"] == "sdpa_cudnn" and best.loc["bwd", "full_ms"] == 2.5
    # cuDNN's sum (3.5) loses to flash's own fwd+bwd timing (3.2); flash's sum is never made.
    assert best.loc["fwd+bwd", "full_impl"] == "sdpa_flash" and best.loc["fwd+bwd", "full_ms"] == 3.2


def test_paper_values_cover_every_table():
    pv = results.paper_values()
    assert {"theorem", "kernel", "breakdown", "ablation", "buffers", "longctx"} <= set(pv)
    assert Path(repo_root() / "analysis" / "paper_values.yaml").is_file()


NCU_CSV = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "_fsa_fwd": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","_fsa_fwd","1","7","(128, 1, 1)","(64, 4, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","1,024.5"
"0","4242","python3.12","127.0.0.1","_fsa_fwd","1","7","(128, 1, 1)","(64, 4, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","512"
"0","4242","python3.12","127.0.0.1","_fsa_fwd","1","7","(128, 1, 1)","(64, 4, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","250"
"1","4242","python3.12","127.0.0.1","_reduce","1","7","(32, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","100"
"""


def test_ncu_csv_parsing_and_model():
    from fsalab.bench import dram

    kernels = dram.parse_ncu_csv(NCU_CSV)
    assert [k["kernel"] for k in kernels] == ["_fsa_fwd", "_reduce"]
    assert kernels[0]["read_bytes"] == pytest.approx(1024.5e6) and kernels[0]["write_bytes"] == pytest.approx(512e3)
    assert kernels[0]["time_ms"] == pytest.approx(0.25) and kernels[1]["read_bytes"] == 100
    assert dram.parse_ncu_csv("no csv here") == []
    short = NCU_CSV.replace('"usecond","250"', '"ns","250000"').replace('"Mbyte"', '"MB"')
    assert dram.parse_ncu_csv(short)[0]["time_ms"] == pytest.approx(0.25)  # the H200's ncu prints "ns"
    assert dram.parse_ncu_csv(short)[0]["read_bytes"] == pytest.approx(1024.5e6)
    with pytest.raises(ValueError, match="unknown Nsight Compute unit"):
        dram.parse_ncu_csv(NCU_CSV.replace('"usecond"', '"fortnight"'))
    p = dataclasses.replace(grid.expand(_tiny_exp())[0], impl="nsa", N=65536, batch=1, h_kv=4, g=4, d=128,
                            block_size=64, topk=16, dtype="bfloat16", direction="fwd")
    nsa = dram.model_bytes(p)
    fsa = dram.model_bytes(dataclasses.replace(p, impl="fsa_paper"))
    assert set(nsa) == {"paper", "causal", "fsalab"} and fsa["paper"] / nsa["paper"] == pytest.approx(0.2133, abs=5e-4)
    assert dram.model_bytes(dataclasses.replace(p, direction="bwd")) == {}  # the models cover the forward only


def test_dram_without_ncu_is_unsupported():
    from fsalab.bench import dram

    exp = grid.load_experiment("dram", smoke=True)
    row = dram.run_point(grid.expand(exp)[0], exp, torch.device("cpu"), platform="unit-cpu")
    assert row["status"] == "unsupported" and "ncu" in row["message"]
    grid.validate(json.loads(json.dumps(row)), _result_schema(), "row")


def test_cli_option_flag_reaches_the_impl(tmp_path):
    """--option key=value lands in the point's options (and its id); the reference impl has no
    such switch, so the row is 'unsupported' rather than a crash."""
    out = tmp_path / "o.json"
    args = ["bench-kernel", "--experiment", "ablation", "--smoke", "--op", "selected", "--impl", "reference",
            "--direction", "fwd", "--N", "64", "--g", "1", "--option", "inner_loop=false", "--out", str(out)]
    assert cli.main(args) == 0
    row = json.loads(out.read_text())
    assert row["options"] == {"inner_loop": False} and "-innerloop0-" in row["point"]
    assert row["status"] == "unsupported" and "inner_loop" in row["message"]


def test_smoke_e2e_points_give_valid_rows(tmp_path):
    """One smoke point each of train and prefill through their command lines (as the workflow
    runs them), then the aggregate: schema-valid rows with the DESIGN columns."""
    from fsalab.bench import prefill, train

    for name, runner in (("train", train), ("prefill", prefill)):
        exp = grid.load_experiment(name, smoke=True)
        point = next(p for p in grid.expand(exp) if p["impl"] == "reference")
        assert [p["id"] for p in grid.expand(exp, points.e2e_base(name))] == [p["id"] for p in grid.expand(exp)]
        out = tmp_path / "cpu-test" / name / f"{point['id']}.json"
        assert runner.main(["--experiment", name, "--smoke", "--point", point["id"], "--platform", "cpu-test",
                            "--out", str(out)]) == 0
        df = results.to_frame(results.load_rows("cpu-test", name, tmp_path))  # schema-checked
        assert list(df.columns[: len(results.COLUMNS)]) == list(results.COLUMNS)
        row = df.iloc[0]
        assert row["status"] == "ok" and row["median_ms"] > 0 and row["model"] == point["model"]
        assert row["attention_ms_per_layer"] > 0 and row["full_depth_ms"] >= row["median_ms"]
        assert results.aggregate("cpu-test", name, tmp_path).is_file()


def test_convergence_gaps_set_fsa_nsa_beside_the_nsa_noise_floor():
    """The FSA-NSA loss gap is taken at the steps both runs logged; a second NSA run with another
    window branch is the noise floor; a task without one reports NaN for it, never zero."""
    import math

    import pandas as pd

    def run(impl, losses, window="auto", span=32, acc=0.9):
        return {"impl": impl, "window_impl": window, "gate_impl": "auto", "needle_span": span, "steps": 3, "status": "ok",
                "final_accuracy_far": acc, "curve": {"step": [0, 1, 2], "loss": losses}}

    df = pd.DataFrame([
        run("fsa", [2.0, 1.0, 0.50]), run("nsa", [2.0, 1.1, 0.51]), run("sdpa_flash", [2.0, 0.1, 0.0], acc=1.0),
        run("nsa", [2.0, 1.0, 0.55], window="reference"),
        run("fsa", [2.0, 2.0, 2.0], span=1), run("nsa", [2.1, 2.0, 2.0], span=1),
        {**run("nsa", [0.0, 0.0, 0.0], span=1), "status": "error"},
    ])
    assert reproduction.run_label(df.iloc[3]) == "nsa (window reference)"
    assert reproduction.run_label({**df.iloc[1], "gate_impl": "reference"}) == "nsa (gate reference)"
    gaps = reproduction.convergence_gaps(df).set_index("needle_span")
    span32 = gaps.loc[32]
    assert span32["fsa_nsa_max_gap"] == pytest.approx(0.1) and span32["fsa_nsa_first_step_over"] == 1
    assert span32["nsa_nsa_median_gap"] == pytest.approx(0.04) and span32["nsa_nsa_first_step_over"] == 1
    assert span32["acc_far_full"] == 1.0
    assert gaps.loc[1, "fsa_nsa_median_gap"] == pytest.approx(0.0) and gaps.loc[1, "fsa_nsa_first_step_over"] == 0
    assert math.isnan(gaps.loc[1, "nsa_nsa_median_gap"]) and math.isnan(gaps.loc[1, "acc_far_full"])


def test_nsa_attention_gate_impl_option(device):
    """The nsa_attention op's gate_impl (the module's name for the choice) picks the gated sum for
    the A/B of the fused kernel: the fused kernel runs only where the row's sources say so, both
    give the same output, and an unknown name is unsupported."""
    from fsalab.bench import ops
    from fsalab.bench.kernel import nsa_attention_calls
    from fsalab.testing import LaunchCounter

    assert ops.bind("nsa_attention", "fsa").sources["gate"] == "triton"
    assert ops.bind("nsa_attention", "reference").sources["gate"] == "reference"
    assert ops.bind("nsa_attention", "fsa", {"gate_impl": "reference"}).sources["gate"] == "reference"
    with pytest.raises(ops.Unsupported, match="gate_impl"):
        ops.bind("nsa_attention", "fsa", {"gate_impl": "fused"})
    outputs = []
    for options, fused_launches in ((None, 1), ({"gate_impl": "reference"}, 0)):
        call = nsa_attention_calls("fsa", 128, 1, 2, 16, 32, 4, device=device, options=options)[0]
        with LaunchCounter() as launches:
            outputs.append(call())
        assert launches.counts["triton:_gated_sum_fwd"] == fused_launches, options
    fused, torch_ops = outputs
    assert torch.equal(fused[1], torch_ops[1])  # same blocks selected
    torch.testing.assert_close(fused[0], torch_ops[0], atol=2e-3, rtol=2e-3)  # fp16, rounded once vs per op


@pytest.mark.parametrize("kernel_size,kernel_stride", [(32, 16), (16, 16), (32, 8)])
def test_closed_form_flops_match_the_runners_key_counts(kernel_size, kernel_stride):
    """bench.flops' per-sequence counts (what the notebooks use without torch) equal the keys the
    runners count on packed inputs (``attended_keys``), for sequences shorter than, equal to and
    longer than kernel_size."""
    from fsalab.bench import flops
    from fsalab.bench.inputs import Inputs, attended_keys
    from fsalab.config import NSAConfig
    from fsalab.testing import cu_seqlens_of

    cfg = NSAConfig(kernel_size=kernel_size, kernel_stride=kernel_stride, block_size=32, topk=4, window_size=64)
    lengths, h, h_kv, d = [5, kernel_size - 1, kernel_size, kernel_size + 1, 300], 6, 2, 16
    total = sum(lengths)
    cu = cu_seqlens_of(lengths)
    x = Inputs({"q": torch.zeros(total, h, d), "k": torch.zeros(total, h_kv, d)},
               torch.full((total, h_kv, cfg.topk), -1, dtype=torch.int32), cu, cfg, max(lengths))
    keys = attended_keys(x)
    for n in lengths:  # brute force per position
        assert cfg.visible_compressed_keys(n) == sum(cfg.num_compressed(t + 1) for t in range(n))
    assert keys["compressed"] == h * sum(cfg.visible_compressed_keys(n) for n in lengths)
    assert keys["full_attention"] * 4 * d == sum(flops.causal_attention_flops(n, h, d) for n in lengths)
    rows_cmp = sum(cfg.num_compressed(n) for n in lengths)
    cmp_only = {"compressed": keys["compressed"]}
    assert flops.useful_flops("compressed", cmp_only, d, cfg, h_kv, rows_cmp) == pytest.approx(
        sum(sum(flops.compression_branch_parts(n, h, h_kv, d, cfg).values()) for n in lengths))


def test_compression_flops_by_hand():
    """The compression branch's useful FLOPs for one tiny sequence, counted by hand (2 per
    multiply-add), through the closed form and through the runner's key count on packed inputs.

    n = 64 tokens, h = 2 query heads, h_kv = 1, d = 16, l = 32, s = 16:
    - compressed tokens: windows start at 0, 16, 32 (a window at 48 would end past token 63): 3.
    - visible (query, compressed key) pairs: token j covers [16j, 16j + 31], seen by positions
      16j + 31 ... 63, i.e. 33, 17, 1 positions: 51 per head, 102 over both heads.
    - maps: K and V each map l·d = 512 inputs to d = 16 outputs per compressed token and KV head:
      2 maps x 512 x 16 multiply-adds x 2 = 32768 FLOPs, x 3 tokens = 98304.
    - attention: QKᵀ and PV, d multiply-adds each per pair: 4 x 16 x 102 = 6528.
    - scoring: QKᵀ again for the block scores: 2 x 16 x 102 = 3264.
    - forward total: 98304 + 6528 + 3264 = 108096."""
    from fsalab.bench import flops
    from fsalab.bench.inputs import Inputs, attended_keys
    from fsalab.config import NSAConfig
    from fsalab.testing import cu_seqlens_of

    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=32, topk=4, window_size=64)
    n, h, h_kv, d = 64, 2, 1, 16
    assert cfg.num_compressed(n) == 3 and cfg.visible_compressed_keys(n) == 33 + 17 + 1
    parts = flops.compression_branch_parts(n, h, h_kv, d, cfg)
    assert parts == {"maps": 98304.0, "attention": 6528.0, "scoring": 3264.0}
    assert flops.compression_branch_parts(n, h, h_kv, d, cfg, batch=2) == {k: 2 * v for k, v in parts.items()}
    x = Inputs({"q": torch.zeros(n, h, d), "k": torch.zeros(n, h_kv, d)},
               torch.full((n, h_kv, cfg.topk), -1, dtype=torch.int32), cu_seqlens_of([n]), cfg, n)
    keys = attended_keys(x)
    assert keys["compressed"] == 102
    assert flops.useful_flops("compressed", keys, d, cfg, h_kv, cfg.num_compressed(n)) == 108096
    # Causal full attention over the same sequence: 64 x 65 / 2 = 2080 keys per head, 4 x 16 x 2 x 2080.
    assert flops.useful_flops("full_attention", keys, d, cfg, h_kv, 0) == flops.causal_attention_flops(n, h, d) == 266240
