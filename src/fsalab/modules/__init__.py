from .nsa import NativeSparseAttention

__all__ = ["NativeSparseAttention"]
