"""NSA's gated sum of the three branches (DESIGN §4 step 6): ``gated_sum`` as one fused Triton
kernel per direction (``fused.py``), and its PyTorch twin (``reference.py``)."""

from .fused import gated_sum

__all__ = ["gated_sum"]
