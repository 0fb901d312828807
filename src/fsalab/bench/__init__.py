"""Benchmarks: experiment grids, timing, provenance and the runners, in layers (DESIGN §1).

Shared pieces, which import no runner:

- ``repo``: where the checkout is (results, experiments, git state).
- ``points``: point parameters, their defaults, dtype names, stable point ids, ``nsa_config``.
- ``grid``: load/validate ``experiments/*.yaml``, expand grids into points.
- ``provenance``: platform detection and the provenance block of every result file.
- ``rows``: the DESIGN §2 columns, row builders, failure status, writing a row.
- ``timing``: CUDA-event / do_bench / wall-clock timing and peak memory.
- ``inputs``: random inputs with block indices from the NSA compression path.
- ``ops``: the timed ops (selected, compressed, window, full_attention, nsa_attention) per impl.
- ``flops``: the useful-FLOP convention (torch-free: the notebooks count with it too).
- ``check``: once-per-point correctness check against the op's fp32 reference.
- ``model_build``, ``layer_split``: the end-to-end model (attention swapped, loss, batch) and
  the attention/MLP split; ``e2e_cli``: the end-to-end runners' command line.

Runners, each importing only the pieces above:

- ``kernel``: one kernel point -> ``results/<platform>/<experiment>/<point>.json``.
- ``dram``: kernel points profiled under Nsight Compute (DRAM bytes beside ``fsalab.theory``).
- ``versus``: whole NSA attention against full attention, interleaved per group of points.
- ``train``, ``prefill``, ``convergence``: the end-to-end runners (``fsalab bench-train`` ...).

Submodules import torch; import them explicitly (``from fsalab.bench import kernel``).
"""
