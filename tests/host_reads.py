"""A recorder of host reads of tensor values, the CPU stand-in for CUDA's sync debug mode.

On CPU a host read costs nothing, but the same call on CUDA blocks the host until the GPU catches
up. Two kinds are recorded while the recorder is active:

- aten ops that return a tensor value to the host (``item()``, ``int()``, ``bool()``,
  ``nonzero``, ...), seen by a TorchDispatchMode;
- Tensor methods that copy values out without an aten op on a CPU tensor (``tolist``,
  ``numpy``, ``__array__``, ``item``, ``cpu``), when called from fsalab's own code. The Triton
  interpreter reads kernel arguments through these same methods, so calls from elsewhere pass.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default"}
COPYING_METHODS = ("tolist", "numpy", "__array__", "item", "cpu")


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...`` then ``reads.seen``: what read tensor values to the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING_OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

    def _watch(self, name: str):
        original = vars(torch.Tensor).get(name)  # None: inherited from torch._C.TensorBase
        method = getattr(torch.Tensor, name)

        def watched(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module == "fsalab" or module.startswith("fsalab."):
                self.seen.append(f"Tensor.{name} in {module}:{caller.f_lineno}")
            return method(tensor, *args, **kwargs)

        return original, watched

    def __enter__(self):
        for name in COPYING_METHODS:
            self._saved[name], watched = self._watch(name)
            setattr(torch.Tensor, name, watched)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)
            self._saved.clear()
