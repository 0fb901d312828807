"""``fsalab.ops.selected`` under the name code written against earlier releases imports:
``fsalab.ops.selection.selected_attention`` and its impl registry."""

from .selected import IMPLS, PEER_IMPLS, resolve, selected_attention

__all__ = ["IMPLS", "PEER_IMPLS", "resolve", "selected_attention"]
