"""Benchmarks: timing, provenance, experiment grids and the kernel-level runner.

- ``grid``: load/validate ``experiments/*.yaml``, expand grids into points with stable ids.
- ``inputs``: random inputs with block indices from the NSA compression path.
- ``ops``: the timed ops (selected, compressed, window, full_attention, nsa_attention) per impl.
- ``check``: once-per-point correctness check against ``fsalab.ops.reference``.
- ``timing``: CUDA-event / do_bench / wall-clock timing and peak memory.
- ``provenance``: platform detection and the provenance block of every result file.
- ``kernel``: ``run_point`` / ``run_points`` writing ``results/<platform>/<experiment>/<point>.json``.
- ``dram``: the same points profiled under Nsight Compute (DRAM bytes beside ``fsalab.theory``).
- ``train``, ``prefill``, ``convergence``: the end-to-end runners (``fsalab bench-train`` ...).

Submodules import torch; import them explicitly (``from fsalab.bench import kernel``).
"""
