"""The ``fsalab`` command line as a new user meets it: every option explains itself, and a
missing file, an unknown platform, an empty results folder or a malformed YAML is a one-line
error with a non-zero exit, never a traceback or a silent success on nothing."""

from __future__ import annotations

import argparse

import pytest
import yaml

from fsalab import cli
from fsalab.bench import grid
from fsalab.bench.repo import repo_root

ROOT = repo_root()


def _one_line_error(capsys, args: list[str], *fragments: str) -> str:
    """Run ``fsalab args``: exit 2 and one line on stderr, ``fsalab: error: ...``, naming ``fragments``."""
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fsalab: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _options_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]


def test_every_option_has_help():
    """Every option of every subcommand, and of the end-to-end runners (bench-train, -prefill,
    -convergence share one parser) that ``fsalab`` forwards to."""
    from fsalab.bench import e2e_cli

    missing = [f"{name} {opt}" for name, sub in _subparsers(cli.build_parser()).items()
               for opt in _options_without_help(sub)]
    missing += [f"bench-train {opt}" for opt in _options_without_help(e2e_cli.parser("train_step"))]
    assert not missing, "options without help text:\n" + "\n".join(missing)


@pytest.mark.parametrize("args, fragment", [
    (["--results-dir", "/nonexistent", "--platform", "h200"], "no results folder /nonexistent"),
    (["--platform", "nosuchplat"], "no results of platform 'nosuchplat'"),
])
def test_reproduction_of_nothing_is_an_error(tmp_path, capsys, args, fragment):
    out = tmp_path / "REPRODUCTION.md"
    _one_line_error(capsys, ["reproduction", *args, "--out", str(out)], fragment)
    assert not out.exists()


def test_empty_platform_folder_is_an_error(tmp_path, capsys):
    (tmp_path / "res" / "plat" / "kernel").mkdir(parents=True)
    out = tmp_path / "REPRODUCTION.md"
    _one_line_error(capsys, ["reproduction", "--platform", "plat", "--results-dir", str(tmp_path / "res"),
                             "--out", str(out)], "holds no results")
    assert not out.exists()


@pytest.mark.parametrize("notebook, platform, fragment", [
    ("analysis/kernel.ipynb", "nosuchplat", "no results of platform 'nosuchplat'"),
    ("analysis/nosuch.ipynb", "h200", "notebook analysis/nosuch.ipynb does not exist"),
])
def test_notebook_of_nothing_is_an_error(tmp_path, capsys, monkeypatch, notebook, platform, fragment):
    monkeypatch.chdir(ROOT)
    figures = tmp_path / "figures"
    _one_line_error(capsys, ["notebook", notebook, "--platform", platform, "--figures", str(figures)], fragment)
    assert not list(tmp_path.iterdir())  # no figures folder, no staging folder left


def test_malformed_experiment_yaml_is_one_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("experiment: broken\nrunner: kernel\ngrid:\n  - N: [1, 2\n")
    _one_line_error(capsys, ["points", "--experiment", str(path)], f"{path} is not valid YAML at line 5")
    path.write_text("- a list, not an experiment\n")
    _one_line_error(capsys, ["points", "--experiment", str(path)], "must hold a mapping")


def test_missing_point_files_are_one_line(tmp_path, capsys):
    (tmp_path / "unit-cpu" / "kernel").mkdir(parents=True)
    _one_line_error(capsys, ["aggregate", "--experiment", "kernel", "--platform", "unit-cpu", "--results-dir",
                             str(tmp_path), "--points", "missing.json"], "no point file", "missing.json")
    _one_line_error(capsys, ["bench-kernel", "--experiment", "kernel", "--point", str(tmp_path / "nonexistent.yaml"),
                             "--results-dir", str(tmp_path)], "point file", "nonexistent.yaml does not exist")
    assert not list((tmp_path / "unit-cpu" / "kernel").iterdir())


def test_ad_hoc_small_block_adapts_the_compression_window():
    """`bench-kernel --block-size 16`: the default window (32 tokens) shrinks to the block instead
    of leaving an `unsupported` row; an impossible configuration given outright is an error."""
    exp = grid.load_experiment("kernel")
    parser = cli.build_parser()
    flags = ["bench-kernel", "--experiment", "kernel", "--op", "selected", "--impl", "fsa", "--direction", "fwd",
             "--N", "256", "--g", "1"]
    point = cli._point_from_args(parser.parse_args([*flags, "--block-size", "16", "--topk", "4"]), exp)
    assert (point["block_size"], point["kernel_size"], point["kernel_stride"]) == (16, 16, 16)
    default = cli._point_from_args(parser.parse_args(flags), exp)
    assert (default["block_size"], default["kernel_size"], default["kernel_stride"]) == (64, 32, 16)
    with pytest.raises(ValueError, match=r"kernel_size \(64\) must not exceed block_size \(16\)"):
        cli._point_from_args(parser.parse_args([*flags, "--block-size", "16", "--kernel-size", "64"]), exp)


def test_point_file_parameters_reach_the_point(tmp_path):
    path = tmp_path / "point.yaml"
    path.write_text(yaml.safe_dump({"op": "selected", "impl": "reference", "direction": "fwd", "N": 128, "g": 2}))
    args = cli.build_parser().parse_args(["bench-kernel", "--experiment", "kernel", "--point", str(path)])
    point = cli._point_from_args(args, grid.load_experiment("kernel"))
    assert (point["impl"], point["N"], point["g"]) == ("reference", 128, 2)

