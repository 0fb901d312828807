"""The convergence experiment's byte-level text task (CPU): the corpus, its batches and splits,
point ids beside the committed retrieval results, a tiny run of the runner, and the gaps and
README sentence over rows of both tasks."""

import hashlib
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from fsalab import reproduction
from fsalab.bench import convergence, grid, points
from fsalab.reproduction import document

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]
TEXT = {"task": "text", "N": 256, "batch": 3, "seed": 0}


def test_text_batch_is_next_byte_prediction_deterministic_in_seed_and_step():
    ids, labels = convergence.text_batch(TEXT, 5, CPU)
    assert ids.shape == labels.shape == (3, 256) and ids.dtype == labels.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 256
    assert torch.equal(labels[:, :-1], ids[:, 1:])  # the label of each byte is the next byte
    again = convergence.text_batch(TEXT, 5, CPU)
    assert torch.equal(ids, again[0]) and torch.equal(labels, again[1])
    assert not torch.equal(ids, convergence.text_batch(TEXT, 6, CPU)[0])
    assert not torch.equal(ids, convergence.text_batch({**TEXT, "seed": 1}, 5, CPU)[0])
    corpus = convergence.text_corpus()
    off = convergence.text_offsets(TEXT, 5, corpus)
    for row, o in zip(ids, off.tolist()):  # rows are the corpus's bytes, in order
        assert bytes(row.to(torch.uint8).tolist()) == bytes(corpus.data[o:o + 256].tolist())


def test_heldout_split_is_disjoint_from_training_rows_and_fixed():
    corpus = convergence.text_corpus()
    n, size = TEXT["N"], corpus.data.numel()
    assert corpus.split == size - int(size * convergence.TEXT_HELDOUT_FRACTION)
    for step in range(200):  # every training row, its last label included, ends before the split
        off = convergence.text_offsets({**TEXT, "batch": 16}, step, corpus)
        assert int(off.min()) >= 0 and int(off.max()) + n + 1 <= corpus.split
    held = convergence.heldout_offsets(TEXT, corpus)
    assert int(held.min()) >= corpus.split and int(held.max()) + n + 1 <= size
    ids, labels = convergence.heldout_batch(TEXT, CPU)
    other = convergence.heldout_batch({**TEXT, "seed": 7}, CPU)  # one held-out batch for every seed and step
    assert torch.equal(ids, other[0]) and torch.equal(labels, other[1]) and torch.equal(labels[:, :-1], ids[:, 1:])
    ident = corpus.identity
    assert ident["corpus_bytes"] == size and ident["corpus_heldout_bytes"] == size - corpus.split
    assert ident["corpus_sha256"] == hashlib.sha256(bytes(corpus.data.tolist())).hexdigest()
    assert convergence.text_corpus() is corpus  # built once per process


def test_text_corpus_sorted_skips_installed_packages_and_tests_and_refuses_a_small_one(tmp_path, monkeypatch):
    for rel, text in (("b.py", "b"), ("a/z.py", "az"), ("a.py", "a"), ("site-packages/x.py", "x"),
                      ("test/t.py", "t"), ("a/tests/u.py", "u"), ("notes.txt", "n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    with pytest.raises(ValueError, match="at least .* bytes of Python sources"):
        convergence.text_corpus(str(tmp_path))
    monkeypatch.setattr(convergence, "TEXT_MIN_BYTES", 1)
    corpus = convergence.text_corpus(str(tmp_path / "."))  # another cache key than the failed call
    assert bytes(corpus.data.tolist()) == b"aazb" and corpus.identity["corpus_files"] == 3
    with pytest.raises(ValueError, match="shorter than a row"):
        convergence.text_batch(TEXT, 0, CPU, corpus)


def test_committed_retrieval_ids_unchanged_and_text_ids_tagged():
    """The task key hashes as absent at its default, so the committed H200 rows keep their file
    names; the text points carry -text- before their step count."""
    committed = {p.stem for p in (REPO / "results/h200/convergence").glob("*.json")}
    assert committed, "no committed convergence rows"
    exp = grid.load_experiment(REPO / "experiments/convergence.yaml")
    ids = [p["id"] for p in grid.expand(exp)]
    assert committed <= set(ids)
    from fsalab import results

    for stem in committed:  # as fsalab migrate-ids would recompute them from the rows
        row = json.loads((REPO / "results/h200/convergence" / f"{stem}.json").read_text())
        assert stem.endswith(points.point_hash(results.point_of_row(row, stem)))
    p = next(p for p in grid.expand(exp) if p["id"] in committed)
    assert points.e2e_point_id({**p, "task": "retrieval"}) == p["id"]
    text = [i for i in ids if i not in committed]
    assert len(text) == 4 and all("-text-S" in i for i in text) and sum("-gatereference-text-" in i for i in text) == 1
    for overlay in ("smoke", "paper"):
        assert any("-text-S" in p["id"] for p in grid.expand(grid.load_experiment("convergence", **{overlay: True})))


def test_text_runner_tiny_fp32_rows():
    """A few steps of the text task at N = 128 (NSA through torch's reference ops, and full
    attention: the Triton kernels take minutes per step in the interpreter): rows carry the
    corpus, the held-out curve and chance ln 256; a model without 256 tokens is refused."""
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 256, "bos_token_id": None, "eos_token_id": None}
    for impl in ("reference", "sdpa_math"):
        p = {**points.e2e_base("convergence"), "task": "text", "impl": impl, "N": 128, "batch": 2, "steps": 3,
             "layers": 1, "log_every": 1, "dtype": "float32", "model_overrides": tiny, "block_size": 32, "topk": 3,
             "kernel_size": 16, "kernel_stride": 8, "window_size": 32, "experiment": "convergence"}
        p["id"] = points.e2e_point_id(p)
        row = convergence.run_point(p, {}, CPU, "cpu-test")
        assert row["status"] == "ok", row.get("traceback", row["message"])
        curve = row["curve"]
        assert curve["step"] == [0, 1, 2] and len(curve["eval_loss"]) == len(curve["eval_accuracy"]) == 3
        assert "accuracy_far" not in curve and row["final_accuracy_far"] is None
        assert row["chance_loss"] == pytest.approx(math.log(256)) and row["final_eval_loss"] == curve["eval_loss"][-1]
        assert row["corpus"] == "python-stdlib"
        assert row["corpus_sha256"] == convergence.text_corpus().identity["corpus_sha256"]
        assert all(abs(x - math.log(256)) < 1.0 for x in curve["loss"] + curve["eval_loss"])  # near chance at start
    small = {**p, "model_overrides": {**tiny, "vocab_size": 128}}
    bad = convergence.run_point(small, {}, CPU, "cpu-test")
    assert bad["status"] == "unsupported" and "vocab_size must be at least 256" in bad["message"]


def _run(task, impl, losses, gate="auto", span=1, eval_loss=None, **extra):
    row = {"impl": impl, "window_impl": "auto", "gate_impl": gate, "needle_span": span, "steps": 3, "status": "ok",
           "final_accuracy_far": None if task == "text" else 0.9, "final_loss": losses[-1],
           "chance_loss": math.log(256) if task == "text" else 2.0, "git_commit": "abcdef0123",
           "curve": {"step": [0, 1, 2], "loss": losses}, **extra}
    if task == "text":
        row.update(task="text", final_eval_loss=eval_loss)
    return row


def test_convergence_gaps_group_by_task_and_the_text_floor():
    """Rows without a task column are retrieval rows; the text task has its own FSA-NSA gap,
    noise floor and held-out losses; the gap table shows the text columns only with text rows."""
    retrieval = [_run("retrieval", "fsa", [2.0, 1.0, 0.5], span=32), _run("retrieval", "nsa", [2.0, 1.1, 0.5], span=32),
                 _run("retrieval", "nsa", [2.0, 1.0, 0.6], gate="reference", span=32)]
    old = reproduction.convergence_gaps(pd.DataFrame(retrieval))
    assert list(old["task"]) == ["retrieval"] and math.isnan(old.loc[0, "eval_loss_fsa"])
    assert "task" not in reproduction.convergence_gap_table(old)
    assert list(reproduction.convergence_gap_table(old).columns) == list(old.columns[1:17])
    text = [_run("text", "fsa", [5.5, 3.0, 2.00], eval_loss=2.1), _run("text", "nsa", [5.5, 3.0, 2.01], eval_loss=2.11),
            _run("text", "nsa", [5.5, 3.03, 2.02], gate="reference", eval_loss=2.12),
            _run("text", "sdpa_flash", [5.5, 2.5, 1.5], eval_loss=1.6)]
    both = pd.DataFrame(retrieval + text)
    gaps = reproduction.convergence_gaps(both).set_index("task")
    assert list(gaps.index) == ["retrieval", "text"]
    assert gaps.loc["retrieval", "fsa_nsa_max_gap"] == pytest.approx(0.1)
    t = gaps.loc["text"]
    assert t["fsa_nsa_median_gap"] == pytest.approx(0.0) and t["fsa_nsa_max_gap"] == pytest.approx(0.01)
    assert t["nsa_nsa_median_gap"] == pytest.approx(0.01) and t["nsa_nsa_first_step_over"] == 1
    assert t["fsa_full_max_gap"] == pytest.approx(0.5) and math.isnan(t["acc_far_fsa"])
    assert (t["eval_loss_fsa"], t["eval_loss_full"]) == (pytest.approx(2.1), pytest.approx(1.6))
    assert t["loss_over_chance_fsa"] == pytest.approx(2.0 / math.log(256))
    assert "task" in reproduction.convergence_gap_table(gaps.reset_index())
    sentence = " ".join(" ".join(document._convergence_block(lambda experiment: both)).split())
    assert "stand-in tasks (synthetic needle retrieval, byte-level text)" in sentence
    assert "needle span 32, 3 steps: median gap 0 against 0.1" in sentence
    assert "byte-level text, 3 steps: median gap 0 against 0.01" in sentence and "as close as two NSA runs" in sentence
    assert "Held-out loss after 3 steps of byte-level text: FSA 2.1, NSA 2.11, full attention 1.6" in sentence
    lines = "\n".join(document._convergence_lines(lambda experiment: both))
    assert "| task | needle_span |" in lines and "eval_loss_full" in lines
    retrieval_only = " ".join(" ".join(document._convergence_block(lambda experiment: pd.DataFrame(retrieval))).split())
    assert "on a synthetic stand-in task" in retrieval_only and "text" not in retrieval_only
