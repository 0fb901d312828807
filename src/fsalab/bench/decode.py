"""Decode benchmarks (DESIGN §9): the ``decode`` runner of three experiments, one op each.

- ``decode_step`` (FSA Table 10): one decode step of one attention layer at context N, mean step
  latency over ``steps`` generated tokens, replayed from a CUDA graph. fsalab's NSA step
  (impl ``triton``: RoPE of q and k, cache append, compression, the decode kernels;
  ``reference``: the fp32 PyTorch step, tiny sizes only) runs the real loop, its cache growing
  from N to N + steps.
  Full-attention decode baselines over a cache of N tokens: torch SDPA (``sdpa_flash``,
  ``sdpa_cudnn``, ``sdpa_math``; GQA through ``enable_gqa``; fixed context N, nothing
  appended), flash-attn's ``flash_attn_with_kvcache`` (``flash_attn``: appends in place, the
  real loop) and FlashInfer's batch decode over one page per sequence (``flashinfer``, fixed N).
  A library that is not importable gives a row with status ``unsupported``.
- ``inference`` (FSA Tables 8-9): one attention layer, prefill of N tokens then ``steps``
  generated tokens; NSA = the module's ``attend`` (compression, selection ``impl``, window,
  gates; filling the cache) then ``attend_decode`` steps (graph-replayed); full attention =
  SDPA causal prefill then SDPA decode steps over the N prefilled tokens, graph-replayed at that
  fixed shape (the steps' growth left out, in full attention's favour). ``median_ms`` is
  prefill + steps x the step's mean; the q/k/v/o projections are not included.
- ``generate``: tokens/s of a patched model (``model``, ``layers``; NSA impls, each layer's
  decode step replayed from a CUDA graph on CUDA: ``NSAModelCache``'s default) or of the
  model's own attention (full impls, HF's DynamicCache, eager) through ``model.generate``, greedy,
  prompts of N tokens, ``steps`` new tokens; wall clock of the whole call, and of a one-token
  call (``prefill_ms``) timed alternately with it, whose difference gives ``mean_step_ms``. A
  slice of L < the model's layers also runs at L/2 layers (``half_*``), and ``full_depth_*``
  extends the two linearly to the model's depth, labelled an estimate in ``full_depth_kind``
  (the training runner's convention; ``full_depth_floor_gib``: weights + K/V cache, a lower
  bound of its memory); a whole model is ``measured``.

Every row carries the DESIGN §2 columns (``N`` = context, ``direction`` = fwd) plus
``mean_step_ms`` / ``tokens_per_s`` / ``step_extra_mem_bytes`` where they apply.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.nn.functional as F

from .. import settings
from .decode_points import NSA_IMPLS
from .inputs import device_randn
from .points import DTYPES, nsa_config
from .provenance import detect_platform
from .rows import Unsupported, fail_row, finish_row, kernel_row
from .timing import capture_graph, measure



# ---------------------------------------------------------------- timing helpers


def _replayed_steps(step, device: torch.device, steps: int, timing: dict) -> tuple[list[float], str]:
    """Per-step samples (ms) of ``steps`` consecutive calls of ``step``: replays of one CUDA graph
    timed by events on CUDA (``graph`` in the method), eager wall clock elsewhere."""
    if device.type == "cuda" and timing.get("graphs", True):
        g = capture_graph(step, device, warmup=2)
        if g.status == "ok":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            events[0].record()
            for e in events[1:]:
                g.replay()
                e.record()
            torch.cuda.synchronize(device)
            return [a.elapsed_time(b) for a, b in zip(events, events[1:])], "cuda_graph_replay"
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples, "wallclock"


def _summary(samples: list[float]) -> dict:
    xs = sorted(samples)
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "mean_ms": sum(xs) / len(xs),
            "min_ms": xs[0], "n_samples": len(xs)}


def _extra_memory(step, device: torch.device) -> int | None:
    """Bytes a step allocates beyond what exists before it (peak minus start), CUDA only."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


@functools.cache
def _sdpa_backend(impl: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_math": SDPBackend.MATH}[impl]


def _sdpa(impl: str, q, k, v, causal: bool):
    """torch SDPA on one backend; q [B, h, S, d], k/v [B, h_kv, N, d] (GQA through enable_gqa)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(impl)]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


# ---------------------------------------------------------------- decode_step


def _random_cache(p: dict, device: torch.device, dtype: torch.dtype, capacity: int, gen: torch.Generator):
    """A cache of batch sequences with N cached tokens each, random contents (the step's cost
    does not depend on them; its selection comes from real scores over them)."""
    from ..ops.decode import NSADecodeCache

    cfg = nsa_config(p)
    cache = NSADecodeCache.allocate(p["batch"], capacity, p["h_kv"], p["d"], cfg, dtype, device,
                                    num_heads=p["h_kv"] * p["g"])
    for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.k_recent):
        t.normal_(generator=gen)
    cache.lengths.fill_(p["N"])
    cache.filled = True
    return cache


def _nsa_step(p: dict, device: torch.device, dtype: torch.dtype, slack: int):
    """(step, cache): one decode step of NSA attention (RoPE of q and k, append, compression,
    attention, gates) on random inputs; the projections are left out."""
    from ..modules.rope import rope_inv_freq
    from ..ops import decode as dec

    gen, rnd = device_randn(p["seed"], device, dtype)
    cfg = nsa_config(p)
    b, h_kv, d, h = p["batch"], p["h_kv"], p["d"], p["h_kv"] * p["g"]
    cache = _random_cache(p, device, dtype, p["N"] + p["steps"] + slack, gen)
    q, k, v, gates = rnd(b, h, d), rnd(b, h_kv, d), rnd(b, h_kv, d), rnd(b, h, 3)
    w_k, w_v = (rnd(h_kv, cfg.kernel_size * d, d, std=(cfg.kernel_size * d) ** -0.5) for _ in range(2))
    pe = rnd(h_kv, cfg.kernel_size, d, std=0.02)
    inv_freq = rope_inv_freq(d, 10000.0).to(device)
    ops = dec.decode_ops(p["impl"], device)
    rotated = {}  # the last step's rotated q, for the check

    def step():
        rotated["q"] = ops.append_token(cache, q, k, v, w_k, w_v, pe, inv_freq)
        return ops.nsa_decode(rotated["q"], cache, gates)[0]

    step.inputs, step.ops = (rotated, gates), ops  # for the check
    return step, cache


def _full_step(p: dict, device: torch.device, dtype: torch.dtype, slack: int):
    """step of a full-attention decode baseline over N cached tokens."""
    _, rnd = device_randn(p["seed"], device, dtype)
    b, h_kv, d, n, h = p["batch"], p["h_kv"], p["d"], p["N"], p["h_kv"] * p["g"]
    impl = p["impl"]
    if impl.startswith("sdpa"):
        if device.type != "cuda" and impl != "sdpa_math":
            raise Unsupported(f"{impl} needs CUDA")
        q, k, v = rnd(b, h, 1, d), rnd(b, h_kv, n, d), rnd(b, h_kv, n, d)
        return lambda: _sdpa(impl, q, k, v, causal=False), "fixed context N, nothing appended"
    if impl == "flash_attn":
        if device.type != "cuda":
            raise Unsupported("flash_attn needs CUDA")
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError as exc:
            raise Unsupported(f"flash-attn is not importable: {exc}") from None
        cap = n + p["steps"] + slack
        k_cache, v_cache = rnd(b, cap, h_kv, d), rnd(b, cap, h_kv, d)
        lens = torch.full((b,), n, dtype=torch.int32, device=device)
        q, k, v = rnd(b, 1, h, d), rnd(b, 1, h_kv, d), rnd(b, 1, h_kv, d)
        def step():
            o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
            lens.add_(1)
            return o

        return step, "appends in place, context N -> N + steps"
    if impl == "flashinfer":
        try:
            import flashinfer
        except ImportError as exc:
            raise Unsupported(f"flashinfer is not importable: {exc}") from None
        if device.type != "cuda":
            raise Unsupported("flashinfer needs CUDA")
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        # One page of N tokens per sequence.
        kv = rnd(b, 2, n, h_kv, d)
        indptr = torch.arange(b + 1, dtype=torch.int32, device=device)
        indices = torch.arange(b, dtype=torch.int32, device=device)
        last = torch.full((b,), n, dtype=torch.int32, device=device)
        wrapper.plan(indptr, indices, last, h, h_kv, d, n, data_type=dtype, q_data_type=dtype)
        q = rnd(b, h, d)
        return (lambda: wrapper.run(q, kv)), "fixed context N, one page per sequence"
    raise ValueError(f"unknown decode_step impl {impl!r}")


def _check_step(p: dict, step, cache) -> dict:
    """One more step, checked: NSA against the fp32 reference step on the same cache state
    (``testing.assert_close``'s dtype floor; block_idx agreement reported), full attention for
    finite outputs."""
    from ..ops.decode import reference as decode_reference
    from ..testing import assert_close

    out = step()
    out = out[0] if isinstance(out, tuple) else out
    if not torch.isfinite(out).all():
        return {"status": "fail", "what": "finite output"}
    if cache is None:
        return {"status": "pass", "what": "finite output"}
    rotated, gates = step.inputs
    q = rotated["q"]
    _, idx = step.ops.nsa_decode(q, cache, gates)
    try:
        expected, expected_idx = decode_reference.nsa_decode(q, cache, gates)
    except torch.OutOfMemoryError:  # the dense reference needs ~4x the cache in fp32
        torch.cuda.empty_cache()
        return {"status": "skipped", "what": "finite output; the fp32 reference step did not fit in memory"}
    agree = float((idx == expected_idx).all(-1).float().mean())
    try:
        assert_close(out.float(), expected.float(), dtype=out.dtype)
    except AssertionError as exc:
        return {"status": "fail", "what": "step output vs fp32 reference step", "message": str(exc)[:500],
                "block_idx_agreement": agree}
    return {"status": "pass", "what": "step output vs fp32 reference step (dtype floor)", "block_idx_agreement": agree}


def _run_decode_step(p, exp, device, dtype, row):
    slack = 8
    timing = exp.get("timing", {})
    if p["impl"] in NSA_IMPLS["decode_step"]:
        step, cache = _nsa_step(p, device, dtype, slack)
        row["cache_bytes"] = cache.nbytes
        row["scope"] = "NSA decode step: RoPE of q and k, cache append, compression, attention, gates; context N -> N + steps"
    else:
        step, scope = _full_step(p, device, dtype, slack)
        row["scope"] = f"full-attention decode: {scope}"
    samples, method = _replayed_steps(step, device, p["steps"], timing)
    row.update(_summary(samples))
    row["check"] = _check_step(p, step, cache if p["impl"] in NSA_IMPLS["decode_step"] else None)
    row["mean_step_ms"] = row["mean_ms"]
    row["samples_ms"] = samples
    row["timing"] = {"method": method, "steps": p["steps"]}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)  # the probe below resets the point's peak counter
        row["step_extra_mem_bytes"] = _extra_memory(step, device)
        row["peak_mem_gib"] = max(peak, torch.cuda.max_memory_allocated(device)) / 2**30
    else:
        row["step_extra_mem_bytes"] = None


# ---------------------------------------------------------------- inference


def _run_inference(p, exp, device, dtype, row):
    from ..modules import NativeSparseAttention
    from ..testing import cu_seqlens_of

    b, n, h_kv, d, h = p["batch"], p["N"], p["h_kv"], p["d"], p["h_kv"] * p["g"]
    timing = {"warmup": 1, "repeats": 3, **{k: v for k, v in exp.get("timing", {}).items() if k in ("warmup", "repeats")}}
    _, rnd = device_randn(p["seed"], device, dtype)
    if p["impl"] in NSA_IMPLS["inference"]:
        torch.manual_seed(p["seed"])
        module = NativeSparseAttention(h * d, h, h_kv, d, nsa_config(p), selection_impl=p["impl"],
                                       device=device, dtype=dtype)
        x, q, k, v = rnd(b * n, h * d), rnd(b * n, h, d), rnd(b * n, h_kv, d), rnd(b * n, h_kv, d)
        cu = cu_seqlens_of([n] * b, device)
        cache = module.new_cache(b, n + p["steps"] + 8)
        xd, qd, kd, vd = rnd(b, h * d), rnd(b, h, d), rnd(b, h_kv, d), rnd(b, h_kv, d)

        def prefill():
            with torch.no_grad():
                return module.attend(q, k, v, x, cu, cache=cache)

        def step():
            with torch.no_grad():
                return module.attend_decode(qd, kd, vd, xd, cache)

        scope = "NSA: attend (prefill, fills the cache) + attend_decode steps; projections excluded"
    else:
        q, k, v = rnd(b, h, n, d), rnd(b, h_kv, n, d), rnd(b, h_kv, n, d)
        qd = rnd(b, h, 1, d)

        def prefill():
            return _sdpa(p["impl"], q, k, v, causal=True)

        def step():
            return _sdpa(p["impl"], qd, k, v, causal=False)

        # A step over the growing context would change SDPA's shapes every token, and cuDNN plans
        # each new shape (a hundred times a replayed step at 128K): the full-attention
        # step attends the N prefilled tokens, replayed from a CUDA graph like NSA's, which leaves
        # out the 512 tokens' growth (0.4 % of the context at 128K) in full attention's favour.
        scope = ("full attention: SDPA causal prefill + SDPA decode steps over the N prefilled tokens "
                 "(fixed shape, growth left out); projections excluded")
    t = measure(prefill, device, "cuda_events" if device.type == "cuda" else "wallclock", **timing)
    finite = bool(torch.isfinite(prefill()).all())  # a fresh prefill: the decode steps start from context N
    samples, method = _replayed_steps(step, device, p["steps"], exp.get("timing", {}))
    finite = finite and bool(torch.isfinite(step()).all())
    row["check"] = {"status": "pass" if finite else "fail", "what": "finite prefill and step outputs"}
    prefill_ms = t.summary()["median_ms"]
    step_mean = sum(samples) / len(samples)
    row.update(median_ms=prefill_ms + p["steps"] * step_mean, p20_ms=None, p80_ms=None, n_samples=len(samples))
    row.update(prefill_ms=prefill_ms, prefill_samples_ms=t.samples_ms, mean_step_ms=step_mean, samples_ms=samples,
               scope=scope, timing={"prefill": t.method, "steps": method, "n_steps": p["steps"]})


# ---------------------------------------------------------------- generate


@contextlib.contextmanager
def _first_layers(lm, n: int):
    """Inside: ``lm`` runs its first ``n`` decoder layers only (the same modules and weights; the
    config's layer count, and its per-layer types where it has them, cut to match)."""
    from ..models.patch import decoder_layers

    base, config = getattr(lm, "model", lm), lm.config
    layers, count, types = decoder_layers(lm), config.num_hidden_layers, getattr(config, "layer_types", None)
    base.layers, config.num_hidden_layers = torch.nn.ModuleList(list(layers)[:n]), n
    if types is not None:
        config.layer_types = types[:n]
    try:
        yield
    finally:
        base.layers, config.num_hidden_layers = layers, count
        if types is not None:
            config.layer_types = types


def _depth_estimate(half: float, whole: float, l_half: int, l: int, l_full: int) -> float:
    """A time at ``l_full`` layers from the same request at ``l_half`` and ``l`` layers: the
    per-layer slope of the two slices, extended (embedding, LM head and the generate loop are the
    intercept)."""
    return whole + (l_full - l) * (whole - half) / (l - l_half)


def _run_generate(p, exp, device, dtype, row):
    from ..models import configs, patch
    from ..models.cache import generate

    if not p["model"]:
        raise ValueError("generate points need a model (llama3-8b, qwen3-14b, qwen2.5-32b)")
    impl = patch.canonical_impl(p["impl"])
    lm = configs.build_model(p["model"], p["layers"] or None, "meta", dtype, patch.attn_implementation_for(impl),
                             **p["model_overrides"])
    patch.patch_model(lm, impl, nsa_config(p) if patch.is_sparse(impl) else None)
    lm.to_empty(device=device)
    configs.init_random_(lm, seed=p["seed"])
    lm.eval()
    gen = torch.Generator(device=device).manual_seed(p["seed"])
    ids = torch.randint(0, lm.config.vocab_size, (p["batch"], p["N"]), generator=gen, device=device)
    graphs = patch.is_sparse(impl) and device.type == "cuda"  # NSA decode steps replayed from CUDA graphs
    layers, l_full = lm.config.num_hidden_layers, configs.get_spec(p["model"]).num_layers
    # A slice shorter than the model is also run at half its depth (same weights, same process):
    # the two give the per-layer cost, extended to the full depth as an estimate.
    depths = (layers // 2, layers) if 2 <= layers < l_full else (layers,)

    def run(steps, depth):
        with torch.inference_mode(), patch.attention_context(impl), _first_layers(lm, depth):
            if patch.is_sparse(impl):
                return generate(lm, ids, steps, cuda_graphs=graphs)
            return lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                               pad_token_id=0)

    # Warm up with the whole request: Triton compiles and tunes per shape, cuDNN plans every new
    # context length, and a 2-token warm-up left those costs inside the timed run (a 4-layer
    # Qwen3-14B generate measured 2.5x slower than the Qwen2.5-32B run with the same attention
    # shapes after it).
    for depth in depths:
        run(p["steps"], depth)

    def wall_ms(steps: int, depth: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = run(steps, depth)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if out.shape[1] != p["N"] + steps:
            raise RuntimeError(f"generate returned {out.shape[1] - p['N']} new tokens, asked for {steps}")
        return (time.perf_counter() - t0) * 1e3

    # The request and a one-token request (prompt + first token) alternate, at each depth, so
    # drift touches all; their difference is the decode steps' cost apart from the prefill. The
    # timing is host-bound (generate syncs once a token), so one run per point cannot rank the
    # attentions.
    samples = {d: ([], []) for d in depths}  # depth -> (request samples, one-token samples)
    for _ in range(max(1, exp.get("timing", {}).get("repeats", 1))):
        for depth in depths:
            samples[depth][0].append(wall_ms(p["steps"], depth))
            samples[depth][1].append(wall_ms(1, depth))
    request, prefill = samples[layers]
    row["check"] = {"status": "pass", "what": f"{p['steps']} tokens generated"}
    row.update(_summary(request))
    row["samples_ms"] = request
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    row["tokens_per_s"] = p["batch"] * p["steps"] / (row["median_ms"] * 1e-3)
    row["prefill_ms"] = _summary(prefill)["median_ms"]
    row["prefill_samples_ms"] = prefill
    if p["steps"] > 1:
        row["mean_step_ms"] = (row["median_ms"] - row["prefill_ms"]) / (p["steps"] - 1)
    row.update(_full_depth(row, p, samples, depths, l_full))
    row["scope"] = (f"model.generate (greedy, prompt N, {p['steps']} new tokens, prefill included), {row['layers']} "
                    f"layers; prefill_ms: a 1-token generate; mean_step_ms: (median − prefill_ms) / (steps − 1)"
                    + ("; NSA layers' decode steps replayed from CUDA graphs" if graphs else ""))
    row["timing"] = {"method": "wallclock", "repeats": len(request), "decode_graphs": graphs}


def _model_bytes(p: dict) -> tuple[int, int]:
    """(bytes outside the decoder layers, bytes of one decoder layer) of the published model in the
    point's dtype: the embedding and LM head; one layer's weights and its raw K/V cache for batch x
    (N + steps) tokens. Activations and NSA's compressed cache are left out."""
    from ..models.configs import get_spec

    spec = get_spec(p["model"])
    size = torch.empty((), dtype=DTYPES[p["dtype"]]).element_size()
    config = spec.config
    outside = config["vocab_size"] * config["hidden_size"] * (1 if config.get("tie_word_embeddings") else 2)
    kv = p["batch"] * (p["N"] + p["steps"]) * spec.num_kv_heads * spec.head_dim * 2
    return outside * size, ((spec.num_params - outside) // spec.num_layers + kv) * size


def _inference_memory_floor(p: dict) -> int:
    """A lower bound (bytes) on a full-depth generate of the published model: its weights and
    the raw K/V cache of every layer for batch x (N + steps) tokens, in the point's dtype. It
    leaves out activations (a prefill MLP's intermediate alone is 27 GiB at Qwen2.5-32B, 8 x 64K)
    and NSA's compressed cache, so a point above the GPU's memory cannot run whole there."""
    from ..models.configs import get_spec

    outside, layer = _model_bytes(p)
    return outside + get_spec(p["model"]).num_layers * layer


def _full_depth(row: dict, p: dict, samples: dict, depths: tuple[int, ...], l_full: int) -> dict:
    """The full-depth columns: measured where the slice is the whole model, else estimated from
    the half- and whole-slice medians (``_depth_estimate``), labelled in ``full_depth_kind``,
    with the range of the per-pair estimates (``full_depth_ms_low`` / ``_high``, and as tokens/s).
    ``samples``: depth -> (request samples, one-token samples), ms; the rows keep them, so
    scripts/generate_depth_pairs.py recomputes these columns from a row."""
    out = {"full_depth_layers": l_full}

    def tokens_per_s(ms: float) -> float:
        return p["batch"] * p["steps"] / (ms * 1e-3)

    if depths[-1] == l_full:
        whole_ms, prefill_ms, kind = row["median_ms"], row["prefill_ms"], "measured"
    elif len(depths) == 1:
        return {**out, "full_depth_kind": "none: a 1-layer slice gives no per-layer slope"}
    else:
        l_half, l = depths
        half, half_prefill = (_summary(x)["median_ms"] for x in samples[l_half])
        out.update(half_layers=l_half, half_median_ms=half, half_samples_ms=samples[l_half][0],
                   half_prefill_ms=half_prefill, half_prefill_samples_ms=samples[l_half][1])
        if not (row["median_ms"] > half and row["prefill_ms"] > half_prefill):
            return {**out, "full_depth_kind": f"none: the {l}-layer slice was not slower than the {l_half}-layer one"}
        whole_ms = _depth_estimate(half, row["median_ms"], l_half, l, l_full)
        prefill_ms = _depth_estimate(half_prefill, row["prefill_ms"], l_half, l, l_full)
        # The slope is a difference of two host-bound wall times, extended up to 30x: each pair of
        # samples timed back to back gives an estimate of its own, and their range shows how far
        # the medians' estimate can be trusted (host-bound steps at batch 1 make the pairs disagree
        # widely: docs/performance.md, "Decode").
        paired = [_depth_estimate(a, b, l_half, l, l_full) for a, b in zip(samples[l_half][0], samples[l][0])]
        out.update(full_depth_ms_low=min(paired), full_depth_ms_high=max(paired),
                   full_depth_tokens_per_s_low=tokens_per_s(max(paired)),
                   full_depth_tokens_per_s_high=tokens_per_s(min(paired)))
        if row.get("peak_mem_gib") is not None:
            # The slice's peak already holds a layer's transient activations; the layers it left out
            # add their weights and K/V cache: whether the whole model would fit this GPU.
            out["full_depth_peak_gib"] = row["peak_mem_gib"] + (l_full - l) * _model_bytes(p)[1] / 2**30
        kind = (f"estimate: linear in depth from the {l_half}- and {l}-layer slices of this point "
                f"(same weights, timed alternately), request and one-token request apart; "
                f"full_depth_*_low/high: the range of the estimates from each pair of samples")
    out.update(full_depth_ms=whole_ms, full_depth_prefill_ms=prefill_ms, full_depth_kind=kind,
               full_depth_tokens_per_s=tokens_per_s(whole_ms), full_depth_floor_gib=_inference_memory_floor(p) / 2**30)
    if p["steps"] > 1:
        out["full_depth_step_ms"] = (whole_ms - prefill_ms) / (p["steps"] - 1)
    return out


_RUNNERS = {"decode_step": _run_decode_step, "inference": _run_inference, "generate": _run_generate}


def run_point(p: dict, exp: dict, device: torch.device, platform: str | None = None) -> dict:
    """Measure one decode-runner point; always returns a row (failures become status rows)."""
    platform = platform or detect_platform()
    row = kernel_row(p, platform)
    row.update(steps=p["steps"], layers=p["layers"] if p["op"] == "generate" else None)
    started = time.time()
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the row's peak is this point's, not the process's
        with settings.override(value_checks=False):
            _RUNNERS[p["op"]](p, exp, device, DTYPES[p["dtype"]], row)
        if device.type == "cuda" and row.get("peak_mem_gib") is None:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure of a point becomes a row (Unsupported: unsupported)
        fail_row(row, exc)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return finish_row(row, started)
