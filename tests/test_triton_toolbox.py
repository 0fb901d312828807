"""The shared Triton plumbing of fsalab.ops (``ops/_triton.py``): one autotune behaviour, one
search-step formula, and no kernel module with its own copy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import triton
import triton.language as tl

from fsalab import settings
from fsalab.ops import _triton

OPS = Path(_triton.__file__).parent
CONFIGS = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in (128, 64, 32)]


def _kernel(x, BLOCK: triton.language.constexpr):  # never launched: only wrapped
    pass


def _prune_small(configs, named_args, **kwargs):
    return [c for c in configs if c.kwargs["BLOCK"] <= named_args["limit"]]


@pytest.fixture
def on_gpu(monkeypatch):
    """The decorator as it behaves on a GPU, with autotuning on or off (``fsalab.settings``)."""
    monkeypatch.setattr(_triton, "INTERPRET", False)

    def mode(tune: bool):
        settings.configure(autotune=tune)

    return mode


def test_interpreter_gets_the_bare_kernel(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRET", True)
    assert _triton.autotune(CONFIGS, key=["x"])(_kernel) is _kernel
    assert _triton.interpreter_meta(BLOCK=16) == {"BLOCK": 16}


def test_gpu_tunes_every_config_that_survives_pruning(on_gpu):
    on_gpu(True)
    tuner = _triton.autotune(CONFIGS, key=["x"], prune=_prune_small)(triton.jit(_kernel))
    assert isinstance(tuner, triton.runtime.Autotuner)
    assert tuner.configs == CONFIGS
    assert tuner.early_config_prune(CONFIGS, {"limit": 64}) == CONFIGS[1:]
    assert tuner.do_bench is _triton._bench  # Triton's own timing while autotuning is on


def test_untuned_gpu_runs_the_first_surviving_config_without_timing(on_gpu):
    on_gpu(False)
    tuner = _triton.autotune(CONFIGS, key=["x"], prune=_prune_small)(triton.jit(_kernel))
    assert tuner.early_config_prune(CONFIGS, {"limit": 64}) == [CONFIGS[1]]
    assert tuner.do_bench([0.5, 0.2, 0.8].__len__, quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    fixed = triton.Config({"BLOCK": 16}, num_warps=1, num_stages=1)
    tuner = _triton.autotune(CONFIGS, key=["x"], untuned=lambda args: fixed)(triton.jit(_kernel))
    assert tuner.early_config_prune(CONFIGS, {"limit": 64}) == [fixed]
    assert _triton.interpreter_meta(BLOCK=16) == {}


def test_autotune_setting_is_read_per_launch_with_its_own_choices(on_gpu):
    """The setting applies to kernels defined before it changed (at import), and a key chosen
    without timing is not what a tuned launch finds (nor the other way round)."""
    on_gpu(True)
    tuner = _triton.autotune(CONFIGS, key=["x"], prune=_prune_small)(triton.jit(_kernel))
    settings.configure(autotune=False)
    assert tuner.early_config_prune(CONFIGS, {"limit": 64}) == [CONFIGS[1]]
    tuner.cache[(7,)] = CONFIGS[1]  # as Triton's run() records an untimed launch's config
    settings.configure(autotune=True)
    assert (7,) not in tuner.cache
    assert tuner.early_config_prune(CONFIGS, {"limit": 64}) == CONFIGS[1:]
    tuner.cache[(7,)] = CONFIGS[2]
    settings.configure(autotune=False)
    assert tuner.cache[(7,)] == CONFIGS[1]


def test_search_steps_resolve_both_searches():
    """Bisection of [0, n) and binary lifting over n sorted offsets find the last offset <= x,
    for every n below 300 (one test: 300 items cost more in scheduling than in checking)."""
    for n in range(300):
        _check_search_steps(n)


def _check_search_steps(n: int) -> None:
    steps = _triton.search_steps(n)
    offsets = [3 * i for i in range(n)]
    for x in range(-1, 3 * n + 2):
        want = max((i for i, o in enumerate(offsets) if o <= x), default=0)
        lo, hi = 0, n  # bisection, as ops/flash.py's _tile_of
        for _ in range(steps):
            mid = (lo + hi) // 2
            if mid < n and offsets[mid] <= x:
                lo = mid
            else:
                hi = mid
        lift = 0  # binary lifting, as ops/compression/compress_kv.py's _window_rows
        for it in range(steps):
            cand = lift + (1 << (steps - 1 - it))
            if cand < n and offsets[cand] <= x:
                lift = cand
        assert lift == want, (n, x)
        if n:
            assert lo == want, (n, x)


def test_next_pow2():
    assert [_triton.next_pow2(x) for x in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]
    assert all(_triton.next_pow2(x) == triton.next_power_of_2(x) for x in range(1, 5000))


def test_constants():
    assert _triton.LOG2E * _triton.LN2 == pytest.approx(1.0, abs=1e-15)
    assert _triton.LOG2E_C.value == _triton.LOG2E and _triton.LN2_C.value == _triton.LN2


# What lives once, in _triton.py: the interpreter switch, autotune wrapping, powers of two.
_COPIES = re.compile(r"environ\.get\(\"TRITON_INTERPRET\"|triton\.autotune\(|next_power_of_2|0\.6931471805599453")


def test_no_kernel_module_keeps_its_own_copy():
    found = [f"{p.relative_to(OPS)}:{i}" for p in sorted(OPS.rglob("*.py")) if p.name != "_triton.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if _COPIES.search(line)]
    assert not found, found


@triton.jit
def _bitwise_kernel(X, OUT0, OUT1, OR: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    x = tl.load(X + tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :])
    if OR:
        r0, r1 = tl.reduce_or(x, 0), tl.reduce_or(x, 1, keep_dims=True)
    else:
        r0, r1 = tl.xor_sum(x, 0), tl.xor_sum(x, 1, keep_dims=True)
    tl.store(OUT0 + tl.arange(0, B), r0)
    tl.store(OUT1 + tl.arange(0, A)[:, None], r1)


@pytest.mark.skipif(not _triton.INTERPRET, reason="the interpreter's reductions (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("use_or", [False, True], ids=["xor", "or"])
def test_bitwise_reductions_equal_the_interpreters_loop(use_or, monkeypatch):
    """patch_interpreter's numpy xor/or reductions give what the interpreter's element-by-element
    loop gives (the unpatched ``apply_impl``), along either axis, with and without keep_dims."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    x = torch.randint(-(2**31), 2**31 - 1, (8, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    fast = interpreter.ReduceOps.apply_impl
    assert getattr(fast, "_fsalab_fixed", False)
    outs = []
    for impl in (fast, fast.__wrapped__):
        monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", impl)
        out0, out1 = torch.empty(16, dtype=torch.int32), torch.empty(8, 1, dtype=torch.int32)
        _bitwise_kernel[(1,)](x, out0, out1, use_or, 8, 16)
        outs.append((out0, out1))
    ufunc = np.bitwise_or if use_or else np.bitwise_xor
    expected = (ufunc.reduce(x.numpy(), axis=0), ufunc.reduce(x.numpy(), axis=1, keepdims=True))
    for got in outs:
        for value, want in zip(got, expected):
            np.testing.assert_array_equal(value.numpy(), want)


def test_cdiv_is_the_ceiling_and_the_host_paths_use_it():
    """_triton.cdiv equals triton.cdiv (a ConstexprFunction, ~4-10 us a host call in Triton 3.6)
    on host ints, and no launch path calls triton.cdiv any more."""
    cases = [(a, b) for a in (0, 1, 15, 16, 17, 1 << 20, (1 << 31) + 5) for b in (1, 3, 16, 64)]
    assert [_triton.cdiv(a, b) for a, b in cases] == [triton.cdiv(a, b) for a, b in cases]
    users = [p.name for p in OPS.rglob("*.py") if re.search(r"\btriton\.cdiv\(", p.read_text())]
    assert not users, users
