"""Helpers shared by the tests (CPU and GPU): random varlen batches and block indices,
NaN poisoning, dtype-aware comparison against an fp32 reference, and kernel-launch counting."""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .config import NSAConfig
from .varlen import local_positions

# Smallest error bound per dtype, relative to the reference's magnitude: keeps a kernel that is
# exact where PyTorch happens to be exact too from failing on one rounding step.
_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class VarlenBatch:
    """Packed inputs: q [total, h, d], k/v [total, h_kv, d], cu_seqlens int32 [batch + 1]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def total(self) -> int:
        return self.q.shape[0]


def cu_seqlens_of(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 offsets [len(lengths) + 1] of sequences packed back to back."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def random_lengths(gen: torch.Generator, batch: int, max_len: int, min_len: int = 1) -> list[int]:
    return torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()


def make_batch(
    lengths: list[int],
    h: int,
    h_kv: int,
    d: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    q_scale: float = 1.0,
    requires_grad: bool = False,
) -> VarlenBatch:
    """Random N(0, 1) packed batch; a fresh seed is drawn when seed is None."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    total = sum(lengths)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)
        return t.requires_grad_(requires_grad)

    return VarlenBatch(rnd(total, h, d, scale=q_scale), rnd(total, h_kv, d), rnd(total, h_kv, d), cu_seqlens_of(lengths, device))


# aten ops that launch no kernel: views, metadata, allocations without initialisation.
NO_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "slice", "select", "unsqueeze", "squeeze",
    "expand", "as_strided", "detach", "alias", "t", "transpose", "permute", "split", "unbind",
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "set_",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts the device kernels a block of code launches: ``counts`` maps "triton:<kernel>" and
    "aten:<op>" to launches.

    Triton launches are counted at ``run`` (the compiled JITFunction on a GPU, the
    InterpretedFunction under TRITON_INTERPRET=1); aten ops through this dispatch mode, except
    ``NO_KERNEL_OPS`` and the ops the interpreter performs itself while it runs a kernel (copies
    of the arguments to and from its host buffers). An aten op counts once even where CUDA runs
    several kernels for it (torch.sort: a radix sort of a few passes).
    """

    def __init__(self, on_triton_launch=None, aten: bool = True):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._on_triton_launch = on_triton_launch  # called with (kernel, args, kwargs) per counted launch
        # aten=False: Triton launches only, without the dispatch mode (torch.compile refuses to run under one).
        self._aten = aten
        self._inside_kernel = 0
        self._patched: list = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, InterpretedFunction):
            self._patched.append((cls, cls.run))
            cls.run = self._counted(cls.run)
        return super().__enter__() if self._aten else self

    def __exit__(self, *exc):
        for cls, run in self._patched:
            cls.run = run
        self._patched.clear()
        return super().__exit__(*exc) if self._aten else None

    def _counted(self, run):
        def counted_run(fn, *args, **kwargs):
            if kwargs.get("warmup") or self._inside_kernel:
                return run(fn, *args, **kwargs)
            self.counts[f"triton:{fn.__name__}"] += 1
            if self._on_triton_launch is not None:
                self._on_triton_launch(fn, args, kwargs)
            self._inside_kernel += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside_kernel -= 1

        return counted_run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_kernel and name not in NO_KERNEL_OPS:
            self.counts[f"aten:{name}"] += 1
        return func(*args, **(kwargs or {}))


def poison(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write shows up in the comparison."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


@torch.no_grad()  # a leaf that requires grad (torch.utils.checkpoint's dummy) is filled as well
def nan_filled(t: torch.Tensor) -> torch.Tensor:
    """t filled with NaN in place where it is floating (others as they are): a poisoned buffer."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


@contextlib.contextmanager
def poisoned_allocations():
    """Within the block, torch.empty / empty_like and the ops' scratch (``ops.scratch``, also
    its views of a planned buffer) return NaN-filled floating tensors, so any element a kernel
    allocates but never writes shows up as NaN in the comparison."""
    from .ops import scratch

    empty, empty_like, handed_out = torch.empty, torch.empty_like, scratch.handed_out
    torch.empty = lambda *a, **kw: nan_filled(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: nan_filled(empty_like(*a, **kw))
    scratch.handed_out = nan_filled
    try:
        yield
    finally:
        torch.empty, torch.empty_like, scratch.handed_out = empty, empty_like, handed_out


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |actual - expected| over finite reference entries (both compared in float64)."""
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    if not finite.any():
        return 0.0
    return (a[finite] - e[finite]).abs().max().item()


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    native: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    factor: float = 2.0,
    name: str = "output",
) -> None:
    """Assert actual ≈ expected (fp32/fp64 reference) within what PyTorch itself makes in that dtype.

    ``native`` is the same computation done by PyTorch in the low-precision dtype; the bound is
    ``factor * err(native) + floor(dtype) * max|expected|``. Without ``native`` only the floor
    applies. Infinite reference entries (lse of empty rows) must be matched exactly; NaN never passes.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    dtype = dtype or actual.dtype
    if torch.isnan(actual).any():
        raise AssertionError(f"{name}: {int(torch.isnan(actual).sum())} NaN entries (unwritten or invalid)")
    inf = ~torch.isfinite(expected)
    if inf.any() and not torch.equal(actual.double()[inf], expected.double()[inf]):
        raise AssertionError(f"{name}: entries where the reference is infinite differ")
    scale = expected.double()[~inf].abs().max().item() if (~inf).any() else 0.0
    bound = _FLOOR[dtype] * max(scale, 1.0)
    if native is not None:
        bound += factor * max_error(native, expected)
    err = max_error(actual, expected)
    if err > bound:
        raise AssertionError(f"{name}: max error {err:.3e} exceeds bound {bound:.3e} (dtype {dtype}, ref scale {scale:.3e})")


def attention_and_grads(fn, q, k, v, block_idx, cu_seqlens, block_size, do, dlse=None) -> tuple[torch.Tensor, ...]:
    """(o, lse, dq, dk, dv) of the loss sum(o * do) + sum(lse * dlse) for fresh leaves copied from
    q, k, v; ``fn(q, k, v, block_idx, cu_seqlens, block_size) -> (o, lse)`` is a selected
    attention (an impl, or ``reference.selected_attention``)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, block_idx, cu_seqlens, block_size)
    loss = (o * do.to(o.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(lse.dtype)).sum()
    return (o, lse, *torch.autograd.grad(loss, leaves))


def step_outputs(fn, params, x: torch.Tensor, *args, **kwargs) -> list[torch.Tensor]:
    """Copies of the output and of the gradients of x and of every parameter of one step:
    fn(x, ...) (its first element when a tuple), then .float().sum().backward()."""
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_()
    out = fn(x, *args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    return [t.detach().clone() for t in (out, x.grad, *(p.grad for p in params))]


def check_attention(op, ref, tensors, dtype, seed, grads=True, atol_factor=2.0):
    """Compare op(q, k, v) with ref(q, k, v) (fp32 reference, same extra args bound in both).

    op returns o or (o, lse); ref returns (o, lse). tensors: (q, k, v) in any float dtype, cast to
    dtype. The bound is atol_factor x PyTorch's own error in dtype (the reference run in native
    precision). With grads, the loss is sum(o * do) + sum(lse * dlse) over finite lse entries.
    """
    from .ops.reference_common import native_precision

    leaves = [t.detach().to(dtype).requires_grad_(grads) for t in tensors]
    exact = [t.detach().float().requires_grad_(grads) for t in leaves]
    native = [t.detach().clone().requires_grad_(grads) for t in leaves]
    out = op(*leaves)
    o, lse = out if isinstance(out, tuple) else (out, None)
    ro, rl = ref(*exact)
    with native_precision():
        no, nl = ref(*native)
    assert o.dtype == dtype and o.shape == ro.shape
    assert_close(o, ro, no, dtype, atol_factor, name="o")
    if lse is not None:
        assert lse.dtype == torch.float32
        assert_close(lse, rl, nl, dtype, atol_factor, name="lse")
    if not grads:
        return o, lse
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    dlse = torch.randn(o.shape[:2], generator=gen).to(o.device)

    def loss(o_, lse_):
        value = (o_.float() * do).sum()
        if lse is not None:
            value = value + (torch.where(torch.isfinite(lse_), lse_.float(), 0.0) * dlse).sum()
        return value

    for o_, lse_ in ((o, lse), (ro, rl), (no, nl)):
        loss(o_, lse_).backward()
    for name, a, e, n in zip(("dq", "dk", "dv"), leaves, exact, native):
        # PyTorch leaves no gradient on zero-row k/v (a batch without compressed tokens).
        e_grad, n_grad = (t.grad if t.grad is not None else torch.zeros_like(t) for t in (e, n))
        assert_close(a.grad, e_grad, n_grad, dtype, atol_factor, name=name)
    return o, lse


def compressed_inputs(lengths, h, h_kv, d, cfg, seed, device="cpu"):
    """q over raw tokens; k_cmp/v_cmp in the reference layout (total // s rows, zero padding rows)."""
    from .varlen import compressed_capacity, compressed_cu_seqlens

    batch = make_batch(lengths, h, h_kv, d, seed=seed, device=device)
    cu_cmp = compressed_cu_seqlens(batch.cu_seqlens, cfg.kernel_size, cfg.kernel_stride)
    rows = compressed_capacity(batch.total, cfg.kernel_stride)
    gen = torch.Generator().manual_seed(seed + 1)
    valid = (torch.arange(rows) < cu_cmp[-1].item())[:, None, None]
    k_cmp = (torch.randn(rows, h_kv, d, generator=gen) * valid).to(device)
    v_cmp = (torch.randn(rows, h_kv, d, generator=gen) * valid).to(device)
    return batch, k_cmp, v_cmp, cu_cmp


def selected_blocks(batch, cfg: NSAConfig, gen: torch.Generator) -> torch.Tensor:
    """block_idx int32 [total, h_kv, topk] from NSA's compression + top-k path on ``batch`` (fp32 math)."""
    from .ops.compression import reference as compression
    from .ops.topk import reference as topk

    q, k, v, cu = batch.q.detach().float(), batch.k.detach().float(), batch.v.detach().float(), batch.cu_seqlens
    h_kv, d = k.shape[1], k.shape[2]
    l = cfg.kernel_size
    w_k = torch.randn(h_kv, l * d, d, generator=gen).to(k.device) / math.sqrt(l * d)
    w_v = torch.randn(h_kv, l * d, d, generator=gen).to(k.device) / math.sqrt(l * d)
    pe = torch.randn(h_kv, l, d, generator=gen).to(k.device) * 0.1
    k_cmp, v_cmp, cu_cmp = compression.compress_kv(k, v, w_k, w_v, pe, cu, cfg)
    _, lse_cmp = compression.compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, cfg)
    return topk.select_blocks(q, k_cmp, lse_cmp, cu, cu_cmp, cfg)


def random_block_idx(
    cu_seqlens: torch.Tensor, h_kv: int, topk: int, block_size: int, gen: torch.Generator, p_drop: float = 0.3
) -> torch.Tensor:
    """Random valid block_idx: distinct causal blocks, ascending, -1 padded; each candidate kept w.p. 1 - p_drop.

    Rows come out with anywhere from 0 to topk valid entries (empty selections included).
    """
    cu = cu_seqlens.cpu().long()
    total = int(cu[-1])
    lengths = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(n) for n in lengths]) if total else torch.zeros(0, dtype=torch.long)
    num_blocks = max([-(-n // block_size) for n in lengths] + [topk])
    own = (pos // block_size)[:, None, None]
    blocks = torch.arange(num_blocks)
    score = torch.rand(total, h_kv, num_blocks, generator=gen)
    keep = (blocks <= own) & (torch.rand(total, h_kv, num_blocks, generator=gen) >= p_drop)
    score = torch.where(keep, score, torch.full_like(score, -1.0))
    top = torch.topk(score, topk, dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, num_blocks))
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.where(chosen == num_blocks, torch.full_like(chosen, -1), chosen).to(torch.int32)
    return out.to(cu_seqlens.device)


def check_selected_attention(fn, batch: VarlenBatch, block_idx: torch.Tensor, block_size: int, with_dlse: bool = False) -> None:
    """Assert a selected-attention impl's o, lse, dq, dk, dv equal the float64 reference within 2x
    PyTorch's own error in the input dtype (the reference run under native_precision), with the
    impl's allocations NaN-poisoned so that an element it forgets to write fails. ``with_dlse``
    adds a random upstream gradient on lse."""
    from .ops.reference_common import native_precision
    from .ops.selected import reference

    q, k, v, cu = batch.q, batch.k, batch.v, batch.cu_seqlens
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.device, q.dtype)
    dlse = torch.randn(q.shape[:2], generator=torch.Generator().manual_seed(8)).to(q.device) if with_dlse else None
    with poisoned_allocations():
        actual = attention_and_grads(fn, q, k, v, block_idx, cu, block_size, do, dlse)
    ref = reference.selected_attention
    # float64, so that fp32 inputs are bounded by PyTorch's own fp32 error too (large logits).
    expected = attention_and_grads(ref, q.double(), k.double(), v.double(), block_idx, cu, block_size, do, dlse)
    with native_precision():
        native = attention_and_grads(ref, q, k, v, block_idx, cu, block_size, do, dlse)
    assert actual[0].dtype == q.dtype and actual[1].dtype == torch.float32
    for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        assert_close(actual[i], expected[i], native[i], dtype=q.dtype, name=name)


def check_selection(block_idx: torch.Tensor, expected: torch.Tensor, scores: torch.Tensor, cu_seqlens: torch.Tensor, cfg: NSAConfig, rtol: float = 1e-4, positions: torch.Tensor | None = None) -> int:
    """Assert block_idx is a valid top-T under ``scores``; equal to ``expected`` where no near-tie.

    ``positions`` (int64 [rows], default: from ``cu_seqlens``) gives each row's position inside
    its sequence, so that long batches can be checked a slice of rows at a time.
    Returns the number of (token, head) rows that had a near-tie at the top-T boundary.
    """
    total, h_kv, topk = block_idx.shape
    nb = scores.shape[-1]
    if positions is None:
        positions = local_positions(cu_seqlens, total)
    own = (positions // cfg.block_size)[:, None, None]
    valid = block_idx >= 0
    idx = block_idx.long()
    assert (valid.sum(-1) == torch.clamp(own[..., 0] + 1, max=topk)).all(), "wrong number of selected blocks"
    assert (valid[..., :-1] | ~valid[..., 1:]).all(), "-1 padding before a valid entry"
    assert ((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all(), "selected blocks not strictly ascending"
    assert (~valid | (idx <= own)).all(), "selected a block after the own block"
    sel = torch.zeros(total, h_kv, nb + 1, dtype=torch.bool, device=scores.device)
    sel.scatter_(-1, torch.where(valid, idx, nb), True)
    sel = sel[..., :nb]
    ranked = scores.sort(-1, descending=True).values
    ranked = torch.cat([ranked, ranked.new_full((total, h_kv, 1), float("-inf"))], -1)
    kth, next_ = ranked[..., topk - 1], ranked[..., topk]
    finite = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
    tol = rtol * finite.abs().amax(-1).clamp(min=1.0)
    causal = torch.isfinite(scores) | (scores == float("inf"))
    low = torch.where(sel, scores, torch.full_like(scores, float("inf"))).amin(-1)
    high = torch.where(~sel & causal, scores, torch.full_like(scores, float("-inf"))).amax(-1)
    assert (low >= kth - tol).all(), "a selected block scores below the T-th best"
    assert (high <= kth + tol).all(), "an unselected block scores above the T-th best"
    near_tie = (kth - next_ <= tol) & torch.isfinite(next_)
    differ = (block_idx != expected).any(-1)
    assert not (differ & ~near_tie).any(), f"{int((differ & ~near_tie).sum())} rows without a near-tie differ from the reference"
    return int(near_tie.sum())


def nsa_module_forward(impl: str, device: torch.device | str = "cpu"):
    """A zero-argument forward (under no_grad) of a small ``NativeSparseAttention`` module (32
    hidden, 4 query and 2 KV heads of 16, fp16) with selection impl ``impl`` over two packed
    sequences (50 + 20 tokens), on the same input tensors every call: what a model's layer runs."""
    from .modules import NativeSparseAttention

    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=16)
    gen = torch.Generator().manual_seed(0)
    module = NativeSparseAttention(32, 4, 2, head_dim=16, config=cfg, dtype=torch.float16, selection_impl=impl,
                                   device=device)
    x = torch.randn(70, 32, generator=gen).to(device=device, dtype=torch.float16)
    cu = cu_seqlens_of([50, 20], device)

    def fwd():
        with torch.no_grad():
            return module(x, cu)

    return fwd

