"""Test harness: kernels run through the Triton interpreter when no CUDA device is present."""

import os
import random

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from fsalab import settings

ON_GPU = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--no-autotune", action="store_true",
                     help="fsalab's Triton kernels run one config per launch, without autotune timing "
                          "(settings.autotune False: short GPU test runs)")


def _share_the_cores_between_workers(config) -> None:
    """Under pytest-xdist each worker gets its share of the cores for the BLAS and OpenMP thread
    pools of numpy (the interpreter's ``tl.dot``) and torch. The workers inherit this process's
    environment when they start, before they import numpy; by default each starts a thread per
    core, and on 2 cores two workers' 4 threads took tests/test_selection_fsa.py 1.3x the time
    of one thread each."""
    workers = getattr(config.option, "numprocesses", None)
    if ON_GPU or not isinstance(workers, int) or workers < 2 or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


def pytest_configure(config):
    if config.getoption("--no-autotune"):
        settings.configure(autotune=False)
    _share_the_cores_between_workers(config)
    # pytest-xdist: hand items to the workers one at a time (default: a quarter of each worker's
    # share at once), so the long items collected first (pytest_collection_modifyitems) spread
    # over both workers and the short ones fill in around them.
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk", None) is None:
        config.option.maxschedchunk = 1


@pytest.fixture(autouse=True)
def _settings_restored():
    """Each test starts from the session's settings (fsalab.settings): one that configures them,
    or runs a command line with --dispatch, leaves no trace in the next."""
    before = settings.current
    yield
    settings.current = before


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed with any failure so it can be replayed (FSALAB_SEED fixes it)."""
    value = int(os.environ.get("FSALAB_SEED", random.SystemRandom().randrange(2**31 - 1)))
    print(f"FSALAB_SEED={value}")  # shown with the captured output of a failing test
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poison_flash_buffers(monkeypatch):
    """Every buffer the FlashAttention kernels (ops/flash.py) must fill starts as NaN: an
    unwritten element fails the comparison. Modules of ops built on them use it for every test
    (``pytestmark = pytest.mark.usefixtures("poison_flash_buffers")``)."""
    from fsalab.ops import flash, scratch
    from fsalab.testing import nan_filled, poison

    monkeypatch.setattr(flash, "_empty", poison)
    monkeypatch.setattr(scratch, "handed_out", nan_filled)


@pytest.fixture
def poison_every_allocation(monkeypatch):
    """torch.empty, torch.empty_like and Tensor.new_empty hand out poisoned tensors: floating
    ones full of NaN, integer ones full of the dtype's minimum (an index no kernel writes and any
    read of it lands far out of bounds), so an element a kernel allocates and never writes shows
    up in the comparison. Covers the integer outputs and ``new_empty`` buffers that
    ``fsalab.testing.poisoned_allocations`` leaves alone, and the ops' scratch (``ops.scratch``)."""
    from fsalab.ops import scratch

    @torch.no_grad()  # a leaf that requires grad (torch.utils.checkpoint's dummy) is filled as well
    def poisoned(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            return t.fill_(torch.iinfo(t.dtype).min)
        return t

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poisoned(new_empty(self, *a, **kw)))
    monkeypatch.setattr(scratch, "handed_out", poisoned)


@pytest.fixture
def decode_smoke_rows(tmp_path):
    """``rows(name, device)``: every smoke point of the decode-runner experiment ``name`` (decode,
    inference, generate) run on ``device`` into ``tmp_path``; the rows written, one per point,
    schema-checked on reading."""
    from fsalab import results
    from fsalab.bench import decode, grid, kernel

    def rows(name: str, device: torch.device) -> list[dict]:
        exp = grid.load_experiment(name, smoke=True)
        points = grid.expand(exp)
        kernel.run_points(points, exp, device, tmp_path, "test", runner=decode.run_point)
        written = results.load_rows("test", name, tmp_path)
        assert len(written) == len(points)
        return written

    return rows


def _expected_seconds(item) -> float:
    marker = item.get_closest_marker("slow")
    return 0.0 if marker is None else float(marker.args[0] if marker.args else 1)


def pytest_collection_modifyitems(config, items):
    # Items marked slow run first, the longest first (slow(seconds): a rough wall time on 2 CPU
    # cores): started last, one of them would end the run on one worker while the other sits idle.
    items.sort(key=lambda item: -_expected_seconds(item))
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
