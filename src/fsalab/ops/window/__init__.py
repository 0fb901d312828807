"""Sliding-window attention (DESIGN §4 step 5): ``window_attention`` on fsalab's flash kernel or
flash-attn (``attention.py``), and its fp32 PyTorch twin (``reference.py``)."""

from .attention import BACKENDS, flash_attn_varlen, window_attention

__all__ = ["BACKENDS", "flash_attn_varlen", "window_attention"]
