"""Published architectures, the attention swap, and the end-to-end runners at tiny sizes (CPU)."""

import copy
import math

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from fsalab import NSAConfig
from fsalab.bench import convergence, model_build, points, prefill, rows, train
from fsalab.models import configs, patch

# A tiny width that keeps each architecture's features (GQA, Qwen3 QK-norm, Qwen2 biases).
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 256, "bos_token_id": None, "eos_token_id": None}
MODELS = ["llama3-8b", "qwen3-14b", "qwen2.5-32b"]
CPU = torch.device("cpu")


def tiny_model(name: str, seed: int, layers: int = 2) -> nn.Module:
    """A random fp32 tiny model; norms and biases randomised so the swap test sees them."""
    model = configs.build_model(name, layers, "cpu", torch.float32, **TINY)
    configs.init_random_(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
    return model


# ------------------------------------------------------------------ published shapes


@pytest.mark.parametrize("name", MODELS)
def test_published_architecture_on_meta(name):
    spec = configs.get_spec(name)
    model = configs.build_model(name)
    assert model.device.type == "meta"
    assert configs.count_parameters(model) == spec.num_params
    assert round(spec.num_params / 1e9, 2) == {"llama3-8b": 8.03, "qwen3-14b": 14.77, "qwen2.5-32b": 32.76}[name]
    cfg, c = spec.config, model.config
    h, h_kv, d, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, cfg["hidden_size"]
    assert (h, h_kv, d) == {"llama3-8b": (32, 8, 128), "qwen3-14b": (40, 8, 128), "qwen2.5-32b": (40, 8, 128)}[name]
    layers = model.model.layers
    assert len(layers) == spec.num_layers
    attn, mlp = layers[0].self_attn, layers[0].mlp
    assert attn.q_proj.weight.shape == (h * d, hidden)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (h_kv * d, hidden)
    assert attn.o_proj.weight.shape == (hidden, h * d)
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (cfg["intermediate_size"], hidden)
    assert model.model.embed_tokens.weight.shape == model.lm_head.weight.shape == (cfg["vocab_size"], hidden)
    assert not c.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight
    assert c.rope_parameters["rope_theta"] == cfg["rope_theta"]
    assert c.rope_parameters["rope_type"] == "default"
    assert hasattr(attn, "q_norm") == (name == "qwen3-14b")
    assert (attn.q_proj.bias is not None) == (name == "qwen2.5-32b")
    assert attn.o_proj.bias is None
    assert c._attn_implementation == "sdpa"


def test_num_layers_override_and_nsa_on_meta():
    """A 3-layer slice; the swap at full width on the meta device adds exactly NSA's parameters."""
    spec = configs.get_spec("Qwen/Qwen3-14B")
    model = configs.build_model("qwen3-14b", num_layers=3)
    assert len(model.model.layers) == 3 and model.config.num_hidden_layers == 3
    before = configs.count_parameters(model)
    cfg = NSAConfig()
    patch.patch_model(model, "fsa", cfg)
    h, h_kv, d, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.config["hidden_size"]
    per_layer = 3 * h * hidden + 2 * h_kv * cfg.kernel_size * d * d + h_kv * cfg.kernel_size * d
    assert configs.count_parameters(model) == before + 3 * per_layer
    with pytest.raises(ValueError, match="unknown model"):
        configs.get_spec("gpt2")


# ------------------------------------------------------------------ the swap


def force_selected_only(model: nn.Module) -> None:
    """Gates sigma(-100) ~ 0 for compressed and window, sigma(100) = 1 for selected."""
    for adapter in patch.attention_modules(model):
        h = adapter.nsa.num_heads
        gate = nn.Linear(adapter.nsa.hidden_size, 3 * h, bias=True)
        with torch.no_grad():
            gate.weight.zero_()
            gate.bias.copy_(torch.tensor([-100.0, 100.0, -100.0]).repeat(h))
        adapter.nsa.gate_proj = gate


@pytest.mark.parametrize("name", MODELS)
def test_swap_preserves_hf_outputs_as_full_attention(name, seed):
    """With topk >= blocks per sequence every causal block is selected, so the selected branch is
    exact causal attention; gating everything else off, the NSA model must reproduce HF's own
    (SDPA) logits and gradients: same projections, QK-norm, biases, RoPE, GQA layout."""
    torch.manual_seed(seed)
    hf = tiny_model(name, seed)
    nsa = copy.deepcopy(hf)
    kept = dict(nsa.named_parameters())  # the adapter reuses these very tensors
    patch.patch_model(nsa, "reference", NSAConfig(block_size=64, topk=4, window_size=64))
    force_selected_only(nsa)
    ids = torch.randint(0, TINY["vocab_size"], (2, 150), generator=torch.Generator().manual_seed(seed))
    with patch.attention_context("sdpa_math"):
        ref = hf(input_ids=ids, use_cache=False).logits
    out = nsa(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    ref.square().mean().backward()
    out.square().mean().backward()
    nsa_params = {id(p) for p in nsa.parameters()}
    for name_, p_hf in hf.named_parameters():
        p_nsa = kept[name_]
        assert id(p_nsa) in nsa_params, f"{name_} was dropped by the swap"
        torch.testing.assert_close(p_nsa.grad, p_hf.grad, rtol=1e-3, atol=1e-6, msg=lambda m, n=name_: f"{n}: {m}")


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-14b"])
def test_patched_forward_backward_reference(name, seed):
    """Default NSA gates and a short window: every branch contributes and gets gradients."""
    model = tiny_model(name, seed)
    patch.patch_model(model, "reference", NSAConfig(block_size=64, topk=3, window_size=32))
    ids = torch.randint(0, TINY["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    adapter = patch.attention_modules(model)[0]
    for p in (adapter.nsa.compress_k, adapter.nsa.compress_pe, adapter.nsa.gate_proj.weight,
              adapter.nsa.q_proj.weight if name != "qwen3-14b" else adapter.nsa.q_proj.norm.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("impl", ["fsa", "nsa"])
def test_patched_model_with_kernels_matches_reference(impl, seed):
    """Selected attention through the Triton kernel (interpreter on CPU) in the patched model,
    against the same weights with the PyTorch reference: fp32 logits, and the gradient of every
    parameter (HF's and NSA's) of a loss on them. fsalab's own kernels must import: a failed
    import is an error, not a skip."""
    from fsalab.ops.selected import resolve

    assert callable(resolve(impl))
    base = tiny_model("qwen3-14b", seed, layers=1)
    ref, ker = copy.deepcopy(base), base
    cfg = NSAConfig(block_size=32, topk=3, window_size=32)
    patch.patch_model(ref, "reference", cfg)
    patch.patch_model(ker, impl, cfg)
    ker.load_state_dict(ref.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(seed))
    out_ref = ref(input_ids=ids, use_cache=False).logits
    out_ker = ker(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out_ker, out_ref, rtol=2e-4, atol=2e-4)
    out_ref.square().mean().backward()
    out_ker.square().mean().backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    grads_ker = {n: p.grad for n, p in ker.named_parameters()}
    for n, g_ref in grads_ref.items():
        assert g_ref is not None and grads_ker[n] is not None, f"{n}: no gradient"
        # fp32 on both sides: fsalab.testing's fp32 floor (2e-5), taken relative to each
        # gradient's largest entry so that small gradients are held as tightly as large ones
        atol = 2e-5 * g_ref.abs().max().item()
        torch.testing.assert_close(grads_ker[n], g_ref, rtol=2e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def test_adapter_rejects_unsupported_calls(seed):
    model = tiny_model("llama3-8b", seed, layers=1)
    patch.patch_model(model, "reference")
    adapter = patch.attention_modules(model)[0]
    x = torch.randn(1, 8, TINY["hidden_size"])
    pe = model.model.rotary_emb(x, torch.arange(8)[None])
    with pytest.raises(ValueError, match="unpadded"):
        adapter(x, position_embeddings=pe, attention_mask=torch.ones(1, 1, 8, 8))
    with pytest.raises(ValueError, match="KV cache"):
        adapter(x, position_embeddings=pe, past_key_values=object())
    with pytest.raises(ValueError, match="impl must be one of"):
        patch.canonical_impl("fast")
    with pytest.raises(ValueError, match="attn_implementation"):
        patch.patch_model(tiny_model("llama3-8b", seed, layers=1), "flash_attn")
    assert patch.canonical_impl("full") == "sdpa_cudnn"


def test_materialize_from_meta_matches_published_rope():
    """to_empty + init leaves no garbage: rotary buffers recomputed, norms one, NSA params finite."""
    model = configs.build_model("llama3-8b", 1, "meta", torch.float32, **TINY)
    patch.patch_model(model, "reference")
    configs.materialize(model, CPU, seed=3)
    fresh = configs.build_model("llama3-8b", 1, "cpu", torch.float32, **TINY)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert torch.all(model.model.norm.weight == 1)
    for p in model.parameters():
        assert torch.isfinite(p).all()
    adapter = patch.attention_modules(model)[0]
    assert adapter.nsa.compress_k.abs().max() <= 1 / math.sqrt(32 * 32)


# ------------------------------------------------------------------ runners


def test_chunked_cross_entropy_matches_full(seed):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=gen)
    labels[[3, 20, 36]] = -100
    loss = model_build.chunked_cross_entropy(hidden, head, labels, chunk=8)
    ref = nn.functional.cross_entropy(head(hidden), labels, ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    (g_loss,) = torch.autograd.grad(loss, hidden)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(g_loss, g_ref)


def _point(op: str, impl: str, **over) -> dict:
    p = {**points.E2E_DEFAULTS, "op": op, "model": "qwen2.5-32b", "impl": impl, "N": 128, "dtype": "float32",
         "model_overrides": TINY, "loss_chunk": 64, "topk": 3, "window_size": 32, "experiment": op, **over}
    p["id"] = points.e2e_point_id(p)
    return p


QUICK = {"timing": {"warmup": 0, "repeats": 1}}


@pytest.mark.parametrize("impl", ["reference", "sdpa_math"])
def test_train_runner_row(impl):
    row = train.run_point(_point("train_step", impl, layers=1), QUICK, CPU, "cpu-test")
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["op"] == "train_step" and row["model"] == "qwen2.5-32b" and row["direction"] == "fwd+bwd"
    assert (row["h"], row["h_kv"], row["g"], row["d"], row["layers"], row["layers_full"]) == (4, 2, 2, 32, 1, 64)
    assert row["median_ms"] > 0 and row["n_samples"] == 1 and math.isfinite(row["loss"])
    assert row["full_depth_ms"] > row["median_ms"] and row["full_depth_kind"].startswith("estimate")
    assert row["attention_ms_per_layer"] > 0 and row["mlp_ms_per_layer"] > 0
    from fsalab.bench.rows import COLUMNS

    assert all(c in row for c in COLUMNS)


def test_training_memory_floor_rules_out_only_what_cannot_fit():
    """The full-depth memory floor: Qwen2.5-32B at 64K cannot train on two 140 GiB GPUs
    (8 B/param of bf16 state over 2 ranks + 64 checkpointed 64K x 5120 inputs = 162 GiB); Llama3-8B's
    floor (46 GiB) is under the 64.6 GiB its FSDP2 step measured on two H200s; slices are not checked."""
    gib, h200 = 2**30, 143771 * 2**20
    full = {"batch": 1, "N": 65536, "checkpointing": True, "layers": None, "model_overrides": {}}
    qwen = train.training_memory_floor({**full, "model": "qwen2.5-32b"}, torch.bfloat16, 2)
    llama = train.training_memory_floor({**full, "model": "llama3-8b"}, torch.bfloat16, 2)
    assert 161 * gib < qwen < 163 * gib and 45 * gib < llama < 47 * gib
    assert train.training_memory_floor({**full, "model": "qwen2.5-32b", "layers": 2}, torch.bfloat16, 1) is None
    with pytest.raises(torch.OutOfMemoryError, match="predicted before building") as info:
        train.check_training_fits({**full, "model": "qwen2.5-32b"}, torch.bfloat16, 2, h200)
    row = rows.fail_row({}, info.value)
    assert row["status"] == "oom" and "GiB per rank" in row["message"]
    train.check_training_fits({**full, "model": "qwen2.5-32b"}, torch.bfloat16, 4, h200)
    train.check_training_fits({**full, "model": "llama3-8b"}, torch.bfloat16, 2, h200)


def test_prefill_runner_row_and_failure_rows():
    shallow = {**TINY, "num_hidden_layers": 2}
    row = prefill.run_point(_point("prefill", "reference", layers=None, model_overrides=shallow), QUICK, CPU, "cpu-test")
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["layers"] == row["layers_full"] == 2 and row["full_depth_kind"] == "measured"
    assert row["attention_ms_per_layer"] > 0 and row["direction"] == "fwd"
    bad = prefill.run_point(_point("prefill", "flash_attn", layers=1), QUICK, CPU, "cpu-test")
    assert bad["status"] in ("unsupported", "error") and bad["message"]


def test_convergence_three_steps():
    p = _point("convergence", "reference", **{**convergence.CONVERGENCE_DEFAULTS, "model_overrides": TINY,
                                               "layers": 2, "N": 128, "batch": 2, "steps": 3, "pairs": 4,
                                               "queries": 8, "num_keys": 6, "num_values": 4, "log_every": 1,
                                               "dtype": "float32", "topk": 3, "window_size": 32})
    row = convergence.run_point(p, {}, CPU, "cpu-test")
    assert row["status"] == "ok", row.get("traceback", row["message"])
    assert row["curve"]["step"] == [0, 1, 2] and len(row["curve"]["loss"]) == 3
    ids, labels, far = convergence.retrieval_batch(p, 256, 0, CPU)
    again, _, _ = convergence.retrieval_batch(p, 256, 0, CPU)
    assert torch.equal(ids, again)
    context, nk, nv = 128 - p["queries"], p["num_keys"], p["num_values"]
    val0, key0, needle0 = 1, 1 + nv, 1 + nv + nk
    assert ((labels != -100).nonzero()[:, 1] >= context).all() and (labels[:, context:] != -100).all()
    for b in range(p["batch"]):
        needles = ((ids[b, :context] >= needle0) & (ids[b, :context] < needle0 + nk * nv)).nonzero().flatten()
        assert len(needles) == p["pairs"]
        for t in range(context, 128):
            key = ids[b, t] - key0
            (at,) = [i for i in needles.tolist() if (ids[b, i] - needle0) // nv == key]
            assert labels[b, t] == val0 + (ids[b, at] - needle0) % nv
            assert far[b, t] == (t - at >= p["window_size"])


def test_convergence_needle_span():
    """needle_span > 1: each needle is a run of identical tokens; queries' labels and ``far``
    refer to it (far = the run's last token lies window_size or more back); span 1 is unchanged."""
    base = {**convergence.CONVERGENCE_DEFAULTS, "model_overrides": TINY, "N": 160, "batch": 3, "pairs": 4,
            "queries": 16, "num_keys": 6, "num_values": 4, "window_size": 32, "seed": 1}
    p = _point("convergence", "reference", **{**base, "needle_span": 8})
    ids, labels, far = convergence.retrieval_batch(p, 256, 5, CPU)
    context, nk, nv = 160 - p["queries"], p["num_keys"], p["num_values"]
    val0, key0, needle0 = 1, 1 + nv, 1 + nv + nk
    for b in range(p["batch"]):
        is_needle = (ids[b, :context] >= needle0) & (ids[b, :context] < needle0 + nk * nv)
        assert int(is_needle.sum()) == p["pairs"] * 8
        for t in range(context, 160):
            key = int(ids[b, t]) - key0
            at = [i for i in is_needle.nonzero().flatten().tolist() if (int(ids[b, i]) - needle0) // nv == key]
            assert len(at) == 8 and at == list(range(at[0], at[0] + 8))  # one contiguous run
            assert labels[b, t] == val0 + (ids[b, at[0]] - needle0) % nv
            assert far[b, t] == (t - at[-1] >= p["window_size"])
    one = _point("convergence", "reference", **{**base, "needle_span": 1})
    legacy = _point("convergence", "reference", **base)
    assert all(torch.equal(x, y) for x, y in zip(convergence.retrieval_batch(one, 256, 5, CPU),
                                                  convergence.retrieval_batch(legacy, 256, 5, CPU)))
    assert "-span8-" in points.e2e_point_id(p) and "span" not in points.e2e_point_id(one)
    with pytest.raises(ValueError, match="do not fit"):
        convergence.retrieval_batch({**p, "pairs": 20, "num_keys": 20}, 256, 0, CPU)
