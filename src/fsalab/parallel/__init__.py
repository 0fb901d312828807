"""Multi-GPU paths of the end-to-end benchmarks, under torchrun: FSDP2 training (``fsdp``:
process-group setup, ``fully_shard`` per decoder layer + root, cross-rank reductions) and
tensor-parallel prefill (``tp``: head and MLP splits). (Named ``parallel``, not ``dist``: the
repository's .gitignore ignores every ``dist/`` folder.)
"""
