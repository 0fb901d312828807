"""The decode runner (fsalab.bench.decode): point expansion, CPU smoke rows of each op."""

import pytest
import torch

from fsalab import results
from fsalab.bench import decode, grid


def _exp(name):
    return grid.load_experiment(name, smoke=True)


def test_published_grids_expand():
    ops = {name: {p["op"] for p in grid.expand(grid.load_experiment(name))} for name in ("decode", "inference", "generate")}
    assert ops == {"decode": {"decode_step"}, "inference": {"inference"}, "generate": {"generate"}}
    table10 = grid.expand(grid.load_experiment("decode"))
    assert {p["N"] for p in table10 if p["batch"] == 1} == {32768, 65536, 131072, 262144}
    assert {p["batch"] for p in table10 if p["N"] == 65536} == {1, 8, 32}
    assert {p["g"] for p in table10 if p["batch"] == 1} == {1, 4}
    assert all(p["h_kv"] * p["g"] == 64 and p["d"] == 128 and p["steps"] >= 1024 for p in table10)
    tables89 = grid.expand(grid.load_experiment("inference"))
    assert {(p["g"], p["h_kv"]) for p in tables89} == {(1, 64), (2, 32), (4, 16), (8, 8)}
    assert all(p["steps"] == 512 for p in tables89)


@pytest.mark.parametrize("bad,match", [({"impl": "flashdecoding"}, "impl of op"), ({"op": "prefill"}, "op must be"),
                                       ({"stesp": 3}, "unknown decode parameters")])
def test_config_errors(bad, match):
    exp = _exp("decode")
    exp["grid"] = [{**exp["grid"][0], **{k: [v] for k, v in bad.items()}}]
    with pytest.raises(ValueError, match=match):
        grid.expand(exp)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter")
def test_smoke_rows(decode_smoke_rows):
    """Every smoke point of the three experiments gives a schema-valid row: ok and checked for the
    NSA step (Triton and reference), SDPA and the ops inference / generate; unsupported for the
    CUDA-only libraries (flash-attn, FlashInfer), installed or not."""
    for name in ("decode", "inference", "generate"):
        rows = decode_smoke_rows(name, torch.device("cpu"))
        for row in rows:
            cuda_only = row["impl"] in ("flash_attn", "flashinfer")
            assert row["status"] == ("unsupported" if cuda_only else "ok"), row["message"]
            if row["status"] == "ok":
                assert row["check"]["status"] == "pass", row["check"]
                assert row["median_ms"] > 0 and len(row["samples_ms"]) >= 1
        if name == "generate":
            for r in rows:
                assert r["tokens_per_s"] > 0 and len(r["prefill_samples_ms"]) == len(r["samples_ms"])
                assert r["mean_step_ms"] == pytest.approx((r["median_ms"] - r["prefill_ms"]) / (r["steps"] - 1))
                # a 2-layer slice of a 40-layer model: also timed at 1 layer, extended to 40 (or,
                # on a noisy CPU, said to be impossible)
                assert r["half_layers"] == 1 and r["full_depth_layers"] == 40
                assert len(r["half_samples_ms"]) == len(r["half_prefill_samples_ms"]) == len(r["samples_ms"])
                if r["full_depth_kind"].startswith("estimate"):
                    assert r["full_depth_ms"] > r["median_ms"] and r["full_depth_tokens_per_s"] < r["tokens_per_s"]
                else:
                    assert r["full_depth_kind"].startswith("none: the 2-layer slice was not slower")
        if name == "inference":
            assert all(r["median_ms"] > r["prefill_ms"] for r in rows)



def test_generate_runs_with_expandable_segments(monkeypatch):
    """The generate experiment names its allocator setting; the CLI sets it before CUDA starts,
    refuses a different value already in the environment, and every row records the value."""
    from fsalab import cli
    from fsalab.bench import provenance

    exp = grid.load_experiment("generate")
    assert exp["cuda_alloc_conf"] == "expandable_segments:True"
    assert "cuda_alloc_conf" not in grid.load_experiment("decode")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cli._apply_alloc_conf(exp)
    assert provenance.provenance()["cuda_alloc_conf"] == "expandable_segments:True"
    cli._apply_alloc_conf(exp)  # the same value again is fine
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(SystemExit, match="expandable_segments:True.*max_split_size_mb:512"):
        cli._apply_alloc_conf(exp)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert provenance.provenance()["cuda_alloc_conf"] is None


def test_generate_depth_estimate_and_first_layers():
    """The full-depth estimate extends the slope of two slices; a model runs its first n layers
    inside _first_layers (same modules) and is whole again after, an exception included."""
    from fsalab.models import configs

    assert decode._depth_estimate(10.0, 16.0, 2, 4, 32) == pytest.approx(16.0 + 28 * 3.0)
    assert decode._depth_estimate(10.0, 16.0, 2, 4, 4) == 16.0
    # Qwen2.5-32B, 8 x 64K in bf16: 65.5 GB of weights + 64 layers x 8 x 65664 tokens x 8 KV heads
    # x 128 x (K, V) x 2 B of cache, over one H200's 141 GB
    point = {"model": "qwen2.5-32b", "dtype": "bfloat16", "batch": 8, "N": 65536, "steps": 128}
    assert decode._inference_memory_floor(point) == 2 * 32_763_876_352 + 64 * 8 * 65664 * 8 * 128 * 2 * 2
    lm = configs.build_model("qwen3-14b", 4, "cpu", torch.float32, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    layers, ran = list(lm.model.layers), []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    ids = torch.randint(0, 64, (1, 8))
    with decode._first_layers(lm, 2):
        assert lm.config.num_hidden_layers == 2 and len(lm.config.layer_types) == 2
        lm(ids)
    assert ran == [0, 1]
    with pytest.raises(RuntimeError, match="inside"), decode._first_layers(lm, 1):
        raise RuntimeError("inside")
    assert list(lm.model.layers) == layers and lm.config.num_hidden_layers == 4 and len(lm.config.layer_types) == 4
    ran.clear()
    lm(ids)
    assert ran == [0, 1, 2, 3]


def test_generate_full_depth_columns():
    """A whole model is measured; a slice is extended from its two depths' medians, with the
    range of the estimates of each back-to-back pair of samples beside it; a slice no slower than
    its half gives no estimate, and a slice with a measured peak estimates the whole model's; the
    generate experiment runs whole models at batch 1 and where batch 8 fits."""
    point = {"model": "qwen3-14b", "dtype": "bfloat16", "batch": 2, "N": 1024, "steps": 11}
    whole = decode._full_depth({"median_ms": 50.0, "prefill_ms": 10.0}, point, {40: ([50.0], [10.0])}, (40,), 40)
    assert whole["full_depth_kind"] == "measured" and whole["full_depth_ms"] == 50.0
    assert whole["full_depth_step_ms"] == pytest.approx(4.0) and "full_depth_ms_low" not in whole
    assert whole["full_depth_tokens_per_s"] == pytest.approx(2 * 11 / 0.05)
    samples = {2: ([10.0, 12.0, 11.0], [4.0, 4.0, 4.0]), 4: ([16.0, 15.0, 17.0], [6.0, 6.0, 6.0])}
    row = {"median_ms": 16.0, "prefill_ms": 6.0}
    est = decode._full_depth(row, point, samples, (2, 4), 40)
    assert est["full_depth_kind"].startswith("estimate") and est["half_median_ms"] == 11.0
    assert "full_depth_peak_gib" not in est  # no measured peak (CPU), no estimate of it
    # Qwen3-14B in bf16: 330 312 064 weights a decoder layer, K/V of 2 x 1035 tokens x 8 heads x 128
    layer = (330_312_064 + 2 * 1035 * 8 * 128 * 2) * 2
    assert decode._model_bytes(point) == (2 * 151936 * 5120 * 2, layer)
    peaked = decode._full_depth({**row, "peak_mem_gib": 5.0}, point, samples, (2, 4), 40)
    assert peaked["full_depth_peak_gib"] == pytest.approx(5.0 + 36 * layer / 2**30)
    assert est["full_depth_ms"] == pytest.approx(16.0 + 36 * 2.5)
    pairs = [16.0 + 36 * 3.0, 15.0 + 36 * 1.5, 17.0 + 36 * 3.0]
    assert (est["full_depth_ms_low"], est["full_depth_ms_high"]) == pytest.approx((min(pairs), max(pairs)))
    flat = decode._full_depth({"median_ms": 11.0, "prefill_ms": 6.0}, point, samples, (2, 4), 40)
    assert flat["full_depth_kind"].startswith("none") and "full_depth_ms" not in flat
    # the grid: whole models (ids -Lfull-) at batch 1 and wherever batch 8 fits, 4-layer slices else
    points = grid.expand(grid.load_experiment("generate"))
    assert all(("-Lfull-" in p["id"]) == (p["layers"] == 0) for p in points)
    assert all(p["layers"] in (0, 4) for p in points) and all(p["layers"] == 0 for p in points if p["batch"] == 1)


def test_depth_pairs_script_recomputes_the_stored_estimates(capsys, monkeypatch):
    """scripts/generate_depth_pairs.py rebuilds a row's full-depth columns from the samples the
    row keeps, with the runner's ``_full_depth``: every column comes out of that function itself
    (not the stored row the script merges it into), equal to those the runner wrote on the
    committed H200 rows (the pairs' range too, where the row has it); one row's estimate equals
    the slope extended by hand; its tables print."""
    import importlib.util
    import statistics
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts/generate_depth_pairs.py"
    spec = importlib.util.spec_from_file_location("generate_depth_pairs", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = [r for r in results.load_rows("h200", "generate", path.parents[1] / "results")
            if r["status"] == "ok" and str(r.get("full_depth_kind", "")).startswith("estimate")]
    assert rows
    real, produced = decode._full_depth, []

    def full_depth(*args):  # the function's own return value, before the script merges it into the row
        produced.append(real(*args))
        return produced[-1]

    monkeypatch.setattr(decode, "_full_depth", full_depth)
    stored_in_every_row = ("full_depth_ms", "full_depth_prefill_ms", "full_depth_tokens_per_s", "full_depth_step_ms",
                           "full_depth_floor_gib", "full_depth_layers", "half_layers", "half_median_ms", "half_prefill_ms")
    # rows measured before the runner recorded the range (and the peak) get these from the script
    stored_where_recorded = ("full_depth_ms_low", "full_depth_ms_high", "full_depth_tokens_per_s_low",
                             "full_depth_tokens_per_s_high", "full_depth_peak_gib")
    for row in rows:
        produced.clear()
        again = script.full_depth(row)
        assert len(produced) == 1
        own = produced[0]
        assert own["full_depth_kind"].startswith("estimate")
        for key in stored_in_every_row + stored_where_recorded:
            assert key in own, key
            assert again[key] == own[key], key
            if key in stored_in_every_row or key in row:
                assert own[key] == pytest.approx(row[key], rel=1e-12), key
    # By hand, on one slice row (a 4-layer slice and its 2-layer half of Qwen2.5-32B at 8 x 32K):
    # extended to the model's 64 layers as whole + (64 - 4) * (whole - half) / (4 - 2), on the
    # medians of the stored samples.
    row = next(r for r in rows if "-b8-qwen2.5-32b-L4-" in r["point"])
    assert (row["half_layers"], row["layers"], row["full_depth_layers"]) == (2, 4, 64)
    whole, half = statistics.median(row["samples_ms"]), statistics.median(row["half_samples_ms"])
    produced.clear()
    script.full_depth(row)
    assert produced[0]["full_depth_ms"] == pytest.approx(whole + (64 - 4) * (whole - half) / (4 - 2), rel=1e-12)
    prefill, half_prefill = statistics.median(row["prefill_samples_ms"]), statistics.median(row["half_prefill_samples_ms"])
    assert produced[0]["full_depth_prefill_ms"] == pytest.approx(prefill + (64 - 4) * (prefill - half_prefill) / (4 - 2),
                                                                 rel=1e-12)
    for flags in ([], ["--peaks"]):
        assert script.main(["--results-dir", str(path.parents[1] / "results"), *flags]) == 0
    table = capsys.readouterr().out
    assert "| qwen2.5-32b | 32K | 8 | 4 |" in table and "whole-model peak" in table  # a slice for good: no GPU holds it
