"""Implementation names of the ops, one list per op, read by the ops, the module, the model swap,
the benchmarks and the reproduction (selected attention: ``fsalab.ops.selected.IMPLS``).

"auto" picks the kernels on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

# compress_kv, compressed_attention, select_blocks
COMPRESSION_IMPLS = ("reference", "triton", "auto")
# sliding-window attention; every name but "reference" is a backend of fsalab.ops.window
WINDOW_IMPLS = ("reference", "triton", "flash_attn", "auto")
# the gated sum of the three branches ("triton": the fused kernel, fsalab.ops.gate)
GATE_IMPLS = ("reference", "triton", "auto")
# the decode step, append_token and nsa_decode (fsalab.ops.decode)
DECODE_IMPLS = ("reference", "triton", "auto")
# full causal attention baselines (fsalab.ops.full); the fp32 reference is "reference" in result rows
FULL_ATTENTION_IMPLS = ("sdpa_flash", "sdpa_cudnn", "sdpa_math", "flash_attn", "triton")
