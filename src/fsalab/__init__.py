"""fsalab: Native Sparse Attention kernels in both loop orders (NSA query-outer, FSA KV-block-outer)."""

from .config import NSAConfig

__version__ = "0.1.0"
__all__ = ["NSAConfig", "NativeSparseAttention", "__version__"]


def __getattr__(name: str):
    # The module pulls in torch.nn and the ops; import it only when asked for.
    if name == "NativeSparseAttention":
        from .modules import NativeSparseAttention

        return NativeSparseAttention
    raise AttributeError(name)
