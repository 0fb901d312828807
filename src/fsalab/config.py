"""NSA hyperparameters, validated once at construction."""

from __future__ import annotations

import functools
from dataclasses import dataclass


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class NSAConfig:
    """Hyperparameters of Native Sparse Attention (NSA paper §3, FSA paper Table 1).

    All sizes are in tokens.

    kernel_size   l: raw tokens per compressed token.
    kernel_stride s: distance between the starts of consecutive compressed tokens.
    block_size    B (the FSA paper's B_K): tokens per selection block.
    topk          T: selected blocks per query token and KV head (forced blocks included).
    init_blocks   leading blocks every query selects (attention sink).
    local_blocks  blocks ending at the query's own block that every query selects.
    window_size   w: the sliding-window branch attends keys (t - w, t].
    """

    kernel_size: int = 32
    kernel_stride: int = 16
    block_size: int = 64
    topk: int = 16
    init_blocks: int = 1
    local_blocks: int = 2
    window_size: int = 512

    def __post_init__(self) -> None:
        for name in ("kernel_size", "kernel_stride", "block_size", "topk", "local_blocks", "window_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NSAConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.init_blocks, int) or isinstance(self.init_blocks, bool) or self.init_blocks < 0:
            raise ValueError(f"NSAConfig.init_blocks must be a non-negative int, got {self.init_blocks!r}")
        # The kernels tile compression windows, strides and blocks with power-of-two shapes.
        for name in ("kernel_size", "kernel_stride", "block_size"):
            if not _is_pow2(getattr(self, name)):
                raise ValueError(f"NSAConfig.{name} must be a power of two, got {getattr(self, name)}")
        if self.kernel_size % self.kernel_stride:
            raise ValueError(
                f"NSAConfig.kernel_size ({self.kernel_size}) must be a multiple of kernel_stride ({self.kernel_stride})"
            )
        if self.block_size % self.kernel_stride:
            raise ValueError(
                f"NSAConfig.block_size ({self.block_size}) must be a multiple of kernel_stride ({self.kernel_stride})"
            )
        if self.kernel_size > self.block_size:
            raise ValueError(
                f"NSAConfig.kernel_size ({self.kernel_size}) must not exceed block_size ({self.block_size}) "
                "(NSA Eq. 9 maps compressed scores to blocks only when l <= l')"
            )
        if self.block_size < 16:
            raise ValueError(f"NSAConfig.block_size must be >= 16 (the MMA minimum in Triton), got {self.block_size}")
        if self.init_blocks + self.local_blocks > self.topk:
            raise ValueError(
                f"NSAConfig.topk ({self.topk}) must cover the forced blocks: "
                f"init_blocks + local_blocks = {self.init_blocks + self.local_blocks}"
            )

    def as_ints(self) -> list[int]:
        """The fields in declaration order: how a config crosses a torch.library op's schema
        (``from_ints`` rebuilds it)."""
        return [self.kernel_size, self.kernel_stride, self.block_size, self.topk, self.init_blocks, self.local_blocks,
                self.window_size]

    @staticmethod
    def from_ints(ints: list[int]) -> NSAConfig:
        """The config of ``as_ints()``, built and validated once per distinct list (launch paths call it)."""
        return _config_of(tuple(ints))

    def num_compressed(self, n: int) -> int:
        """Compressed tokens of a sequence of n tokens: floor((n - l) / s) + 1, 0 when n < l."""
        return 0 if n < self.kernel_size else (n - self.kernel_size) // self.kernel_stride + 1

    def visible_compressed_keys(self, n: int) -> int:
        """Compressed tokens attended, summed over the n positions of one sequence: position t
        sees floor((t - l + 1) / s) + 1 of them from t = l - 1 on (those whose window ends at or
        before t), none before."""
        m = n - self.kernel_size + 1  # positions that see at least one
        if m <= 0:
            return 0
        q, r = divmod(m, self.kernel_stride)
        return m + self.kernel_stride * q * (q - 1) // 2 + r * q

    def num_blocks(self, n: int) -> int:
        """Selection blocks of a sequence of n tokens (the last one may be partial)."""
        return -(-n // self.block_size)


@functools.cache
def _config_of(ints: tuple[int, ...]) -> NSAConfig:
    return NSAConfig(*ints)
