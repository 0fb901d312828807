"""fsalab's kernel calls as torch.library custom ops (ops/library.py), on CPU.

Every op passes ``torch.library.opcheck`` (schema with its mutations, fake kernel against the
real one, AOT dispatch with dynamic shapes). The module (dynamo's explain on fake tensors: no
graph break, one graph) and a patched Llama3 / Qwen3 decoder layer compile with
``torch.compile(fullgraph=True)``, forward and backward, and with ``backend="aot_eager"``
(dynamo and AOTAutograd on the eager kernels) the module, the layer and the decode step give
eager's outputs, gradients and cache to the bit, the module launching the same kernels. Inductor
generates its own kernels for torch's ops around fsalab's (RoPE's cos/sin), which round
differently from eager's; ``mode="reduce-overhead"`` runs on the GPU (tests/test_gpu_compile.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsalab.checks import check_cu_seqlens
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.ops import flash
from fsalab.ops.attention import _forward as nsa_attention_forward
from fsalab.ops.compression.compress_kv import _forward as compress_forward
from fsalab.ops.gate import fused as gate
from fsalab.ops.selected import dispatch, fsa, nsa
from fsalab.testing import LaunchCounter, cu_seqlens_of, make_batch, random_block_idx, step_outputs

OPS = torch.ops.fsalab
CFG = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=16)
LENGTHS = [17, 3]  # one sequence with a compressed token and two blocks, one with neither
DTYPE = torch.float16
SCALE = 0.25  # 1 / sqrt(d)


def _inputs():
    """q [total, 2, 16], k/v [total, 1, 16] fp16 and cu_seqlens (one KV head: the interpreter's
    time grows with the programs, NSA's kernels run one per token and head)."""
    b = make_batch(LENGTHS, 2, 1, 16, dtype=DTYPE, seed=0)
    return b.q, b.k, b.v, b.cu_seqlens


def _compression_args():
    """The arguments of the op compress_kv."""
    _, k, v, cu = _inputs()
    gen = torch.Generator().manual_seed(1)
    w_k, w_v = ((torch.randn(1, 256, 16, generator=gen) / 16).to(DTYPE) for _ in range(2))
    pe = (torch.randn(1, 16, 16, generator=gen) * 0.02).to(DTYPE)
    cu_cmp = OPS.compressed_offsets(cu, CFG.kernel_size, CFG.kernel_stride)
    return k, v, w_k, w_v, pe, cu, cu_cmp, CFG.kernel_size, CFG.kernel_stride


def _decode_args(name):
    """The arguments of the decode step's op ``name`` on a cache of 2 sequences filled by a prefill."""
    cfg = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
    torch.manual_seed(0)
    module = NativeSparseAttention(32, 4, 2, head_dim=8, config=cfg, decode_impl="triton", dtype=DTYPE)
    cache = module.new_cache(2, 48)
    with torch.no_grad():
        module(torch.randn(23, 32, dtype=DTYPE), cu_seqlens_of([20, 3]), cache=cache)
    q, k, v = torch.randn(2, 4, 8, dtype=DTYPE), torch.randn(2, 2, 8, dtype=DTYPE), torch.randn(2, 2, 8, dtype=DTYPE)
    if name == "decode_append":
        return (q, k, v, module.compress_k.detach(), module.compress_v.detach(), module.compress_pe.detach(),
                module.inv_freq, 1.0, cache.k, cache.v, cache.k_recent, cache.lengths, cache.k_cmp, cache.v_cmp,
                cfg.as_ints())
    return (q, torch.randn(2, 4, 3, dtype=DTYPE), cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.lengths,
            cache.cmp_logits, cfg.as_ints(), 1 / math.sqrt(8), [])


def _op_args(name: str) -> tuple:
    """The arguments of op ``name``; a backward op's come from its forward's host function."""
    q, k, v, cu = _inputs()
    block_idx = random_block_idx(cu, 1, CFG.topk, CFG.block_size, torch.Generator().manual_seed(2))
    do = torch.randn_like(q)
    window = (cu, cu, 1, 0, CFG.window_size, SCALE)
    selection = (q, k, v, block_idx, cu, CFG.block_size, SCALE)
    paper = (True, False, False)  # the paper's kernels and switches: the fast ones run in the module tests below
    if name == "flash_attention":  # the window mask: the compressed one runs in the module tests below
        return q, k, v, *window, False
    if name == "flash_attention_backward":
        o, lse = flash._forward(q, k, v, *window)
        return do, torch.zeros_like(lse), q, k, v, o, lse, *window, False
    if name == "compressed_offsets":
        return cu, CFG.kernel_size, CFG.kernel_stride
    if name == "compress_kv":
        return _compression_args()
    if name == "compress_kv_backward":
        k, v, w_k, w_v, pe, cu, cu_cmp, size, stride = _compression_args()
        k_cmp, v_cmp, tab = compress_forward(k, v, w_k, w_v, pe, cu, cu_cmp, size, stride)
        return torch.randn_like(k_cmp), torch.randn_like(v_cmp), k, v, w_k, w_v, pe, tab, size, stride, True, True, True
    if name == "select_blocks":
        k, v, w_k, w_v, pe, cu, cu_cmp, size, stride = _compression_args()
        k_cmp, v_cmp, _ = compress_forward(k, v, w_k, w_v, pe, cu, cu_cmp, size, stride)
        _, lse = flash._forward(q, k_cmp, v_cmp, cu, cu_cmp, stride, size - 1, flash.NO_WINDOW, SCALE)
        return q, k_cmp, lse, cu, cu_cmp, CFG.as_ints(), SCALE, "auto"
    if name == "selected_attention_nsa":
        return *selection, []
    if name == "selected_attention_nsa_backward":  # the op builds the index lists
        o, lse, tok_start = nsa._forward(*selection)
        return do, None, q, k, v, o, lse, block_idx, cu, tok_start, CFG.block_size, SCALE, []
    if name == "selected_attention_fsa":
        return *selection, *paper
    if name == "selected_attention_fsa_backward":
        o, lse, index = fsa._forward_indexed(*selection, *paper)
        return do, torch.randn_like(lse), q, k, v, o, lse, index, CFG.block_size, SCALE, *paper
    if name == "selected_attention_auto":
        return *selection, True
    if name == "selected_attention_auto_backward":
        o, lse, index = dispatch._forward_chosen(*selection, True)
        return do, None, q, k, v, o, lse, block_idx, cu, index, CFG.block_size, SCALE
    if name in ("nsa_attention", "nsa_attention_backward"):
        k, v, w_k, w_v, pe, cu, *_ = _compression_args()
        gen = torch.Generator().manual_seed(3)
        angles = torch.randn(q.shape[0], 8, generator=gen)
        emb = torch.cat([angles, angles], dim=-1)
        args = (q, k, v, w_k, w_v, pe, torch.randn(*q.shape[:2], 3, generator=gen).to(DTYPE), cu,
                emb.cos().to(DTYPE), emb.sin().to(DTYPE))
        if name == "nsa_attention":
            return *args, CFG.as_ints(), "fsa", True
        o, saved = nsa_attention_forward(*args, CFG.as_ints(), "fsa", True)
        return do, *args, saved, CFG.as_ints(), "fsa", True, True
    if name in ("gated_sum", "gated_sum_backward"):
        outs = [torch.randn_like(q) for _ in range(3)]
        logits = torch.randn(*q.shape[:2], 3, dtype=DTYPE)
        return (*outs, logits) if name == "gated_sum" else (do, *outs, logits)
    return _decode_args(name)


def _op_names() -> list[str]:
    return sorted(name for name in dir(OPS) if isinstance(getattr(OPS, name), torch._ops.OpOverloadPacket))


def test_the_namespace_holds_the_ops():
    """Every op below is registered (and no other: each is opchecked)."""
    assert _op_names() == sorted([
        "flash_attention", "flash_attention_backward", "compressed_offsets", "compress_kv", "compress_kv_backward",
        "select_blocks", "selected_attention_nsa", "selected_attention_nsa_backward", "selected_attention_fsa",
        "selected_attention_fsa_backward", "selected_attention_auto", "selected_attention_auto_backward",
        "gated_sum", "gated_sum_backward", "decode_append", "nsa_decode", "nsa_attention", "nsa_attention_backward",
    ])


@pytest.mark.slow(4)
@pytest.mark.parametrize("name", _op_names())
def test_opcheck(name):
    """Schema (mutated arguments declared), fake kernel (shapes, dtypes and strides of the real
    outputs, also with dynamic shapes) and AOT dispatch of the op."""
    torch.library.opcheck(getattr(OPS, name).default, _op_args(name))


def _module(selection: str) -> NativeSparseAttention:
    """Hidden 32, 2 query heads of 16 over 1 KV head, every branch on its Triton op."""
    torch.manual_seed(0)
    return NativeSparseAttention(32, 2, 1, head_dim=16, config=CFG, selection_impl=selection, compression_impl="triton",
                                 window_impl="triton", gate_impl="triton", dtype=DTYPE)


def _assert_bitwise(compiled: list[torch.Tensor], eager: list[torch.Tensor]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(compiled, eager)) if not torch.equal(a, b)]
    assert len(compiled) == len(eager) and not differ, f"compiled differs from eager in tensors {differ}"


@pytest.mark.slow(12)
def test_module_compiles_into_one_graph_matching_eager_to_the_bit():
    """No graph break and one graph (dynamo's explain); compiled with fullgraph, forward and
    backward give eager's bits and launch the same kernels. (No host read can hide in the
    compiled graph: fullgraph would fail on it.)"""
    torch._dynamo.reset()
    module = _module("fsa")
    params = list(module.parameters())
    x, cu = torch.randn(sum(LENGTHS), 32, dtype=DTYPE), cu_seqlens_of(LENGTHS)
    with FakeTensorMode() as mode:  # dynamo traces alike on fake tensors, and no kernel runs
        fake_x, fake_cu = torch.randn(sum(LENGTHS), 32, dtype=DTYPE), mode.from_tensor(cu_seqlens_of(LENGTHS))
        explanation = torch._dynamo.explain(_module("fsa"))(fake_x, fake_cu)
    assert (explanation.graph_break_count, explanation.graph_count) == (0, 1), explanation.break_reasons
    with LaunchCounter(aten=False) as eager_launches:
        eager = step_outputs(module, params, x, cu)
    compiled_module = torch.compile(module, fullgraph=True, backend="aot_eager")
    with LaunchCounter(aten=False) as compiled_launches:  # the fake kernels launch nothing while it compiles
        compiled = step_outputs(compiled_module, params, x, cu)
    _assert_bitwise(compiled, eager)
    assert compiled_launches.counts == eager_launches.counts
    assert len(eager_launches.counts) >= 10, dict(eager_launches.counts)  # every branch's kernels, both directions


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 64, "bos_token_id": None, "eos_token_id": None}


def _patched_layer(name: str):
    """The decoder layer of a one-layer tiny ``name`` patched with NSA (Triton ops), its input
    hidden states [1, 20, 32] and HF's position_embeddings for it."""
    from fsalab.models import configs, patch

    model = configs.build_model(name, 1, "cpu", DTYPE, **TINY)
    patch.patch_model(model, "fsa", CFG, compression_impl="triton", window_impl="triton", gate_impl="triton")
    configs.init_random_(model, seed=0, std=0.2)
    x = torch.randn(1, 20, 32, dtype=DTYPE)
    positions = torch.arange(20)[None]
    return model.model.layers[0], x, model.model.rotary_emb(x, positions)


@pytest.mark.slow(12)
@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-14b"])
def test_patched_decoder_layer_compiles_into_one_graph_matching_eager_to_the_bit(name):
    """fullgraph: no graph break, forward and backward, with eager's bits (Qwen3 adds QK-norm)."""
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    layer, x, embeddings = _patched_layer(name)
    params = list(layer.parameters())
    eager = step_outputs(layer, params, x, position_embeddings=embeddings)
    compiled = step_outputs(torch.compile(layer, fullgraph=True, backend="aot_eager"), params, x,
                     position_embeddings=embeddings)
    _assert_bitwise(compiled, eager)


@pytest.mark.slow(10)
@torch.no_grad()
def test_compiled_decode_step_matches_eager_to_the_bit():
    """Two steps each: the same outputs, and the same cache after them (the ops write it)."""
    torch._dynamo.reset()
    cfg = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
    torch.manual_seed(0)
    module = NativeSparseAttention(32, 4, 2, head_dim=8, config=cfg, decode_impl="triton", dtype=DTYPE)
    cache = module.new_cache(2, 48)
    module(torch.randn(23, 32, dtype=DTYPE), cu_seqlens_of([20, 3]), cache=cache)
    x = torch.randn(2, 32, dtype=DTYPE)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    decode = torch.compile(module.decode, fullgraph=True, backend="aot_eager")
    eager = [module.decode(x, eager_cache) for _ in range(2)]
    compiled = [decode(x, compiled_cache) for _ in range(2)]
    names = ("k", "v", "k_cmp", "v_cmp", "k_recent", "lengths", "cmp_logits")
    _assert_bitwise(compiled + [getattr(compiled_cache, n) for n in names],
                    eager + [getattr(eager_cache, n) for n in names])


def test_value_checks_are_device_asserts_under_compile():
    """Under torch.compile a value check is a graph node (no break), which still rejects bad offsets."""
    torch._dynamo.reset()

    def checked(cu):
        check_cu_seqlens(cu, 5, cu.device)
        return cu + 1

    compiled = torch.compile(checked, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(cu_seqlens_of([2, 3])), cu_seqlens_of([2, 3]) + 1)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        compiled(torch.tensor([0, 3, 2, 5], dtype=torch.int32))


def test_eager_calls_skip_the_ops():
    """Outside torch.compile the kernels' functions run their host functions directly: no
    dispatch of a custom op (whose Python costs more than the host function) on the eager path."""
    q, k, v, cu = _inputs()
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.namespace)
            return func(*args, **(kwargs or {}))

    outs = [torch.randn_like(q, requires_grad=True) for _ in range(3)]
    with Ops():
        o = gate.gated_sum(*outs, torch.randn(*q.shape[:2], 3, dtype=DTYPE))
        o.float().sum().backward()
        flash.flash_attention(q, k, v, cu, window_size=CFG.window_size)
    assert seen and "fsalab" not in seen


def test_a_backward_on_fake_tensors_takes_the_op():
    """AOTAutograd traces a backward on fake tensors outside dynamo's trace (where
    ``torch.compiler.is_compiling()`` can be False): a fake probe tensor picks the op, whose fake
    kernel runs instead of a launch on tensors without data; a real one the host function."""
    from fsalab.ops.library import op_or

    with FakeTensorMode():
        fake = torch.empty(3)
    assert op_or("gated_sum_backward", gate._backward, fake) is OPS.gated_sum_backward.default
    assert op_or("gated_sum_backward", gate._backward, torch.empty(3)) is gate._backward


def test_the_window_choice_traces_without_a_graph_break():
    """The whole attention's "auto" window reads whether flash-attn is installed without an
    import statement while dynamo traces (a missing package's import breaks the graph)."""
    from fsalab.ops import attention

    torch._dynamo.reset()
    q = torch.randn(4, 2, 16, dtype=DTYPE)
    choose = torch.compile(lambda t: attention.fused("triton", "fsa", "auto", "triton", t), fullgraph=True,
                           backend="eager")
    assert choose(q) == attention.fused("triton", "fsa", "auto", "triton", q)
