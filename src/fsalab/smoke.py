"""A tiny NSA forward and backward through the module on whatever device is present.

``python -m fsalab.smoke`` prints the output norm and gradient norms; exit code 0 means the whole
path (projections, compression, three branches, gates) ran and produced finite values.
"""

from __future__ import annotations

import sys

import torch

from .config import NSAConfig
from .modules import NativeSparseAttention
from .testing import cu_seqlens_of


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = NSAConfig(topk=4, window_size=128)
    module = NativeSparseAttention(256, 8, 2, config=cfg, device=device, dtype=dtype)
    lengths = [700, 150, 1]
    x = torch.randn(sum(lengths), 256, device=device, dtype=dtype, requires_grad=True)
    out = module(x, cu_seqlens_of(lengths, device))
    out.float().square().mean().backward()
    finite = torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    print(f"NSA module smoke on {device} ({dtype}): tokens={x.shape[0]} |out|={out.float().norm():.4f} "
          f"|dx|={x.grad.float().norm():.4f} finite={bool(finite)}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
