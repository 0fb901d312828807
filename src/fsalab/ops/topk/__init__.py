"""Top-T block selection of NSA (DESIGN §4 step 3): ``select_blocks`` ranks each token's blocks by
its compressed-attention probabilities and keeps the top T.

``block_select.py``: the Triton kernel and the op; ``block_select_gluon.py``: the Gluon kernel
the op runs on sm_90 where it fits; ``select_common.py``: the int32 ranking keys, the running
top-T and the tile geometry both kernels (and the decode step) share; ``reference.py``: the fp32
PyTorch twin (``select_blocks``, ``block_scores``).
"""

from .block_select import select_blocks

__all__ = ["select_blocks"]
