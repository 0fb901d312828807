"""Each kernel's floor beside its time: compulsory bytes (``bench.flops.compulsory_bytes``) and
useful FLOPs at the GPU's ceilings (``reproduction.metrics.floors``, ``fsalab floors``)."""

from __future__ import annotations

import pandas as pd
import pytest

from fsalab import cli
from fsalab.bench.flops import compulsory_bytes
from fsalab.reproduction.metrics import floors



def test_compulsory_bytes_count_each_input_and_output_once():
    # n = 4 tokens, h = 2 query heads, 1 KV head, d = 8, bf16: q = o = 128 B, k + v = 128 B,
    # lse = 32 B (fp32), block indices 4 x 1 x 2 int32 = 32 B (kernel size 8, top-T 2).
    assert compulsory_bytes("window", "fwd", 4, 2, 1, 8, 8, 2) == 128 + 128 + 128 + 32
    assert compulsory_bytes("selected", "fwd", 4, 2, 1, 8, 8, 2) == 128 + 128 + 128 + 32 + 32
    # Backward: read q, k, v, o, do, lse; write dq, dk, dv.
    assert compulsory_bytes("window", "bwd", 4, 2, 1, 8, 8, 2) == 2 * (128 + 128) + 2 * 128 + 32
    both = compulsory_bytes("full_attention", "fwd+bwd", 4, 2, 1, 8, 8, 2)
    assert both == compulsory_bytes("full_attention", "fwd", 4, 2, 1, 8, 8, 2) + compulsory_bytes(
        "full_attention", "bwd", 4, 2, 1, 8, 8, 2)
    # The whole attention reads the compression maps (2 l d d + l d) and the gates [n, h, 3].
    maps, gates = (2 * 8 * 8 * 8 + 8 * 8) * 2, 4 * 2 * 3 * 2
    assert compulsory_bytes("nsa_attention", "fwd", 4, 2, 1, 8, 8, 2) == 128 + 128 + maps + gates + 128
    assert compulsory_bytes("window", "fwd", 4, 2, 1, 8, 8, 2, elem_bytes=4) == 256 + 256 + 256 + 32


def _row(**kw):
    row = {"op": "window", "impl": "triton", "direction": "fwd", "N": 4096, "batch": 1, "h": 16, "h_kv": 4, "d": 128,
           "g": 4, "block_size": 64, "topk": 16, "kernel_size": 32, "dtype": "bfloat16", "status": "ok",
           "median_ms": 2.0, "useful_flops": 790e9}
    return {**row, **kw}


def test_floor_is_the_larger_of_the_flop_and_byte_floors():
    df = pd.DataFrame([_row(), _row(useful_flops=1.0, N=2**20), _row(status="error", median_ms=None)])
    out = floors(df)
    assert len(out) == 2  # the failed row has no time to set beside a floor
    assert out.loc[0, "flop_floor_ms"] == pytest.approx(1.0)  # 790 GFLOP at 790 TFLOP/s
    assert out.loc[0, "floor_ms"] == pytest.approx(1.0) and out.loc[0, "of_floor"] == pytest.approx(2.0)
    byte_ms = compulsory_bytes("window", "fwd", 2**20, 16, 4, 128, 8, 2) / 4.3e12 * 1e3
    assert out.loc[1, "floor_ms"] == pytest.approx(byte_ms)  # byte-bound: FLOPs negligible


def test_floors_command_prints_the_table_and_refuses_no_rows(tmp_path, capsys):
    folder = tmp_path / "h200"
    folder.mkdir()
    pd.DataFrame([_row(), _row(g=1, h=4)]).to_csv(folder / "breakdown.csv", index=False)
    assert cli.main(["floors", "--platform", "h200", "--results-dir", str(tmp_path), "--g", "4"]) == 0
    table = capsys.readouterr().out
    assert "of_floor" in table and table.count("| window") == 1
    assert cli.main(["floors", "--platform", "h200", "--results-dir", str(tmp_path), "--g", "8"]) == 2
