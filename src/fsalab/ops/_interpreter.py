"""Compatibility of the Triton interpreter (TRITON_INTERPRET=1, the CPU test path) with numpy >= 2.4.

The interpreter keeps scalars as 1-element arrays and turns them into Python ints with
``int(array)`` when a loaded value is a loop bound; numpy 2.4 rejects that for arrays with
ndim > 0. The patch gives interpreted tensors an ``__index__`` that reads the single element.
It is idempotent and does nothing when the interpreter's internals differ from what it expects.
"""

from __future__ import annotations

import os


def patch_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_fsalab_fixed", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._fsalab_fixed = True
    interpreter._patch_lang_tensor = patched
