"""NSA decode (DESIGN §9): the cache, the Triton decode step against its fp32 reference, and
decode against the prefill module's output for every position of ragged batches."""

import pytest
import torch

from fsalab import settings
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.ops import decode
from fsalab.ops.decode import NSADecodeCache
from fsalab.ops.decode import reference as decode_reference
from fsalab.ops.reference_common import native_precision
from fsalab.testing import assert_close, cu_seqlens_of, poisoned_allocations

# The Triton step on CPU tensors runs through the interpreter; on a GPU host tests/test_decode_gpu.py covers it.
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter")
IMPLS = ["reference", pytest.param("triton", marks=INTERPRETED)]

# l = 8, s = 4, B = 16: a 2-block top-T, a window of 8 keys; sequences cross many compression
# windows, selection blocks and the window within a few dozen tokens.
TINY = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
# Three blocks selected of up to five, so top-T ranks real scores, not only forced blocks.
WIDE = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=3, init_blocks=1, local_blocks=1, window_size=16)


def _module(cfg, h, h_kv, d, dtype, impl, seed=0):
    torch.manual_seed(seed)
    return NativeSparseAttention(8 * h_kv, h, h_kv, head_dim=d, config=cfg, dtype=dtype, decode_impl=impl)


def _decode_all(module, xs, prefill, capacity):
    """Prefill sequence b with its first prefill[b] tokens, then decode the rest one token a step
    (sequences that are done feed a dummy token into their own cache row). Returns
    {(b, t): output of token t} for every decoded token."""
    cache = module.new_cache(len(xs), capacity)
    module(torch.cat([x[:p] for x, p in zip(xs, prefill)]), cu_seqlens_of(prefill), cache=cache)
    steps = max(x.shape[0] - p for x, p in zip(xs, prefill))
    out = {}
    for step in range(steps):
        x = torch.stack([x[min(p + step, x.shape[0] - 1)] for x, p in zip(xs, prefill)])
        o = module.decode(x, cache)
        for b, (xb, p) in enumerate(zip(xs, prefill)):
            if p + step < xb.shape[0]:
                out[b, p + step] = o[b]
    return out


# Ragged: prefills shorter than kernel_size (1, 5), one of exactly a block, one mid-block; the
# decode steps create the first compressed token (n = 8), complete blocks (n = 16, 32) and fill
# the window. g = 4 and g = 5 (heads not a power of two), d = 8 and d = 12 (padded head dim).
# The Triton step runs through the interpreter (~5 s a step on CI): shorter sequences there,
# the same events (the step against the reference on longer caches: test_step_matches_reference).
CASES = {("reference", "tiny-g4"): ([40, 21, 36, 9], [1, 5, 16, 9]), ("triton", "tiny-g4"): ([17, 10], [6, 1]),
         ("reference", "wide-g5-d12"): ([40, 21, 36, 9], [1, 5, 16, 9]), ("triton", "wide-g5-d12"): ([18, 9], [15, 1])}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,cfg,h,h_kv,d", [("tiny-g4", TINY, 8, 2, 8), ("wide-g5-d12", WIDE, 10, 2, 12)],
                         ids=["tiny-g4", "wide-g5-d12"])
def test_decode_equals_prefill_fp32(impl, case, cfg, h, h_kv, d):
    module = _module(cfg, h, h_kv, d, torch.float32, impl)
    gen = torch.Generator().manual_seed(1)
    lengths, prefill = CASES[impl, case]
    xs = [torch.randn(n, module.hidden_size, generator=gen) for n in lengths]
    decoded = _decode_all(module, xs, prefill, capacity=64)
    for b, x in enumerate(xs):
        full = module(x, cu_seqlens_of([x.shape[0]]))
        for t in range(prefill[b], x.shape[0]):
            torch.testing.assert_close(decoded[b, t], full[t], atol=2e-6, rtol=2e-5, msg=f"sequence {b}, token {t}")


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_equals_prefill_fp16(impl):
    """fp16 decode against the float64 prefill, within twice the fp16 prefill's own error."""
    module = _module(TINY, 8, 2, 8, torch.float16, impl, seed=3)
    exact = _module(TINY, 8, 2, 8, torch.float64, "reference", seed=3)
    exact.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    gen = torch.Generator().manual_seed(4)
    lengths, prefill = ([34, 12], [3, 8]) if impl == "reference" else ([17, 9], [9, 1])
    xs = [torch.randn(n, module.hidden_size, generator=gen).half() for n in lengths]
    decoded = _decode_all(module, xs, prefill, capacity=48)
    for b, x in enumerate(xs):
        cu = cu_seqlens_of([x.shape[0]])
        expected, native = exact(x.double(), cu), module(x, cu)
        rows = list(range(prefill[b], x.shape[0]))
        actual = torch.stack([decoded[b, t] for t in rows])
        assert_close(actual, expected[rows], native[rows], dtype=torch.float16, name=f"sequence {b}")


def _random_cache(cfg, lengths, h, h_kv, d, dtype, capacity, seed):
    """A cache for h query heads filled from a random prefill with random compression weights
    (rotation omitted: the step's attention does not care how keys were rotated); its
    ``cmp_logits`` scratch NaN-poisoned (a step must read only the logits it wrote)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    cache = NSADecodeCache.allocate(len(lengths), capacity, h_kv, d, cfg, dtype, "cpu", num_heads=h)
    cache.cmp_logits.fill_(float("nan"))
    k, v = rnd(total, h_kv, d), rnd(total, h_kv, d)
    w = [rnd(h_kv, cfg.kernel_size * d, d) / (cfg.kernel_size * d) ** 0.5 for _ in range(2)]
    pe = rnd(h_kv, cfg.kernel_size, d) * 0.02
    from fsalab.ops.compression.reference import compress_kv

    cu = cu_seqlens_of(lengths)
    k_cmp, v_cmp, _ = compress_kv(k, v, w[0], w[1], pe, cu, cfg)
    cache.fill(k, k, v, k_cmp.to(dtype), v_cmp.to(dtype), cu)
    return cache, gen


@INTERPRETED
@pytest.mark.parametrize("dtype,splits,g,q_scale", [
    (torch.float32, (1, 1, 1), 1, 2.0), (torch.float32, (5, 4, 3), 5, 2.0), (torch.float32, (3, 2, 2), 4, 2.0),
    (torch.float16, (3, 2, 2), 5, 2.0), (torch.float16, (5, 4, 3), 1, 2.0), (torch.float16, (1, 1, 1), 4, 2.0),
    # groups of 6 and 7 heads (padded rows), and logits 8x larger
    (torch.float32, (3, 2, 2), 6, 8.0), (torch.float16, (5, 4, 3), 7, 8.0),
])
def test_step_matches_reference(dtype, splits, g, q_scale):
    """The Triton step against the fp32 reference on one cache state: block_idx equal, o within
    twice PyTorch's own error in the dtype; allocations NaN-poisoned (an unwritten partial fails)."""
    h_kv, d = 2, 16
    lengths = [60, 1, 7, 8, 33, 64]  # below l, the first compressed token, a full block, capacity
    cache, gen = _random_cache(WIDE, lengths, h_kv * g, h_kv, d, dtype, capacity=64, seed=sum(splits) + g)
    batch, h = len(lengths), h_kv * g
    q = (torch.randn(batch, h, d, generator=gen) * q_scale).to(dtype)
    gates = torch.randn(batch, h, 3, generator=gen).to(dtype)
    with pytest.raises(ValueError, match="capacity"):
        cache.check_step()  # 64 tokens: full; the attention itself still runs on it
    with poisoned_allocations():
        o, block_idx = decode.nsa_decode(q, cache, gates, splits=splits)
    expected, expected_idx = decode_reference.nsa_decode(q.double(), cache, gates)
    with native_precision():
        native, _ = decode_reference.nsa_decode(q, cache, gates)
    assert o.dtype == dtype and block_idx.dtype == torch.int32
    assert torch.equal(block_idx, expected_idx)
    assert_close(o, expected, native, dtype=dtype)


@INTERPRETED
def test_step_lengths_live_on_device():
    """Launch shapes depend on batch and capacity only: the same call serves other lengths."""
    cache, gen = _random_cache(WIDE, [20, 50], 2, 1, 16, torch.float32, capacity=64, seed=0)
    q, gates = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 3, generator=gen)
    first, _ = decode.nsa_decode(q, cache, gates)
    cache.lengths.copy_(torch.tensor([30, 12], dtype=torch.int32))
    second, idx = decode.nsa_decode(q, cache, gates)
    expected, expected_idx = decode_reference.nsa_decode(q, cache, gates)
    assert torch.equal(idx, expected_idx)
    torch.testing.assert_close(second, expected.float(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first, second)


@INTERPRETED
@pytest.mark.parametrize("splits,g", [((3, 2, 2), 3), ((5, 3, 1), 1)])
def test_consecutive_steps_score_blocks_from_their_own_logits(splits, g):
    """Four Triton steps (append, then attention) over one cache: sequences reaching n = 64 and
    80 (a compressed token and a block completed), a short one, all with 5 or more blocks so that
    top-T ranks real scores; the compressed-attention ranges (S_c = 3, 5) cut the tokens of one
    block apart. Every step: block_idx equals the fp64 reference's on the same cache state and o
    is close; the stored logits of tokens j < n_cmp equal q·k_cmp·scale·log2(e) of this step's
    q, the rest of the NaN-poisoned scratch stays unwritten; the scratch is re-poisoned before
    each step, so a score read of a logit this step did not write fails."""
    from fsalab.ops._triton import LOG2E

    h_kv, d, dtype = 2, 16, torch.float32
    h = h_kv * g
    cfg = WIDE
    cache, gen = _random_cache(cfg, [61, 77, 30], h, h_kv, d, dtype, capacity=96, seed=11 + g)
    scale = d ** -0.5
    for step in range(4):
        q, k, v, w_k, w_v, pe = _token_inputs(cache, h, 100 * g + step, dtype)
        q = q * 3  # peaked scores: the ranking does not hinge on near ties
        gates = torch.randn(cache.batch, h, 3, generator=gen)
        cache.cmp_logits.fill_(float("nan"))
        q_rot = decode.append_token(cache, q, k, v, w_k, w_v, pe, torch.ones(d // 2) * 0.1)
        o, block_idx = decode.nsa_decode(q_rot, cache, gates, splits=splits)
        expected, expected_idx = decode_reference.nsa_decode(q_rot.double(), cache, gates)
        assert torch.equal(block_idx, expected_idx), f"step {step}"
        torch.testing.assert_close(o, expected.float(), atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        for b, n in enumerate(cache.lengths.tolist()):
            n_cmp = cfg.num_compressed(n)
            k_cmp = cache.k_cmp[b, :n_cmp].double().repeat_interleave(g, dim=1)  # [n_cmp, h, d]
            exact = torch.einsum("hd,jhd->hj", q_rot[b].double(), k_cmp) * scale * LOG2E
            torch.testing.assert_close(cache.cmp_logits[b, :, :n_cmp].double(), exact, atol=1e-5, rtol=1e-5)
            assert cache.cmp_logits[b, :, n_cmp:].isnan().all(), f"step {step}: logits written past n_cmp"
    assert cache.lengths.tolist() == [65, 81, 34]


@pytest.mark.parametrize("impl", IMPLS)
def test_step_stores_the_prefill_compressed_token(impl):
    """Prefills of 7, 11 and 9 tokens; the step brings them to 8 and 12 (compressed tokens 0 and
    1 completed) and 10 (none): the stored tokens equal those of a prefill of the longer
    sequences, keys rotated at their window's start; no other row of k_cmp / v_cmp but the
    scratch row changes."""
    cfg = TINY
    module = _module(cfg, 4, 2, 8, torch.float32, impl)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, module.hidden_size, generator=gen) for n in (8, 12, 10)]
    cache = module.new_cache(3, 32)
    module(torch.cat([x[:-1] for x in xs]), cu_seqlens_of([7, 11, 9]), cache=cache)
    before = cache.k_cmp.clone(), cache.v_cmp.clone()
    module.decode(torch.stack([x[-1] for x in xs]), cache)
    full = module.new_cache(3, 32)
    module(torch.cat(xs), cu_seqlens_of([8, 12, 10]), cache=full)
    assert cache.lengths.tolist() == [8, 12, 10]
    for b, j in ((0, 0), (1, 1)):
        torch.testing.assert_close(cache.k_cmp[b, j], full.k_cmp[b, j], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cache.v_cmp[b, j], full.v_cmp[b, j], atol=1e-6, rtol=1e-5)
    written = torch.zeros(cache.k_cmp.shape[:2], dtype=torch.bool)
    written[0, 0] = written[1, 1] = True
    for now, old in zip((cache.k_cmp, cache.v_cmp), before):
        assert torch.equal(now[:, :-1][~written[:, :-1]], old[:, :-1][~written[:, :-1]])


def _token_inputs(cache, h, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    batch, h_kv, d, l = cache.batch, cache.num_kv_heads, cache.head_dim, cache.cfg.kernel_size
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q, k, v = rnd(batch, h, d), rnd(batch, h_kv, d), rnd(batch, h_kv, d)
    w_k, w_v = (rnd(h_kv, l * d, d) / (l * d) ** 0.5 for _ in range(2))
    return q, k, v, w_k, w_v, rnd(h_kv, l, d) * 0.02


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_append_token_matches_reference(dtype, scaling):
    """The two Triton launches against the op-by-op reference on one cache state: lengths 7
    (completes compressed token 0), 11 (token 1 at window start 4), 20 (none), 24 (full: the
    token goes to scratch and the length stays, value checks off), position 2000 in a second
    case (large angles). q and every cache tensor but the scratch rows within the dtype's
    rounding (fp32: up to the last bits of cos/sin); NaN-poisoned q output."""
    from fsalab.modules.rope import rope_inv_freq

    settings.configure(value_checks=False)
    h_kv, d, g = 2, 12, 3
    inv_freq = rope_inv_freq(d, 10000.0)
    for lengths, capacity in (([7, 11, 20, 24], 24), ([1999, 5], 2048)):
        cache, _ = _random_cache(TINY, lengths, h_kv * g, h_kv, d, dtype, capacity=capacity, seed=len(lengths))
        twin = cache.clone()
        args = _token_inputs(cache, h_kv * g, 5, dtype)
        with poisoned_allocations():
            q_rot = decode.append_token(cache, *args, inv_freq, scaling)
        expected = decode_reference.append_token(twin, *args, inv_freq, scaling)
        tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
        torch.testing.assert_close(q_rot, expected, **tol)
        assert torch.equal(cache.lengths, twin.lengths)
        assert cache.lengths.tolist()[:1] == [lengths[0] + 1]
        for name, a, b in zip(("k", "v", "k_cmp", "v_cmp", "k_recent"), _snapshot(cache), _snapshot(twin)):
            # Scratch rows aside: the reference sends unwanted writes there, the kernels skip them.
            torch.testing.assert_close(a[:, :-1], b[:, :-1], **tol, msg=lambda m: f"{name}: {m}")


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_append_token_rope_equals_the_module_rope(dtype):
    """The kernel's RoPE (fp32 cos/sin, one rounding) against the exact rotation of the same fp32
    angles, within twice the error of the module's / HF's (cos/sin rounded to the dtype first),
    positions up to 2^17 with Llama-3 frequencies."""
    from fsalab.modules.rope import apply_rope, rope_inv_freq

    d = 16
    inv_freq = rope_inv_freq(d, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    lengths = [3, 100, 4097, 131071]
    cache = NSADecodeCache.allocate(4, 131072, 1, d, TINY, dtype, "cpu", num_heads=4)
    cache.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    cache.filled = True
    q, k, v, w_k, w_v, pe = _token_inputs(cache, 4, 7, dtype)
    q_rot = decode.append_token(cache, q, k, v, w_k, w_v, pe, inv_freq)
    pos = torch.tensor(lengths)
    for name, actual, x in (("q", q_rot, q), ("k", cache.k[torch.arange(4), pos], k)):
        exact = decode_reference.rope(x.double(), pos, inv_freq)
        assert_close(actual, exact, apply_rope(x, pos, inv_freq), dtype=dtype, name=name)


# ------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing in the cache changed
# ------------------------------------------------------------------------------------------


def _snapshot(cache):
    return [t.clone() for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.k_recent, cache.lengths)]


def _unchanged(cache, snap):
    return all(torch.equal(a, b) for a, b in zip(_snapshot(cache), snap))


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_is_rejected_without_touching_the_cache(impl):
    module = _module(TINY, 4, 2, 8, torch.float32, impl)
    cache = module.new_cache(2, 16)
    x = torch.randn(2, module.hidden_size)
    with pytest.raises(ValueError, match="decode before prefill"):
        module.decode(x, cache)
    module(torch.randn(16 + 3, module.hidden_size), cu_seqlens_of([16, 3]), cache=cache)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="cache full"):
        module.decode(x, cache)  # sequence 0 holds capacity = 16 tokens
    with pytest.raises(TypeError, match="dtype"):
        module.decode(x.double(), cache)
    with pytest.raises(ValueError, match="one token per sequence"):
        module.decode(torch.randn(3, module.hidden_size), cache)
    with pytest.raises(ValueError, match="hidden size"):
        module.decode(torch.randn(2, module.hidden_size + 1), cache)
    other = _module(WIDE, 4, 2, 8, torch.float32, impl)
    with pytest.raises(ValueError, match="built for"):
        other.decode(x, cache)
    assert _unchanged(cache, snap)


def test_prefill_longer_than_capacity_is_rejected():
    module = _module(TINY, 4, 2, 8, torch.float32, "reference")
    cache = module.new_cache(2, 16)
    with pytest.raises(ValueError, match="longer than the cache capacity"):
        module(torch.randn(17 + 2, module.hidden_size), cu_seqlens_of([17, 2]), cache=cache)
    with pytest.raises(ValueError, match="sequences"):
        module(torch.randn(6, module.hidden_size), cu_seqlens_of([2, 2, 2]), cache=cache)
    with pytest.raises(ValueError, match="packed input"):
        module(torch.randn(2, 4, module.hidden_size), cache=cache)


@INTERPRETED
def test_step_argument_checks():
    cache, gen = _random_cache(TINY, [9, 4], 4, 2, 8, torch.float32, capacity=16, seed=0)
    q, gates = torch.randn(2, 4, 8), torch.randn(2, 4, 3)
    with pytest.raises(TypeError, match="dtype"):
        decode.nsa_decode(q.half(), cache, gates)
    with pytest.raises(ValueError, match="q must be"):
        decode.nsa_decode(torch.randn(2, 3, 8), cache, gates)
    with pytest.raises(ValueError, match="gate_logits"):
        decode.nsa_decode(q, cache, torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match="expected"):
        decode.nsa_decode(q.to("meta"), cache, gates)
    with pytest.raises(ValueError, match="shape"):
        cache.append(torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match="impl"):
        decode.decode_ops("flash", torch.device("cpu"))


def test_cache_memory_and_layout():
    cfg = TINY
    cache = NSADecodeCache.allocate(3, 64, 2, 8, cfg, torch.float16, "cpu", num_heads=6)
    raw = 2 * 3 * 65 * 2 * 8
    cmp = 2 * 3 * (64 // cfg.kernel_stride + 1) * 2 * 8
    recent = 3 * (cfg.kernel_size + 1) * 2 * 8
    logits = 3 * 6 * (64 // cfg.kernel_stride)  # fp32 scratch of the Triton step
    assert cache.nbytes == 2 * (raw + cmp + recent) + 4 * 3 + 4 * logits
    assert cache.cmp_logits.dtype == torch.float32 and cache.cmp_logits.is_contiguous()
    assert cache.capacity == 64 and cache.batch == 3 and cache.num_heads == 6 and not cache.filled
    with pytest.raises(ValueError, match="capacity"):
        NSADecodeCache.allocate(1, 0, 2, 8, cfg, torch.float16, "cpu", num_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        NSADecodeCache.allocate(1, 64, 2, 8, cfg, torch.float16, "cpu", num_heads=3)
    twin = cache.clone()
    assert twin.cmp_logits.shape == cache.cmp_logits.shape and twin.k.data_ptr() != cache.k.data_ptr()


@INTERPRETED
def test_step_launches():
    """A step's bookkeeping is two launches, its attention five (DESIGN §9); no aten op between
    them (launch-bound at short contexts: each costs the host ~µs to enqueue)."""
    from fsalab.testing import LaunchCounter

    settings.configure(value_checks=False)
    module = _module(TINY, 4, 2, 8, torch.float16, "triton")
    cache, gen = _random_cache(TINY, [13, 40], 4, 2, 8, torch.float16, capacity=48, seed=0)
    q, k, v = torch.randn(2, 4, 8, generator=gen).half(), *torch.randn(2, 2, 2, 8, generator=gen).half()
    gates = torch.randn(2, 4, 3, generator=gen).half()
    with LaunchCounter() as bookkeeping:
        decode.append_token(cache, q, k, v, module.compress_k, module.compress_v, module.compress_pe, module.inv_freq)
    with LaunchCounter() as attention:
        decode.nsa_decode(q, cache, gates)
    kernels = ("_cmp_partial_kernel", "_score_kernel", "_topk_kernel", "_sw_partial_kernel", "_combine_kernel")
    assert dict(attention.counts) == {f"triton:{k}": 1 for k in kernels}
    assert dict(bookkeeping.counts) == {"triton:_append_kernel": 1, "triton:_compress_step_kernel": 1}
