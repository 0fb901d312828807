"""Once-per-point correctness check of a benchmarked op against the fp32 reference.

The op runs at the benchmarked shape; its first ``m`` output rows (and, for directions with a
backward, the gradients of a loss that only involves those rows) are compared with the reference
run on the first ``m`` tokens alone. For causal ops this is exact: rows before m never see later
tokens, and an upstream gradient that is zero after row m gives later tokens zero gradient. The
bound is ``fsalab.testing.assert_close``'s: ``factor`` x PyTorch's own error in the input dtype
(the reference computed natively in that dtype) plus a dtype floor.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ops.reference_common import native_precision
from ..testing import assert_close, max_error
from .inputs import Inputs
from .ops import BoundOp

# Inputs with one row per token: only their first m rows take part in the prefix check.
_PER_TOKEN = {"q", "k", "v", "gate"}


def _reference_run(bound: BoundOp, px: Inputs, aux, do: torch.Tensor | None, dtype: torch.dtype):
    """Reference output (and gradients of sum(o * do) when do is given) on inputs cast to dtype."""
    tensors = {n: t.detach().to(dtype) for n, t in px.tensors.items()}
    if do is not None:
        for n in bound.grad_args:
            tensors[n].requires_grad_(True)
    o = bound.reference(replace(px, tensors=tensors), aux)
    if do is None:
        return o.detach(), {}
    leaves = [tensors[n] for n in bound.grad_args]
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
    return o.detach(), {f"d{n}": g for n, g in zip(bound.grad_args, grads) if g is not None}


def check(bound: BoundOp, inputs: Inputs, direction: str, max_tokens: int, factor: float, seed: int) -> dict:
    """Run the op once and compare it with the reference; returns a dict for the result row:
    status (pass | fail), tokens (m), per-output max_err and bound, message on failure."""
    m = min(inputs.max_seqlen, max_tokens)
    backward = direction != "fwd"
    x = inputs.with_leaves(bound.grad_args if backward else ())
    if backward:
        o, aux = bound.fn(x)
        gen = torch.Generator(device=o.device).manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32).to(o.dtype)
        do[m:] = 0
        leaves = [x.tensors[n] for n in bound.grad_args]
        grads = torch.autograd.grad(o, leaves, do, allow_unused=True)
        actual = {f"d{n}": g for n, g in zip(bound.grad_args, grads) if g is not None}
        do_prefix = do[:m].float()
    else:
        with torch.no_grad():
            o, aux = bound.fn(x)
        actual, do_prefix = {}, None
    actual = {"o": o.detach(), **actual}
    aux_prefix = aux[:m] if isinstance(aux, torch.Tensor) else aux
    px = inputs.prefix(m)
    low = inputs.tensors["q"].dtype
    o_ref, g_ref = _reference_run(bound, px, aux_prefix, do_prefix, torch.float32)
    with native_precision():
        o_nat, g_nat = _reference_run(bound, px, aux_prefix, do_prefix.to(low) if backward else None, low)
    expected, native = {"o": o_ref, **g_ref}, {"o": o_nat, **g_nat}

    result = {"status": "pass", "tokens": m, "outputs": {}}
    failures = []
    for name, exp in expected.items():
        if name not in actual:
            failures.append(f"{name}: the op returned no gradient")
            continue
        act = actual[name]
        base = name[1:] if name.startswith("d") and name[1:] in inputs.tensors else name
        if name == "o" or base in _PER_TOKEN:
            act = act[:m]
        act = act.float()
        nat = native.get(name)
        result["outputs"][name] = {
            "max_err": max_error(act, exp),
            "native_err": max_error(nat.float(), exp) if nat is not None else None,
        }
        try:
            assert_close(act, exp, native=nat.float() if nat is not None else None, dtype=low, factor=factor, name=name)
        except AssertionError as exc:
            failures.append(str(exc))
    if failures:
        result["status"] = "fail"
        result["message"] = "; ".join(failures)[:2000]
    return result
