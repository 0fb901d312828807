"""scripts/sass_loop_count.py, whose counts docs/performance.md cites, still builds the select
kernel and FSA's forward and backward tile kernels for sm_90a on CPU, finds their main loops and
refuses an edit it cannot place; the select kernel's 128-row, 8-warp tile at g = 4 (the GPU's
config there) spills nothing; and the Gluon select kernel at g = 2, 5 and 8 spills nothing and asks
for the shared memory ``block_select_gluon.shared_bytes`` estimates, the estimate its
``tokens_per_program`` and ``runs`` rules rest on. scripts/ptxas_report.py builds any kernel
(here compress_kv's dpe kernel, spill-free at the tiles its launch picks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loop_count.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_select_loop_counted_without_spills():
    out = _run("--config", "4,128,8")
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"(\d+) registers, (\d+) B spilled; loop (\d+) instructions", out.stdout)
    assert m, out.stdout
    assert int(m.group(2)) == 0, out.stdout
    assert int(m.group(3)) > 100, out.stdout  # the score loop, not a short index loop


@pytest.mark.parametrize("g, block_t", [(2, 128), (5, 64), (8, 64)])
def test_gluon_select_builds_without_spills(g, block_t):
    """At g = 2 (128 tokens a program, two an SM), g = 5 (64 tokens, each row in two threads, so that
    two programs share an SM; keys prefetched) and g = 8 (64 tokens, the largest that fits)."""
    from fsalab.ops.topk.block_select_gluon import shared_bytes, tokens_per_program

    assert tokens_per_program(g, 128, 64) == block_t
    out = _run("--kernel", "select_gluon", "--config", f"{g},{block_t},4")
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"(\d+) registers, (\d+) B spilled; loop (\d+) instructions", out.stdout)
    assert m and int(m.group(2)) == 0 and int(m.group(3)) > 100, out.stdout
    shared = re.search(r"shared memory (\d+) bytes", out.stdout)
    assert shared and int(shared.group(1)) == shared_bytes(g, 128, 64, block_t), out.stdout


@pytest.mark.parametrize("kernel", ["fsa_partial", "fsa_dkdv"])
def test_fsa_tile_loops_counted(kernel):
    out = _run("--kernel", kernel, "--config", "4,128,8" if kernel == "fsa_dkdv" else "4,128,4")
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"loop (\d+) instructions per thread and tile \((\d+) per \(token, head\) row", out.stdout)
    assert m and int(m.group(1)) > 100, out.stdout


def test_replace_must_match_once():
    out = _run("--config", "4,128,8", "--replace", "no such text", "x")
    assert out.returncode != 0 and "occurs 0 times" in out.stderr + out.stdout


def test_variant_function_and_two_loops(tmp_path):
    """--source/--function/--const build an A/B's variant kernel (here one derived from the tree's
    fused backward with an added constexpr); --loops 2 reports both tile loops of g = 5's head parts."""
    tree = (Path(__file__).resolve().parents[1] / "src/fsalab/ops/selected/fsa_bwd.py").read_text()
    head, end = "def _dkdv_kernel(\n", "PREC: tl.constexpr,\n):\n    r, sub, ok = "
    assert tree.count(head) == 1 and tree.count(end) == 1, "the kernel's signature moved: update this test"
    variant = tree.replace(head, "def _dkdv_variant(\n").replace(end, "PREC: tl.constexpr, EXTRA: tl.constexpr,\n):\n    r, sub, ok = ")
    source = tmp_path / "fsa_bwd_variant.py"
    source.write_text(variant)
    out = _run("--kernel", "fsa_dkdv", "--source", str(source), "--function", "_dkdv_variant", "--const", "EXTRA=1",
               "--rows", "128", "--loops", "2", "--config", "5,128,8")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fsa_dkdv:_dkdv_variant G=5" in out.stdout, out.stdout
    loops = re.findall(r"loop (\d) (\d+) instructions per thread and tile \((\d+) per", out.stdout)
    assert [n for n, _, _ in loops] == ["1", "2"] and all(int(k) > 100 for _, k, _ in loops), out.stdout


def test_same_as_tells_an_equal_kernel_from_a_changed_one(tmp_path):
    """--same-as: the tree's module against a copy of itself is identical; against a copy whose
    plain tiles scale the scores differently, it differs."""
    tree = (Path(__file__).resolve().parents[1] / "src/fsalab/ops/selected/fsa_partials.py").read_text()
    copy, changed = tmp_path / "same.py", tmp_path / "changed.py"
    copy.write_text(tree)
    old = "s = tl.dot(q_t, tl.trans(k_blk), input_precision=PREC) * qk_scale"
    assert tree.count(old) == 1, "the tile's score line moved: update this test"
    changed.write_text(tree.replace(old, old + " * 0.5"))
    for other, word in ((copy, "identical to"), (changed, "differs from")):
        out = _run("--kernel", "fsa_partial", "--config", "4,128,4", "--same-as", str(other))
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"whole SASS {word} {other}'s" in out.stdout, out.stdout


@pytest.mark.parametrize("d, block_r", [(128, 64), (256, 32)])
def test_ptxas_report_dpe_builds_without_spills(d, block_r):
    """scripts/ptxas_report.py (register counts of kernels sass_loop_count has no
    plan for) builds compress_kv's dpe kernel at the row tile its launch picks, min(64, 8192 / d),
    with the launcher's stride hints, and it spills nothing."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")
    out = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("ptxas_report.py")), "fsalab.ops.compression.compress_kv:_compress_dpe_kernel",
         f"--const=HEAD_DIM={d}", f"--const=LX={32 * d}", f"--const=D_PAD={d}", f"--const=BLOCK_R={block_r}",
         "--const=BLOCK_X=64", "--ptr=tab_ptr=i32", "--int=s_*=16", "--int=rows=4096"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"(\d+) registers, (\d+) B spilled", out.stdout)
    assert m and int(m.group(2)) == 0, out.stdout
