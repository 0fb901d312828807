"""The decode cache of one NSA layer (DESIGN §9): what a decode step reads and appends to.

Layout: contiguous per sequence, fixed capacity, so a step has static shapes for a fixed batch
and capacity (CUDA-graph capturable) and every sequence length lives in a device tensor.

==============  ======================================  =========================================
tensor          shape                                   contents
==============  ======================================  =========================================
``k``, ``v``    [batch, capacity + 1, h_kv, d]          keys after RoPE, values; token t of
                                                        sequence b at [b, t]; row capacity is
                                                        scratch
``k_cmp``,      [batch, capacity // s + 1, h_kv, d]     compressed token j of sequence b at
``v_cmp``                                               [b, j]; keys rotated at their window's
                                                        first token (j * s), as in prefill; the
                                                        last row is scratch
``k_recent``    [batch, l + 1, h_kv, d]                 keys *before* RoPE of the last l tokens,
                                                        token t at slot t % l (compression reads
                                                        un-rotated keys); slot l is scratch
``lengths``     int32 [batch]                           tokens cached per sequence
``cmp_logits``  fp32 [batch, h, capacity // s]          the Triton step's scratch: compressed
                                                        attention's logits q·k_cmp·scale·log2(e)
                                                        of query head h over compressed token j,
                                                        rewritten for j < n_cmp every step
==============  ======================================  =========================================

A compressed token is appended when a sequence reaches n tokens with n >= l and (n - l) % s == 0:
token j = (n - l) / s over the raw window [n - l, n), exactly the prefill compression's token j,
so decode and prefill agree. Memory: 2·capacity·h_kv·d (raw) + 2·(capacity // s)·h_kv·d
(compressed) + (l + 1)·h_kv·d elements per sequence, in the cache dtype, plus h·(capacity // s)
fp32 logits: 4·h/s bytes per token of capacity against the raw cache's 2·h_kv·d·2 bytes (bf16,
fp16), a fraction g/(s·d) of it (g = h/h_kv; s = 16, d = 128: 0.05 % at g = 1, 0.8 % at g = 16).
The logits are scratch, not state: step 1 of the Triton step (``decode._cmp_partial_kernel``)
writes them, step 2 (``decode._score_kernel``) reads them, so the block scores need not read
the compressed keys a second time; the fp32 reference step does not use them. They are sized
for the query heads the cache is built for (``num_heads``).

Static shapes mean every sequence writes every step; a write that must not land (a sequence that
completes no compressed token, a prefill padding row, a full sequence when value checks are off)
goes to the scratch row instead of being filtered on the host. The step's op-by-op methods here
(``append``, ``new_compressed``, ``write_compressed``) serve the fp32 reference step
(``reference.append_token``); the Triton step does the same in two kernels
(``step.append_token``), which skip the compressed-token writes that must not land. A full cache is reported before
anything is written (ValueError on CPU, a device-side assert on CUDA; ``value_checks=False``
skips the check and the token goes to scratch), so a rejected call corrupts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ...checks import KERNEL_DTYPES, MAX_HEAD_DIM, _expect, _value_checks_enabled, check_cu_seqlens, check_tensor
from ...config import NSAConfig
from ...varlen import compressed_cu_seqlens, compressed_index, local_positions, sequence_ids


@dataclass
class NSADecodeCache:
    """Raw, compressed and recent un-rotated keys of a batch of sequences (module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    k_recent: torch.Tensor
    lengths: torch.Tensor
    cmp_logits: torch.Tensor
    cfg: NSAConfig
    filled: bool = False  # set by ``fill``: a decode step before the prefill is an error

    @classmethod
    def allocate(
        cls,
        batch: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        cfg: NSAConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        *,
        num_heads: int,
    ) -> NSADecodeCache:
        """An empty cache for ``batch`` sequences of up to ``capacity`` tokens each, attended by
        ``num_heads`` query heads (a multiple of ``num_kv_heads``; sizes ``cmp_logits``)."""
        if not isinstance(cfg, NSAConfig):
            raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
        for name, value in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_heads", num_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim = {head_dim} exceeds {MAX_HEAD_DIM}")
        if dtype not in KERNEL_DTYPES + (torch.float64,):
            raise TypeError(f"cache dtype must be one of {KERNEL_DTYPES + (torch.float64,)}, got {dtype}")
        f = {"dtype": dtype, "device": device}
        rows = capacity // cfg.kernel_stride + 1
        return cls(
            k=torch.zeros(batch, capacity + 1, num_kv_heads, head_dim, **f),
            v=torch.zeros(batch, capacity + 1, num_kv_heads, head_dim, **f),
            k_cmp=torch.zeros(batch, rows, num_kv_heads, head_dim, **f),
            v_cmp=torch.zeros(batch, rows, num_kv_heads, head_dim, **f),
            k_recent=torch.zeros(batch, cfg.kernel_size + 1, num_kv_heads, head_dim, **f),
            lengths=torch.zeros(batch, dtype=torch.int32, device=device),
            cmp_logits=torch.zeros(batch, num_heads, capacity // cfg.kernel_stride, dtype=torch.float32, device=device),
            cfg=cfg,
        )

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens a sequence may hold (the raw rows but the scratch row)."""
        return self.k.shape[1] - 1

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def num_heads(self) -> int:
        """Query heads the cache is built for (``cmp_logits`` holds one row per head)."""
        return self.cmp_logits.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (every tensor, lengths and the ``cmp_logits`` scratch included)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.k, self.v, self.k_cmp, self.v_cmp, self.k_recent, self.lengths, self.cmp_logits))

    def clone(self) -> NSADecodeCache:
        """An independent copy: every tensor cloned, the same config and ``filled``."""
        return replace(self, **{f.name: getattr(self, f.name).clone() for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def check_kv(self, name: str, t: torch.Tensor, rows: int | None = None) -> None:
        """t [rows (default: batch), h_kv, d] in the cache's dtype and device."""
        check_tensor(name, t, 3, (self.dtype,), self.device)
        want = (self.batch if rows is None else rows, self.num_kv_heads, self.head_dim)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} (tokens, h_kv, d), got {tuple(t.shape)}")

    def check_q(self, q: torch.Tensor) -> None:
        """q [batch, num_heads, d] in the cache's dtype and device."""
        check_tensor("q", q, 3, (self.dtype,), self.device)
        want = (self.batch, self.num_heads, self.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q must be [batch, h, d] = {list(want)} (the heads the cache was built for), "
                             f"got {tuple(q.shape)}")

    def check_token(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
        pe: torch.Tensor, inv_freq: torch.Tensor,
    ) -> None:
        """The arguments of a step's ``append_token`` (``step.py``): q [batch, h, d] (h the
        cache's ``num_heads``), k, v [batch, h_kv, d] in the cache's dtype; w_k, w_v [h_kv, l*d, d],
        pe [h_kv, l, d]; inv_freq float32 [d / 2]. Host-side only: reads no device value."""
        d, h_kv, l = self.head_dim, self.num_kv_heads, self.cfg.kernel_size
        self.check_q(q)
        self.check_kv("k", k)
        self.check_kv("v", v)
        for name, t, shape in (("w_k", w_k, (h_kv, l * d, d)), ("w_v", w_v, (h_kv, l * d, d)), ("pe", pe, (h_kv, l, d))):
            check_tensor(name, t, 3, KERNEL_DTYPES + (torch.float64,), self.device)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")
        check_tensor("inv_freq", inv_freq, 1, (torch.float32,), self.device)
        if d % 2 or inv_freq.shape[0] != d // 2:
            raise ValueError(f"inv_freq must be float32 [head_dim // 2 = {d // 2}] (RoPE needs an even head_dim), "
                             f"got {tuple(inv_freq.shape)}")

    def fill(
        self,
        k: torch.Tensor,
        k_plain: torch.Tensor,
        v: torch.Tensor,
        k_cmp: torch.Tensor,
        v_cmp: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> None:
        """Fill from a packed varlen prefill of ``batch`` sequences (replaces what was cached).

        k (after RoPE), k_plain (before RoPE), v [total, h_kv, d]; k_cmp (rotated), v_cmp
        [total // s, h_kv, d] in ``compress_kv``'s layout; cu_seqlens int32 [batch + 1]. Every
        sequence must fit the capacity (value check).
        """
        total = k.shape[0]
        for name, t in (("k", k), ("k_plain", k_plain), ("v", v)):
            self.check_kv(name, t, total)
        rows = total // self.cfg.kernel_stride
        for name, t in (("k_cmp", k_cmp), ("v_cmp", v_cmp)):
            self.check_kv(name, t, rows)
        check_cu_seqlens(cu_seqlens, total, self.device)
        if cu_seqlens.numel() - 1 != self.batch:
            raise ValueError(f"the prefill holds {cu_seqlens.numel() - 1} sequences, the cache {self.batch}")
        n = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        if _value_checks_enabled():
            _expect((n <= self.capacity).all(), f"a prefill sequence is longer than the cache capacity {self.capacity}")
        cfg = self.cfg
        seq = sequence_ids(cu_seqlens, total)
        pos = local_positions(cu_seqlens, total)
        at = torch.where(pos < self.capacity, pos, self.capacity)  # scratch when value checks are off
        self.k[seq, at] = k
        self.v[seq, at] = v
        # The last l un-rotated keys to their ring slots; the others all go to the scratch slot.
        recent = pos >= n.long()[seq] - cfg.kernel_size
        slot = torch.where(recent, pos % cfg.kernel_size, torch.full_like(pos, cfg.kernel_size))
        self.k_recent[seq, slot] = k_plain
        if rows:
            cu_cmp = compressed_cu_seqlens(cu_seqlens, cfg.kernel_size, cfg.kernel_stride)
            scratch = self.k_cmp.shape[1] - 1
            c_seq = sequence_ids(cu_cmp, rows).clamp(max=self.batch - 1)
            j = compressed_index(cu_cmp, rows)
            # Padding rows of the prefill buffer (and, with value checks off, rows past capacity) to scratch.
            valid = (torch.arange(rows, device=self.device) < cu_cmp[-1]) & (j < scratch)
            j = torch.where(valid, j, scratch)
            self.k_cmp[c_seq, j] = k_cmp
            self.v_cmp[c_seq, j] = v_cmp
        self.lengths.copy_(n)
        self.filled = True

    def check_step(self) -> None:
        """A decode step may run: the cache was filled and no sequence is at capacity."""
        if not self.filled:
            raise ValueError("decode before prefill: fill the cache from a prefill first (NSADecodeCache.fill)")
        if _value_checks_enabled():
            _expect((self.lengths < self.capacity).all(), f"decode cache full: a sequence holds capacity = {self.capacity} tokens")

    def append(self, k: torch.Tensor, k_plain: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence: k (after RoPE), k_plain (before RoPE), v [batch, h_kv, d].

        Returns the new tokens' positions, int64 [batch] (the lengths before the step). Call
        ``check_step`` first (the module's decode does).
        """
        for name, t in (("k", k), ("k_plain", k_plain), ("v", v)):
            self.check_kv(name, t)
        pos = self.lengths.long()
        full = pos >= self.capacity  # only when value checks are off: the token goes to scratch
        at = torch.where(full, self.capacity, pos)
        b = torch.arange(self.batch, device=self.device)
        self.k[b, at] = k
        self.v[b, at] = v
        self.k_recent[b, torch.where(full, self.cfg.kernel_size, pos % self.cfg.kernel_size)] = k_plain
        self.lengths.add_((~full).to(torch.int32))
        return pos

    def new_compressed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(creates bool [batch], row int64 [batch]): whether the current length n completes
        compressed token j = (n - l) / s (n >= l and (n - l) % s == 0), and the k_cmp row to write:
        j where it does, the scratch row elsewhere."""
        n = self.lengths.long()
        l, s = self.cfg.kernel_size, self.cfg.kernel_stride
        creates = (n >= l) & ((n - l) % s == 0)
        return creates, torch.where(creates, (n - l).clamp(min=0) // s, self.k_cmp.shape[1] - 1)

    def write_compressed(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, row: torch.Tensor) -> None:
        """Store each sequence's new compressed token (k rotated, v) [batch, h_kv, d] at ``row``
        (from ``new_compressed``: the scratch row for sequences that complete none)."""
        self.check_kv("k_cmp", k_cmp)
        self.check_kv("v_cmp", v_cmp)
        b = torch.arange(self.batch, device=self.device)
        self.k_cmp[b, row] = k_cmp
        self.v_cmp[b, row] = v_cmp


def compression_window(cache: NSADecodeCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw window [n - l, n) of every sequence's newest compressed token, in window order:
    (k before RoPE, v), each [batch, l, h_kv, d]. Meaningful where ``new_compressed`` says creates."""
    l = cache.cfg.kernel_size
    n = cache.lengths.long()
    t = (n[:, None] - l + torch.arange(l, device=cache.device)).clamp(min=0)  # [batch, l]
    b = torch.arange(cache.batch, device=cache.device)[:, None]
    return cache.k_recent[b, t % l], cache.v[b, t]
