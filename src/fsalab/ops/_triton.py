"""Triton plumbing shared by every kernel module of ``fsalab.ops``.

- ``INTERPRET`` / ``interpreting()``: kernels run through the Triton interpreter
  (``TRITON_INTERPRET=1``, the CPU test path), read once at import.
- ``autotune(configs, key, ...)``: the decorator every autotuned kernel uses, with one behaviour:

  ======================================  =====================================================
  interpreter                             the bare kernel; each launch passes its (small)
                                          interpreter tiles (``interpreter_meta``)
  GPU                                     ``triton.autotune``: every config that survives
                                          ``prune`` timed once per key
  GPU, ``settings.autotune`` False        no timing: the config ``untuned`` picks for the
                                          launch, or else the first config that survives
                                          ``prune`` (for short GPU test runs)
  ======================================  =====================================================

  The GPU rows are chosen per launch from ``fsalab.settings`` (``configure(autotune=False)``,
  ``--no-autotune``), not when the kernel is defined: the kernels are defined when ``fsalab.ops``
  is imported, before a program's settings are known.

- ``LOG2E``, ``LN2`` (Python floats, for host-side scales) and ``LOG2E_C``, ``LN2_C``
  (``tl.constexpr``, for kernels): exp2/log2 conversions of the online softmaxes.
- ``next_pow2(x)``, ``search_steps(n)``, ``dot_precision(dtype)``: launch arithmetic;
  ``tile_config`` builds an autotune config, ``unit_last_stride`` the layout the loads assume.
- ``patch_interpreter()``: the interpreter fixes below, applied when this module is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from .. import settings

# Read once: Triton too picks interpreter or compiler when a kernel is defined, not per launch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)


def interpreting() -> bool:
    """Whether the kernels run through the Triton interpreter (read at import)."""
    return INTERPRET


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. ``triton.cdiv`` does the same through Triton's ConstexprFunction
    wrapper, microseconds a call on the host (a hundred times the integer expression), which the
    launch paths paid several times per call."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def search_steps(n: int) -> int:
    """Iterations that resolve an index among n sorted elements, for every search of the kernels:
    bisection of [lo, hi) (each halves the open interval) and binary lifting (jumps of
    2^(steps-1) ... 1, each guarded by the bound). One more than needed is harmless."""
    return max(int(n), 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs multiply in true fp32 (tests compare exactly);
    fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_config(warps: int, stages: int, **tiles) -> triton.Config:
    """An autotune config: the kernel's tile sizes ``tiles`` with ``warps`` warps, ``stages`` stages."""
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (what the kernels' loads assume), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def interpreter_meta(**tiles) -> dict:
    """Launch meta-parameters of an autotuned kernel: ``tiles`` under the interpreter (where the
    kernel is bare), nothing on a GPU (the autotuner supplies them)."""
    return tiles if INTERPRET else {}


def _bench(kernel_call, quantiles):
    """Triton's own timing while ``settings.autotune`` is on; none (every config ties) otherwise."""
    if settings.current.autotune:
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)
    return [0.0] * len(quantiles)


class _TuningCache(dict):
    """An autotuner's choices (tuning key -> config), kept apart per ``settings.autotune``: a key
    first launched with autotuning off holds an untimed config, which must not stand for the
    tuned one once autotuning is on (nor the other way round)."""

    def __contains__(self, key) -> bool:
        return super().__contains__((settings.current.autotune, key))

    def __getitem__(self, key):
        return super().__getitem__((settings.current.autotune, key))

    def __setitem__(self, key, config) -> None:
        super().__setitem__((settings.current.autotune, key), config)


def autotune(
    configs: list[triton.Config],
    key: list[str],
    prune: Callable | None = None,
    untuned: Callable[[dict], triton.Config] | None = None,
    **kwargs,
):
    """Decorator of an autotuned kernel (the table in the module docstring).

    prune(configs, named_args, **kwargs) -> configs: Triton's ``early_config_prune``.
    untuned({**named_args, **kwargs}) -> Config: the config of a launch while
    ``settings.autotune`` is off (default: the first config ``prune`` keeps). Other keyword
    arguments go to ``triton.autotune`` (``reset_to_zero``, ...).
    """

    def chosen(configs_, named_args, **kw):
        if settings.current.autotune:
            return list(prune(configs_, named_args, **kw) if prune else configs_)
        if untuned is not None:
            return [untuned({**named_args, **kw})]
        return list(prune(configs_, named_args, **kw) if prune else configs_)[:1]

    def wrap(fn):
        if INTERPRET:
            return fn
        tuner = triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": chosen}, do_bench=_bench,
                                **kwargs)(fn)
        tuner.cache = _TuningCache()
        return tuner

    return wrap


def patch_interpreter() -> None:
    """Three fixes of the Triton interpreter (3.x), applied once; each does nothing when the
    interpreter's internals differ from what it expects.

    - numpy >= 2.4: the interpreter keeps scalars as 1-element arrays and turns them into Python
      ints with ``int(array)`` when a loaded value is a loop bound; numpy 2.4 rejects that for
      arrays with ndim > 0. Interpreted tensors get an ``__index__`` that reads the single element.
    - speed: every call of a ``@triton.jit`` helper from a kernel re-patches the ``triton.language``
      modules its globals name (``_patch_lang``: an ``inspect.getmembers`` per call, most of an
      interpreted NSA forward's time), although the launch running it has patched those module
      objects already.
      Inside a launch, a helper whose modules (``tl``; ``tl.core`` for Triton's own helpers) are
      patched skips it; the first patch of each, and the launch's restore at its end, are unchanged.
    - speed: a reduction along an axis whose combine function is a bitwise xor or or (``tl.sort``'s
      compare-and-swap takes an ``xor_sum`` per stage: most of ``block_select``'s interpreted
      time) runs element by element in Python (``generic_reduce``); it becomes one numpy
      reduction, exact for integers like the loop, of the same dtype and shape.
    """
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    _patch_bitwise_reductions(interpreter)

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is not None and not getattr(patch, "_fsalab_fixed", False):

        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._fsalab_fixed = True
        interpreter._patch_lang_tensor = patched

    patch_lang, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if None in (patch_lang, launch, getattr(interpreter, "_LangPatchScope", None)) or getattr(patch_lang, "_fsalab_fixed", False):
        return
    state = {"launches": 0, "langs": set()}  # launches running; language modules the current one patched
    langs_of: dict = {}  # function -> ids of the triton.language modules its globals name (what it patches)

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if state["launches"] and langs <= state["langs"]:
            return interpreter._LangPatchScope()  # a helper inside a launch: already patched, nothing to undo
        scope = patch_lang(fn)
        if state["launches"]:
            state["langs"] |= langs
        return scope

    def run_launch(self, *args, **kwargs):
        state["launches"] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            state["launches"] -= 1
            state["langs"] = set()

    run = launch.__call__
    patch_once._fsalab_fixed = True
    interpreter._patch_lang = patch_once
    launch.__call__ = run_launch


def _patch_bitwise_reductions(interpreter) -> None:
    """``ReduceOps.apply_impl`` with numpy's bitwise reductions for the xor and or combine
    functions along an axis (``patch_interpreter``); every other reduction is unchanged."""
    ops = getattr(interpreter, "ReduceOps", None)
    combines = {getattr(tl.standard, name, None): ufunc for name, ufunc in
                (("_xor_combine", np.bitwise_xor), ("_or_combine", np.bitwise_or))}
    if ops is None or None in combines or getattr(ops.apply_impl, "_fsalab_fixed", False):
        return
    apply_impl = ops.apply_impl

    def bitwise_apply_impl(self, input):
        ufunc = combines.get(self.combine_fn)
        if ufunc is None or self.axis is None or len(input) != 1:
            return apply_impl(self, input)
        data = input[0].handle.data
        return self.to_tensor(ufunc.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)

    bitwise_apply_impl._fsalab_fixed = True
    bitwise_apply_impl.__wrapped__ = apply_impl  # the loop, for the test that compares the two
    ops.apply_impl = bitwise_apply_impl


patch_interpreter()
