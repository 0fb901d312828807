"""The side-by-side runner (fsalab.bench.versus), interleaved timing and CUDA-graph capture."""

import math

import pytest
import torch

from fsalab import results, settings
from fsalab.bench import grid, ops, timing, versus
from fsalab.bench.inputs import make_inputs

TINY = {"batch": 1, "h_kv": 1, "d": 32, "dtype": "float16", "kernel_size": 16, "kernel_stride": 16,
        "block_size": 16, "topk": 4, "window_size": 32}
CPU_TIMING = {"method": "wallclock", "warmup": 0, "rounds": 1, "min_rounds": 1, "rep_ms": 1, "budget_ms": 1,
              "max_rounds": 1, "memory": False}


def _experiment(contenders, timing_cfg, defaults=TINY, **axes) -> dict:
    exp = {"experiment": "versus_test", "description": "test", "feeds": ["test"], "runner": "versus",
           "defaults": dict(defaults), "timing": dict(timing_cfg), "check": {"max_tokens": 64},
           "grid": [{"contender": contenders, **{k: v for k, v in axes.items()}}]}
    return grid.validate(exp, grid.load_schema("experiment"), "test experiment")


def test_smoke_group_writes_a_row_per_impl(tmp_path):
    """Through the interpreter: every impl of the smoke group gets an ok, checked row with samples,
    the branch split (NSA rows), the ratio fields, and a clean 'no CUDA' graph status."""
    exp = grid.load_experiment("versus", smoke=True)
    points = grid.expand(exp)
    assert {p["impl"] for p in points} == {"auto", "fsa", "nsa", "sdpa_math"}
    paths = versus.run_points(points[:1], exp, torch.device("cpu"), tmp_path, "cpu-test")  # the filter picks a group
    assert len(paths) == 4
    rows = {r["impl"]: r for r in results.load_rows("cpu-test", "versus", tmp_path)}  # schema-checked
    assert set(rows) == {"auto", "fsa", "nsa", "sdpa_math"}
    base = rows["sdpa_math"]["median_ms"]
    for impl, row in rows.items():
        assert row["status"] == "ok", row["message"]
        assert row["check"]["status"] == "pass"
        assert row["samples_ms"] and row["median_ms"] > 0
        assert row["graph_status"] == "unsupported: no CUDA" and row.get("graph_median_ms") is None
        assert row["baseline_impl"] == "sdpa_math" and row["cudnn_median_ms"] == base
        assert row["ratio_to_cudnn"] == pytest.approx(base / row["median_ms"])
        assert row["graph_ratio_to_cudnn"] is None
        assert row["useful_tflops"] > 0
        assert row["timing"]["interleaved"][:4] == [p["id"] for p in points]
    for impl in ("auto", "fsa", "nsa"):
        split = rows[impl]["split_ms"]
        assert set(split) == set(versus.BRANCHES) and all(v > 0 for v in split.values()), split
        assert rows[impl]["split_status"] == "ok"
    assert "split_ms" not in rows["sdpa_math"]
    # selected attention is the only branch that differs between the NSA impls
    assert rows["fsa"]["split_ms"]["compression"] == rows["nsa"]["split_ms"]["compression"]
    table = results.to_frame(list(rows.values()))
    assert table["split_selected_ms"].notna().sum() == 3


def test_interleaved_calls_round_robin_each_round_one_place_later():
    calls = []

    def fake(name):
        return lambda: calls.append(name)

    out = timing.interleaved({n: fake(n) for n in "abc"}, torch.device("cpu"), "wallclock",
                             timing.Rounds(rounds=3, min_rounds=1, rep_ms=0.0, budget_ms=1e9, max_rounds=10), warmup=1)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")  # a warm-up round, three rotated ones
    assert all(len(t.samples_ms) == 3 for t in out.values())


def test_interleaved_stops_slow_and_failing_callables_but_goes_on():
    calls = []
    n = {"boom": 0}

    def boom():
        n["boom"] += 1
        calls.append("boom")
        if n["boom"] > 2:
            raise RuntimeError("boom")

    out = timing.interleaved({"ok": lambda: calls.append("ok"), "boom": boom}, torch.device("cpu"), "wallclock",
                             timing.Rounds(rounds=4, min_rounds=1, rep_ms=0.0, budget_ms=1e9), warmup=1)
    assert isinstance(out["boom"], RuntimeError) and len(out["ok"].samples_ms) == 4
    assert calls == ["ok", "boom", "ok", "boom", "boom", "ok", "ok", "ok"]  # the second round starts at "boom"


@pytest.mark.parametrize(("n", "total", "active"), [
    (0, 0.0, True), (2, 1e6, True),       # below min_rounds: always
    (3, 3000.0, False),                     # slow: budget spent after min_rounds
    (5, 200.0, True), (10, 200.0, False),   # rounds reached and rep_ms spent
    (10, 50.0, True), (100, 50.0, False),   # fast: until rep_ms, at most max_rounds
])
def test_rounds_stopping_rule(n, total, active):
    assert timing.Rounds(rounds=10, min_rounds=3, rep_ms=100.0, budget_ms=3000.0, max_rounds=100).active(n, total) is active


def test_capture_graph_refuses_cleanly_without_cuda():
    called = []
    cap = timing.capture_graph(lambda: called.append(1), torch.device("cpu"))
    assert cap.status == "unsupported: no CUDA" and not cap.ok and cap.replay is None
    assert called == []


def test_a_failing_contender_is_an_error_row_and_the_others_land(tmp_path, monkeypatch):
    """reference impls (fast on CPU): one contender's op fails once timing starts (after its
    correctness check passed), one does not bind at all; the other rows are complete."""
    real_bind = ops.bind

    def bind(op, impl, options=None):
        if impl != "flaky":
            return real_bind(op, impl, options)
        bound = real_bind(op, "reference", options)
        calls = {"n": 0}

        def fn(x):
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("kernel exploded")
            return bound.fn(x)

        return ops.BoundOp(op, impl, fn, bound.reference, bound.need_indices, bound.sources)

    real_parts, real_known = ops.nsa_parts, ops.known_impls
    monkeypatch.setattr(ops, "bind", bind)
    # Both names pass the grid's typo check (as a registered impl would); "no_such_impl" then
    # fails to bind, like an impl missing on this machine.
    monkeypatch.setattr(ops, "known_impls", lambda op: (*real_known(op), "flaky", "no_such_impl"))
    monkeypatch.setattr(ops, "nsa_parts", lambda impl, options=None: real_parts("reference" if impl == "flaky" else impl, options))
    exp = _experiment([{"op": "nsa_attention", "impl": "reference"}, {"op": "nsa_attention", "impl": "flaky"},
                       {"op": "nsa_attention", "impl": "no_such_impl"}, {"op": "full_attention", "impl": "reference"}],
                      CPU_TIMING, direction=["fwd+bwd"], g=[2], N=[64])
    paths = versus.run_points(grid.expand(exp), exp, torch.device("cpu"), tmp_path, "cpu-test")
    assert len(paths) == 4
    rows = {r["impl"]: r for r in results.load_rows("cpu-test", "versus_test", tmp_path)}
    assert rows["flaky"]["status"] == "error" and "kernel exploded" in rows["flaky"]["message"]
    assert rows["no_such_impl"]["status"] == "unsupported"
    row = rows["reference"]
    assert row["status"] == "ok", row["message"]
    assert row["split_status"] == "ok" and all(v > 0 for v in row["split_ms"].values())
    assert row["ratio_to_cudnn"] == pytest.approx(row["cudnn_median_ms"] / row["median_ms"])
    assert rows["flaky"]["split_status"] == "ok"  # its branches ran; only the whole op failed


def test_filter_selects_whole_groups():
    exp = _experiment([{"op": "nsa_attention", "impl": "fsa"}, {"op": "full_attention", "impl": "sdpa_math"}],
                      CPU_TIMING, direction=["fwd", "fwd+bwd"], g=[1, 2], N=[64])
    points = grid.expand(exp)
    picked = [p for p in points if "fullattention" in p["id"] and "g2" in p["id"]]
    groups = versus.groups_of(points, picked)
    assert len(groups) == 2 and all(len(g) == 2 and g[0]["g"] == 2 for g in groups)
    assert {g[0]["direction"] for g in groups} == {"fwd", "fwd+bwd"}


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["auto", "fsa"])
def test_whole_nsa_attention_replays_from_a_cuda_graph(impl, direction, monkeypatch, tmp_path):
    """The whole NSA attention (bench op nsa_attention) captures into a CUDA graph whose replay
    rewrites its outputs (poisoned first) with the eager values and leaves its inputs alone."""
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    settings.configure(value_checks=False)
    device = torch.device("cuda")
    exp = _experiment([{"op": "nsa_attention", "impl": impl}], CPU_TIMING, defaults={"h_kv": 4, "d": 128},
                      direction=[direction], g=[4], N=[4096])
    p = grid.expand(exp)[0]
    inputs = make_inputs(p, device)
    bound = ops.bind("nsa_attention", impl)
    x = inputs.with_leaves(bound.grad_args) if direction != "fwd" else inputs
    leaves = [x.tensors[n] for n in bound.grad_args] if direction != "fwd" else []
    do = torch.randn_like(inputs.tensors["q"]) if direction != "fwd" else None
    fn = versus._directional(lambda: bound.fn(x)[0], leaves, do, direction)
    eager = [t.detach().clone() for t in _flat(fn())]
    before = {n: t.detach().clone() for n, t in x.tensors.items()}
    cap = timing.capture_graph(fn, device)
    assert cap.ok, cap.status
    outs = _flat(cap.outputs)
    assert len(outs) == len(eager)
    for _ in range(2):
        for t in outs:
            t.fill_(math.nan)
        cap.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, eager):
            scale = want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * max(scale, 1.0))
    for n, t in x.tensors.items():
        assert torch.equal(t.detach(), before[n]), f"replay changed input {n}"
    cap.free()


@pytest.mark.gpu
def test_versus_group_on_gpu(tmp_path, monkeypatch):
    """A small group on the GPU: four ok rows, every one replayed from a CUDA graph."""
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    exp = _experiment([{"op": "nsa_attention", "impl": i} for i in ("auto", "fsa", "nsa")]
                      + [{"op": "full_attention", "impl": "sdpa_cudnn"}],
                      {"rounds": 3, "min_rounds": 2, "rep_ms": 5, "budget_ms": 100, "max_rounds": 5},
                      defaults={"h_kv": 4, "d": 128}, direction=["fwd+bwd"], g=[4], N=[4096])
    versus.run_points(grid.expand(exp), exp, torch.device("cuda"), tmp_path, "gpu-test")
    rows = {r["impl"]: r for r in results.load_rows("gpu-test", "versus_test", tmp_path)}
    assert set(rows) == {"auto", "fsa", "nsa", "sdpa_cudnn"}, sorted(rows)
    for impl, row in rows.items():
        assert row["status"] == "ok", row["message"]
        assert row["check"]["status"] == "pass", (impl, row["check"])
        assert row["graph_status"] == "ok", (impl, row["graph_status"])
        assert row["graph_median_ms"] > 0 and row["graph_ratio_to_cudnn"] > 0
    for impl in ("auto", "fsa", "nsa"):
        assert all(v > 0 for v in rows[impl]["split_ms"].values()), rows[impl]["split_ms"]
