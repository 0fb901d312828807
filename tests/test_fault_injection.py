"""Fault injection (CPU): each way a mistake used to lose, mix up or silently change results,
run on purpose, with the promise it must now keep.

- A failed point is a row, whatever raises and wherever (batch and per-point mode, kernel and
  end-to-end runners), and the command exits 0 so Snakemake keeps every file of the job.
- Point ids hash every measured parameter: no two configurations share a file; committed
  results carry the new ids (migrated, not re-measured) and their CSVs match their files.
- A row measured on one machine never lands in, replaces a row of, or is aggregated into another
  machine's results folder without --force.
- Misspelt parameters, axes, impl and model names and unknown experiments are errors.
- A failing notebook leaves its figures folder as it was; notebooks write only into their own.
- NaN/Inf stays where attention can see it: not in earlier tokens, other sequences or padding.
- Bad module and op inputs get clear errors.
"""

import fnmatch
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import torch
import yaml

from fsalab import cli, plotting, results
from fsalab.bench import grid, kernel, points, provenance, rows, train
from fsalab.bench.repo import repo_root
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.selected import reference as selected_ref
from fsalab.ops.selected import resolve, selected_attention
from fsalab.ops.window import reference as window_ref
from fsalab.testing import LaunchCounter, cu_seqlens_of

ROOT = repo_root()
TINY = {"op": "selected", "impl": "reference", "direction": "fwd", "batch": 1, "h_kv": 1, "g": 2, "d": 16,
        "kernel_size": 16, "kernel_stride": 16, "block_size": 16, "topk": 3, "window_size": 32, "dtype": "float32"}
CPU_EXP = {"timing": {"method": "wallclock", "warmup": 0, "repeats": 1, "memory": False}, "check": {"max_tokens": 48}}


def _exp(grid_axes: dict | None = None, defaults: dict | None = None, name: str = "unit") -> dict:
    """A tiny kernel experiment (not yet validated): TINY defaults, N in {32, 48, 64}."""
    return {"experiment": name, "description": "fault injection", "feeds": ["none"], "runner": "kernel",
            "defaults": {**TINY, **(defaults or {})}, "grid": [grid_axes or {"N": [32, 48, 64]}], **CPU_EXP}


def _load(exp: dict) -> dict:
    return grid.validate(exp, grid.load_schema("experiment"), exp["experiment"])


def _yaml(tmp_path: Path, exp: dict) -> Path:
    path = tmp_path / f"{exp['experiment']}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _rows(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


# ---------------------------------------------------------------- 1. no good row lost


@pytest.mark.parametrize("exc", [KeyError("h_kv"), RuntimeError("kernel crashed"), ZeroDivisionError("x")],
                         ids=lambda e: type(e).__name__)
def test_batch_keeps_good_rows_whatever_a_point_raises(tmp_path, monkeypatch, exc):
    """One point raises outside the runner's own try (where the row is started): its row says
    so, the other points' rows are written, the folder aggregates."""
    exp = _load(_exp())
    points = grid.expand(exp)
    bad = points[1]["id"]
    real = kernel.kernel_row

    def base_row(p, platform):
        if p["id"] == bad:
            raise exc
        return real(p, platform)

    monkeypatch.setattr(kernel, "kernel_row", base_row)
    kernel.run_points(points, exp, torch.device("cpu"), tmp_path, "unit-cpu", stream=None)
    rows = _rows(tmp_path / "unit-cpu" / "unit")
    assert set(rows) == {p["id"] for p in points}
    assert {k: r["status"] for k, r in rows.items() if k != bad} == {p["id"]: "ok" for p in points if p["id"] != bad}
    assert rows[bad]["status"] in ("error", "unsupported") and type(exc).__name__ in rows[bad]["message"]
    table = results.to_frame(results.load_rows("unit-cpu", "unit", tmp_path))  # schema-valid, failure included
    assert len(table) == len(points)


def test_per_point_cli_writes_a_failure_row_and_exits_0(tmp_path, monkeypatch):
    exp = _exp()
    path = _yaml(tmp_path, exp)
    point = grid.expand(_load(_exp()))[0]
    monkeypatch.setattr(kernel, "kernel_row", lambda p, platform: {}["h_kv"])
    out = tmp_path / "res" / "unit-cpu" / "unit" / f"{point['id']}.json"
    args = ["bench-kernel", "--experiment", str(path), "--point", point["id"], "--platform", "unit-cpu",
            "--results-dir", str(tmp_path / "res")]
    assert cli.main(args) == 0
    row = json.loads(out.read_text())
    assert row["status"] == "error" and row["point"] == point["id"] and "KeyError" in row["message"]


@pytest.mark.parametrize("mode", ["--all", "--point"])
def test_end_to_end_runner_keeps_good_rows_and_exits_0(tmp_path, monkeypatch, mode):
    """The train runner failing inside its row builder for one model (an unknown model used to do
    that): exit 0, one row per point, the good ones ok."""
    real = rows.model_shape

    def model_shape(p):
        if p["model"] == "qwen3-14b":
            raise KeyError(f"unknown model {p['model']!r}")
        return real(p)

    monkeypatch.setattr(rows, "model_shape", model_shape)
    exp = grid.load_experiment("train", smoke=True)
    ids = [p["id"] for p in grid.expand(exp) if p["impl"] == "sdpa_math"]
    args = ["--experiment", "train", "--smoke", "--platform", "cpu-test", "--results-dir", str(tmp_path)]
    if mode == "--all":
        assert train.main([*args, "--all", "--filter", "sdpamath"]) == 0
    else:
        for pid in ids:
            assert train.main([*args, "--point", pid]) == 0
    written = _rows(tmp_path / "cpu-test" / "train")
    assert set(written) == set(ids)
    assert {r["model"]: r["status"] for r in written.values()} == {"llama3-8b": "ok", "qwen3-14b": "error"}


# ---------------------------------------------------------------- 2. ids name the whole configuration


@pytest.mark.parametrize("key, value", [("kernel_size", 32), ("kernel_stride", 8), ("seed", 1), ("init_blocks", 0),
                                        ("local_blocks", 1), ("window_size", 64), ("options", {"x": 1})])
def test_kernel_point_ids_differ_in_every_measured_parameter(key, value):
    base = grid.expand(_load(_exp()))[0]
    other = grid.expand(_load(_exp(defaults={key: value})))[0]
    assert base["id"] != other["id"]
    assert other["id"] == grid.expand(_load(_exp(defaults={key: value})))[0]["id"]  # stable


def test_edited_yaml_measures_new_points_and_keeps_the_old_files_out_of_the_table(tmp_path):
    """kernel_size edited in a YAML: new ids, so the workflow re-measures them (no "Nothing to be
    done"); the old rows stay on disk, and the aggregate of the grid's points holds only the new."""
    before = _load(_exp(grid_axes={"N": [32]}))
    after = _load(_exp(grid_axes={"N": [32]}, defaults={"kernel_size": 32, "block_size": 32}))
    for exp in (before, after):
        kernel.run_points(grid.expand(exp), exp, torch.device("cpu"), tmp_path, "unit-cpu", stream=None)
    files = _rows(tmp_path / "unit-cpu" / "unit")
    ids = [p["id"] for p in grid.expand(after)]
    assert len(files) == 2 and set(ids) < set(files)
    out = results.aggregate("unit-cpu", "unit", tmp_path, points=ids)
    table = results.load_table("unit-cpu", "unit", tmp_path)
    assert out.is_file() and list(table["point"]) == ids and list(table["kernel_size"]) == [32]


def test_label_alone_does_not_change_an_id():
    assert grid.expand(_load(_exp(defaults={"label": "a"})))[0]["id"] == grid.expand(_load(_exp()))[0]["id"]


@pytest.mark.parametrize("key, value", [("seed", 3), ("kernel_size", 16), ("init_blocks", 0), ("local_blocks", 1),
                                        ("model_overrides", {"hidden_size": 128}), ("loss_chunk", 64)])
def test_end_to_end_point_ids_differ_in_every_parameter(key, value):
    p = {**points.E2E_DEFAULTS, "op": "train_step", "model": "llama3-8b", "impl": "fsa", "N": 4096, "dtype": "bfloat16"}
    assert points.e2e_point_id(p) != points.e2e_point_id({**p, key: value})


def test_committed_results_carry_hashed_ids_and_their_csvs_match(tmp_path):
    """Every committed point file is named by its parameters' hash (migrated, nothing
    re-measured), and every committed aggregate is, byte for byte, what aggregating its folder's
    point files writes now (so README and REPRODUCTION, built from the CSVs, show the points)."""
    root = ROOT / "results"
    # The platforms .gitignore lets in: a local `make repro` leaves uncommitted smoke rows under
    # results/cpu-interpret/, which are not checked here.
    committed = "h200*"
    assert [m for m in results.migrate_point_ids(root, dry_run=True)
            if fnmatch.fnmatch(Path(m[0]).relative_to(root).parts[0], committed)] == []
    for csv in sorted(root.glob(f"{committed}/*.csv")):
        folder = csv.with_suffix("")
        if folder.is_dir():
            # a fresh aggregate takes every point file of the folder, so equal bytes also mean
            # the table lists exactly the folder's points
            fresh = results.aggregate(csv.parent.name, csv.stem, root, out=tmp_path / csv.parent.name / csv.name)
            assert fresh.read_bytes() == csv.read_bytes(), f"{csv}: run `fsalab aggregate` on its point files"


def _legacy_copy(src: Path, dest_root: Path) -> Path:
    """``src`` (a committed row) copied under dest_root with its pre-hash id, as before migration."""
    legacy = re.sub(r"-[0-9a-f]{8}$", "", src.stem)
    text = src.read_text().replace(f'"point": "{src.stem}"', f'"point": "{legacy}"')
    dest = dest_root / src.parent.parent.name / src.parent.name / f"{legacy}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest


def test_migration_renames_legacy_files_to_the_grid_ids(tmp_path):
    """Kernel, full-depth prefill and training rows (whose split flag was stored under another
    name) migrate to the ids the current grids give, the file otherwise byte for byte unchanged."""
    picks = [next((ROOT / "results" / "h200" / exp).glob(pattern)) for exp, pattern in
             (("kernel", "selected-fsa-fwd-*"), ("prefill", "*-Lfull-*"), ("train", "*-B128-T8-*"),
              ("ablation", "*-innerloop0-*"))]
    for src in picks:
        _legacy_copy(src, tmp_path)
    moves = results.migrate_point_ids(tmp_path)
    assert len(moves) == len(picks)
    for src in picks:
        migrated = tmp_path / "h200" / src.parent.name / src.name
        assert migrated.read_text() == src.read_text()
    grid_ids = {p["id"] for exp in ("kernel", "prefill", "train", "ablation")
                for p in grid.expand(grid.load_experiment(exp))}
    assert {src.stem for src in picks} <= grid_ids


# ---------------------------------------------------------------- 3. no row crosses machines


def _h200_row() -> Path:
    return next((ROOT / "results" / "h200" / "kernel").glob("selected-fsa-fwd-N65536-*"))


def test_cpu_run_cannot_replace_an_h200_row(tmp_path):
    """The reported case: `bench-kernel --platform h200 --point <id>` on a CPU machine is refused
    before anything runs; the measured H200 row stays as it was."""
    src = _h200_row()
    dest = tmp_path / "h200" / "kernel" / src.name
    dest.parent.mkdir(parents=True)
    shutil.copy(src, dest)
    args = ["bench-kernel", "--experiment", "kernel", "--point", src.stem, "--platform", "h200",
            "--results-dir", str(tmp_path)]
    assert cli.main(args) == 2
    assert dest.read_bytes() == src.read_bytes()


def test_rows_stay_in_their_machines_folder(tmp_path, capsys):
    path = _yaml(tmp_path, _exp())
    args = ["bench-kernel", "--experiment", str(path), "--all", "--results-dir", str(tmp_path / "res")]
    assert cli.main([*args, "--platform", "h200"]) == 2
    err = capsys.readouterr().err
    assert "measured on 'cpu'" in err and "write to results/cpu-interpret/" in err
    assert not (tmp_path / "res" / "h200").exists()
    assert cli.main([*args, "--platform", "h200", "--force"]) == 0  # importing a copy on purpose
    rows = _rows(tmp_path / "res" / "h200" / "unit")
    assert len(rows) == 3 and all(r["provenance"]["machine"] == "cpu" for r in rows.values())
    agg = ["aggregate", "--experiment", str(path), "--platform", "h200", "--results-dir", str(tmp_path / "res")]
    assert cli.main(agg) == 2 and not (tmp_path / "res" / "h200" / "unit.csv").exists()
    assert cli.main([*agg, "--force"]) == 0


def test_aggregate_never_replaces_another_platforms_table(tmp_path, capsys):
    """The reported case: `aggregate --platform cpu-interpret --out results/h200/kernel.csv`
    replaced the H200 table by the CPU rows. Now refused, and the H200 table stays as it was;
    outside the results folder the same rows may go anywhere."""
    res = tmp_path / "res"
    exp = _load(_exp())
    kernel.run_points(grid.expand(exp), exp, torch.device("cpu"), res, "cpu-interpret", stream=None)
    h200 = res / "h200" / "unit.csv"
    h200.parent.mkdir()
    shutil.copy(ROOT / "results" / "h200" / "kernel.csv", h200)
    before = h200.read_bytes()
    args = ["aggregate", "--experiment", str(_yaml(tmp_path, _exp())), "--platform", "cpu-interpret",
            "--results-dir", str(res)]
    assert cli.main([*args, "--out", str(h200)]) == 2
    err = capsys.readouterr().err
    assert "results/h200/" in err and "refusing" in err and len(err.strip().splitlines()) == 1
    assert h200.read_bytes() == before
    assert cli.main([*args, "--out", str(tmp_path / "elsewhere.csv")]) == 0
    assert results.row_count(tmp_path / "elsewhere.csv") == 3


def test_aggregate_never_replaces_a_table_by_fewer_rows_unasked(tmp_path, capsys):
    res = tmp_path / "res"
    exp = _load(_exp())
    kernel.run_points(grid.expand(exp), exp, torch.device("cpu"), res, "unit-cpu", stream=None)
    args = ["aggregate", "--experiment", str(_yaml(tmp_path, _exp())), "--platform", "unit-cpu",
            "--results-dir", str(res)]
    assert cli.main(args) == 0 and results.row_count(res / "unit-cpu" / "unit.csv") == 3
    next((res / "unit-cpu" / "unit").glob("*.json")).unlink()
    capsys.readouterr()
    assert cli.main(args) == 2
    assert "holds 3 rows; refusing to replace it by a table of 2" in capsys.readouterr().err
    assert results.row_count(res / "unit-cpu" / "unit.csv") == 3
    assert cli.main([*args, "--force"]) == 0 and results.row_count(res / "unit-cpu" / "unit.csv") == 2


def test_destination_rule():
    h200 = {"point": "p", "provenance": {"gpu": "NVIDIA H200"}}  # a row from before provenance.machine
    for folder in ("h200", "h200-smoke", "h200x2", "unit-test"):
        provenance.check_destination(h200, folder)
    for folder in ("h100", "cpu-interpret"):
        with pytest.raises(provenance.PlatformMismatch):
            provenance.check_destination(h200, folder)
    cpu = {"point": "p", "provenance": {"machine": "cpu"}}
    with pytest.raises(provenance.PlatformMismatch, match="refusing to replace"):
        provenance.check_destination(cpu, "unit-test", existing=h200)
    with pytest.raises(provenance.PlatformMismatch, match="several machines"):
        results.check_machines("unit-test", [cpu, h200])
    assert provenance.provenance()["machine"] == "cpu"


# ---------------------------------------------------------------- 4. typos are errors


@pytest.mark.parametrize("change, message", [
    (lambda e: e["defaults"].update(blok_size=16), "blok_size"),
    (lambda e: e["grid"][0].update(topkk=[8]), "topkk"),
    (lambda e: e["grid"][0].update(pair=[{"block_size": 16, "topkk": 8}]), "topkk"),
    (lambda e: e["grid"][0].update(impl=["refrence"]), "refrence"),
])
def test_kernel_config_typos_are_rejected(change, message):
    exp = _exp()
    change(exp)
    with pytest.raises(ValueError, match=message):
        grid.expand(_load(exp))


@pytest.mark.parametrize("axes, message", [
    ({"layerz": [1]}, "layerz"), ({"model": ["llama9"]}, "llama9"), ({"impl": ["fsaa"]}, "fsaa"),
])
def test_end_to_end_config_typos_are_rejected(axes, message):
    exp = grid.load_experiment("train", smoke=True)
    exp["grid"][0].update(axes)
    with pytest.raises(ValueError, match=message):
        grid.expand(_load(exp))


def test_end_to_end_schema_knows_exactly_the_runners_parameters():
    """$defs/e2e_params lists every parameter the end-to-end runners default (so none is
    rejected) and nothing else (so a typo is)."""
    keys = set(grid.load_schema("experiment")["$defs"]["e2e_params"]["properties"])
    assert keys == set().union(*(points.e2e_base(r) for r in points.E2E_RUNNERS)) | set(grid.E2E_REQUIRED)


@pytest.mark.parametrize("command", [["points"], ["aggregate", "--platform", "unit"], ["bench-kernel", "--all"],
                                     ["bench-train", "--all"]])
def test_unknown_experiment_is_an_error_listing_the_known_ones(tmp_path, capsys, command):
    args = [*command, "--experiment", "nosuch"]
    if command[0] == "aggregate":
        args += ["--results-dir", str(tmp_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'nosuch'" in err and "kernel" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.csv"))


# ---------------------------------------------------------------- 5. figures


def test_notebooks_write_into_their_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FSALAB_ROOT", str(tmp_path))
    assert plotting.context("kernel").figures_dir == tmp_path / "paper_figures" / "kernel"
    sources = [c.source for p in sorted((ROOT / "analysis").glob("*.ipynb")) for c in nbformat.read(p, 4).cells]
    assert not any("plotting.context()" in s for s in sources)


def _notebook(tmp_path: Path, code: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code)]
    path = tmp_path / "t.ipynb"
    nbformat.write(nb, path)
    return path


def _unit_results(tmp_path: Path) -> list[str]:
    """``--platform unit --results-dir ...`` of a results folder holding one (empty) table."""
    (tmp_path / "res" / "unit").mkdir(parents=True)
    (tmp_path / "res" / "unit" / "unit.csv").write_text("experiment\n")
    return ["--platform", "unit", "--results-dir", str(tmp_path / "res")]


def test_failing_notebook_keeps_the_figures(tmp_path):
    figures = tmp_path / "paper_figures" / "t"
    figures.mkdir(parents=True)
    (figures / "figure.png").write_bytes(b"committed")
    code = ("from fsalab import plotting\nctx = plotting.context('t')\n(ctx.figures_dir / 'half.md').write_text('x')\n"
            "raise RuntimeError('corrupt CSV')")
    with pytest.raises(Exception, match="corrupt CSV"):
        cli.main(["notebook", str(_notebook(tmp_path, code)), *_unit_results(tmp_path), "--figures", str(figures)])
    assert [p.name for p in (tmp_path / "paper_figures").iterdir()] == ["t"]  # no staging folder left
    assert [p.name for p in figures.iterdir()] == ["figure.png"]
    assert (figures / "figure.png").read_bytes() == b"committed"


def test_finished_notebook_replaces_and_publishes(tmp_path):
    out, pub = tmp_path / "results" / "figures" / "t", tmp_path / "paper_figures" / "t"
    for folder in (out, pub):
        folder.mkdir(parents=True)
        (folder / "old.md").write_text("stale")
    code = "from fsalab import plotting\n(plotting.context('t').figures_dir / 'new.md').write_text('fresh')"
    assert cli.main(["notebook", str(_notebook(tmp_path, code)), *_unit_results(tmp_path), "--figures", str(out),
                     "--publish", str(pub)]) == 0
    for folder in (out, pub):
        assert [p.name for p in folder.iterdir()] == ["new.md"]
    assert sorted(p.name for p in pub.parent.iterdir()) == ["t"]


# ---------------------------------------------------------------- 6. NaN stays where it belongs


def _qkv(lengths, h_kv=1, g=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return (torch.randn(total, h_kv * g, d, generator=gen), torch.randn(total, h_kv, d, generator=gen),
            torch.randn(total, h_kv, d, generator=gen), cu_seqlens_of(lengths))


def _own_and_first_blocks(total: int, block_size: int) -> torch.Tensor:
    """block_idx [total, 1, 2]: block 0 and the token's own block (-1 when that is block 0)."""
    own = torch.arange(total) // block_size
    return torch.stack([torch.zeros_like(own), torch.where(own == 0, -1, own)], -1)[:, None, :].to(torch.int32)


def _reach(o: torch.Tensor) -> list[int]:
    return (~torch.isfinite(o).flatten(1).all(1)).nonzero().flatten().tolist()


@pytest.mark.parametrize("where", ["v", "k"])
@pytest.mark.parametrize("op", ["selected", "window", "compressed"])
def test_reference_ops_keep_nan_causal_and_in_its_sequence(op, where):
    """A NaN in token 0 of the second sequence (where masked keys used to be gathered from) and
    in token 5 of the first: only tokens at or after it, of its own sequence, may see it."""
    lengths, bs = [40, 40], 16
    cfg = NSAConfig(kernel_size=16, kernel_stride=16, block_size=bs, topk=3, window_size=16)
    q, k, v, cu = _qkv(lengths)
    for token in (40, 5):
        x = {"k": k.clone(), "v": v.clone()}
        x[where][token] = float("nan")
        if op == "selected":
            blk = torch.cat([_own_and_first_blocks(40, bs)] * 2)
            o, _ = selected_ref.selected_attention(q, x["k"], x["v"], blk, cu, bs)
        elif op == "window":
            o, _ = window_ref.window_attention(q, x["k"], x["v"], cu, cfg.window_size)
        else:
            w = torch.ones(1, 16 * 16, 16) / 16
            k_cmp, v_cmp, cu_cmp = compression_ref.compress_kv(x["k"], x["v"], w, w, torch.zeros(1, 16, 16), cu, cfg)
            o, _ = compression_ref.compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, cfg)
        reached = _reach(o)
        end = 40 if token < 40 else 80
        assert reached and all(token <= t < end for t in reached), (token, reached)


def test_module_keeps_nan_in_its_sequence_and_zeroes_padding():
    torch.manual_seed(0)
    cfg = NSAConfig(kernel_size=16, kernel_stride=16, block_size=16, topk=3, window_size=32)
    module = NativeSparseAttention(64, 4, 2, config=cfg)  # CPU: every branch the reference
    lengths = [70, 50, 33]
    x = torch.randn(sum(lengths), 64)
    x[70 + 20] = float("nan")  # token 20 of the second sequence
    with torch.no_grad():
        reached = _reach(module(x, cu_seqlens_of(lengths)))
    assert reached and all(90 <= t < 120 for t in reached)
    padded = torch.randn(3, 70, 64)
    padded[1, 60] = float("nan")  # padding of the second sequence
    padded[2, 40:] = float("inf")
    with torch.no_grad():
        out = module(padded, lengths=torch.tensor(lengths))
    valid = torch.arange(70)[None, :] < torch.tensor(lengths)[:, None]
    assert torch.isfinite(out[valid]).all() and (out[~valid] == 0).all()


KERNELS_AND_SWITCHES = pytest.mark.parametrize(
    "impl, options", [("nsa", {}), ("fsa", {}), ("fsa_paper", {}), ("fsa_paper", {"inner_loop": False}),
                      ("fsa_paper", {"early_return": False})],
    ids=["nsa", "fsa", "fsa_paper", "fsa_paper-no-inner-loop", "fsa_paper-no-early-return"])


def _selected(impl, options, q, k, v, blk, cu, bs):
    if options:
        return resolve(impl)(q, k, v, blk, cu, bs, None, **options)[0]
    return selected_attention(q, k, v, blk, cu, bs, impl=impl)[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@KERNELS_AND_SWITCHES
def test_kernels_keep_a_later_tokens_bad_value_out_of_earlier_tokens(impl, options, bad):
    """A non-finite value at token 21 (inside block 1 of 16 tokens): tokens 16-20 share its
    block's tiles in the FSA kernels but may not see it; the reached tokens are the reference's
    (21-31; later tokens select blocks 0 and their own)."""
    lengths, bs = [48, 20], 16
    q, k, v, cu = _qkv(lengths)
    v[21] = bad
    blk = torch.cat([_own_and_first_blocks(48, bs), _own_and_first_blocks(20, bs)])
    expected = _reach(selected_ref.selected_attention(q, k, v, blk, cu, bs)[0])
    assert expected == list(range(21, 32))  # block 1 only: later blocks select blocks 0 and their own
    assert _reach(_selected(impl, options, q, k, v, blk, cu, bs)) == expected


@pytest.mark.slow(20)
@KERNELS_AND_SWITCHES
def test_bad_value_in_a_row_of_many_token_ranges(impl, options):
    """A NaN at token 5 sits in block 0, which all 300 tokens of the first sequence select: its
    CSR row spans several programs' token ranges, and the containing launch (one program per
    row and head program) walks them all. That launch's grid is the plain paper grid's divided by
    its token ranges, never the plain grid again."""
    lengths, bs = [300, 20], 16
    q, k, v, cu = _qkv(lengths)
    v[5] = float("nan")
    blk = torch.cat([_own_and_first_blocks(300, bs), _own_and_first_blocks(20, bs)])
    expected = _reach(selected_ref.selected_attention(q, k, v, blk, cu, bs)[0])
    assert expected == list(range(5, 300))
    launches = []  # (programs, CONTAIN) of each _partial_kernel launch

    def record(kernel, args, kwargs):
        if kernel.__name__ == "_partial_kernel":
            launches.append((kwargs["grid"][0], kwargs["CONTAIN"]))

    with LaunchCounter(on_triton_launch=record):
        assert _reach(_selected(impl, options, q, k, v, blk, cu, bs)) == expected
    if impl == "nsa":
        return
    plain = [grid for grid, contain in launches if not contain]
    contained = [grid for grid, contain in launches if contain]
    assert len(contained) == 1  # PAPER or FAST; STATS and the merge contain nothing
    if impl == "fsa_paper":  # the paper's flat grid has >= 3 token ranges of 128 (64) tokens for 320 tokens
        assert contained[0] * 3 <= max(plain)


# ---------------------------------------------------------------- 7. clear errors


def test_block_size_errors_name_the_block_size():
    q, k, v, cu = _qkv([48])
    blk = _own_and_first_blocks(48, 16)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16 for impl 'fsa', got 24"):
        selected_attention(q, k, v, blk, cu, 24, impl="fsa")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        selected_attention(q, k, v, blk, cu, 0)


def test_module_input_errors():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        NativeSparseAttention(100, 8, 2)
    module = NativeSparseAttention(64, 4, 2, config=NSAConfig(kernel_size=16, kernel_stride=16, block_size=16, topk=3))
    with pytest.raises(TypeError, match="dtype torch.float64 but the module's parameters are torch.float32"):
        module(torch.randn(32, 64, dtype=torch.float64), cu_seqlens_of([32]))
    x = torch.randn(2, 32, 64)
    for lengths in ([-1, 32], [33, 4]):
        with pytest.raises(ValueError, match=r"lengths must lie in \[0, seq=32\]"):
            module(x, lengths=torch.tensor(lengths))
