"""Useful FLOPs of the benchmarked ops: the one convention every runner, table and notebook uses.

Torch-free (the notebooks import it without loading torch). Counts are 2 per multiply-add over
causally attended keys only; a backward costs 2.5x its forward (``DIRECTION_FLOP_FACTOR``,
FlashAttention's convention: 5 matmuls against 2), applied to the whole op.
"""

from __future__ import annotations

# Ceilings measured on the H200: dense bf16 MMA (TFLOP/s) and a device-to-device copy (TB/s).
H200_CEILINGS = {"tflops": 790.0, "tbps": 4.3}
# Backward costs 2.5x the forward (FlashAttention's convention: 5 matmuls against 2).
DIRECTION_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def useful_flops(op: str, keys: dict[str, float], d: int, cfg, h_kv: int, rows_cmp: float) -> float:
    """Forward FLOPs of the work the op must do (2 per multiply-add; causal keys only).

    ``keys``: attended keys summed over tokens and query heads, per branch
    (``bench.inputs.attended_keys``; only ``compressed`` is needed for op ``compressed``).
    Attention: 4·d per (query head, attended key) — QKᵀ and PV. Compression adds the two linear
    maps, 2·(l·d)·d·2 per compressed token and KV head (``rows_cmp`` compressed tokens), and
    block scoring recomputes QKᵀ over the visible compressed keys (2·d per head and key).
    """
    attn = {name: 4 * d * n for name, n in keys.items()}
    compression = sum(compression_parts(keys["compressed"], d, cfg, h_kv, rows_cmp).values())
    if op == "compressed":
        return compression
    if op in ("selected", "window", "full_attention"):
        return attn[op]
    return compression + attn["selected"] + attn["window"]


def compression_parts(cmp_keys: float, d: int, cfg, h_kv: int, rows_cmp: float) -> dict[str, float]:
    """Forward FLOPs of the compression branch by part: ``maps`` (compress_kv's two linear maps,
    2·(l·d)·d·2 per compressed token and KV head), ``attention`` (4·d per query head and visible
    compressed key) and ``scoring`` (QKᵀ again for the block scores, 2·d per head and key; it has
    no backward). ``cmp_keys``: visible compressed keys summed over tokens and query heads."""
    return {"maps": 4.0 * cfg.kernel_size * d * d * h_kv * rows_cmp, "attention": 4.0 * d * cmp_keys,
            "scoring": 2.0 * d * cmp_keys}


def compression_branch_parts(n: int, h: int, h_kv: int, d: int, cfg, batch: int = 1) -> dict[str, float]:
    """``compression_parts`` of ``batch`` sequences of n tokens each (op ``compressed``'s forward
    FLOPs are their sum)."""
    return compression_parts(float(cfg.visible_compressed_keys(n) * h * batch), d, cfg, h_kv,
                             batch * cfg.num_compressed(n))


def causal_attention_flops(n: int, h: int, d: int, batch: int = 1) -> float:
    """Forward FLOPs of causal full attention over ``batch`` sequences of n tokens: 4·d per
    query head and attended key, n (n + 1) / 2 keys per head."""
    return 4.0 * d * h * batch * n * (n + 1) / 2


def compulsory_bytes(op: str, direction: str, n: int, h: int, h_kv: int, d: int, kernel_size: int, topk: int,
                     elem_bytes: int = 2) -> float:
    """DRAM bytes an op cannot avoid: each input read once and each output written once.

    Attention kernels (selected, window, full_attention, compressed) read q [n, h, d] and k, v
    [n, h_kv, d] and write o [n, h, d] and lse [n, h] fp32 forward; backward they read q, k, v,
    o, do, lse and write dq, dk, dv (FlashAttention's convention). ``selected`` also reads its
    block indices int32 [n, h_kv, topk]; ``compressed`` (compression, compressed attention and
    block selection) reads the two maps and the position embedding (l·d·d, l·d·d and l·d
    elements), writes the block indices forward and the maps' gradients backward.
    ``nsa_attention`` reads q, k, v, the maps and the gates [n, h, 3] and writes o forward; its
    backward reads q, k, v, do, the maps and gates and writes their gradients. Everything passed
    between kernels (partial outputs, compressed keys, the branches' outputs) is not compulsory.
    """
    q = o = n * h * d * elem_bytes
    kv = 2 * n * h_kv * d * elem_bytes
    lse = n * h * 4
    idx = n * h_kv * topk * 4
    maps = (2 * kernel_size * d * d + kernel_size * d) * elem_bytes
    gates = n * h * 3 * elem_bytes
    if op == "nsa_attention":
        fwd = q + kv + maps + gates + o
        bwd = 2 * (q + kv + maps + gates) + o
    else:
        fwd = q + kv + o + lse + {"selected": idx, "compressed": maps + idx}.get(op, 0)
        bwd = 2 * (q + kv) + 2 * o + lse + {"selected": idx, "compressed": 2 * maps}.get(op, 0)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]
