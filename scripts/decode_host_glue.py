"""Host (Python) time of one NSA decode step of a layer with its Triton launches stubbed out.

Runs on a CPU machine: a tiny NativeSparseAttention (hidden 256, 8 heads, 2 KV heads, d = 32,
fp32), a cache filled by a 300-token prefill, then ``decode`` timed with every ``*_kernel`` of
``ops/decode.py`` replaced by a no-op launcher, value checks off as in the generate runner.
What is left is the step's Python and its torch ops (projections included), i.e. the glue that
the GPU's eager generate loop pays on top of the launches. Prints microseconds per step and the
top of a cProfile.

    PYTHONPATH=src python scripts/decode_host_glue.py [--steps 2000]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

from fsalab.checks import value_checks_off  # noqa: E402
from fsalab.config import NSAConfig  # noqa: E402
from fsalab.modules.nsa import NativeSparseAttention  # noqa: E402
from fsalab.ops import decode as dec  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=2000, help="timed decode steps, in rounds of 100 (a quarter as many profiled)")
args = parser.parse_args()
torch.manual_seed(0)
cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=4, window_size=64)
m = NativeSparseAttention(256, 8, 2, 32, cfg, dtype=torch.float32, decode_impl="triton", selection_impl="reference",
                          compression_impl="reference", window_impl="reference", gate_impl="reference")
cache = m.new_cache(1, 400)
m._forward_packed(torch.randn(300, 256), torch.tensor([0, 300], dtype=torch.int32), cache)


class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


for name in [n for n in dir(dec) if n.endswith("_kernel")]:
    setattr(dec, name, NoLaunch())
h = torch.randn(1, 256)
with value_checks_off():
    for _ in range(50):
        m.decode(h, cache)
    steps = args.steps
    rounds = []  # us per step of rounds of 100 steps: a shared 2-core machine is noisy, the median less so
    for _ in range(max(1, steps // 100)):
        t0 = time.perf_counter()
        for _ in range(100):
            m.decode(h, cache)
        rounds.append((time.perf_counter() - t0) * 1e4)
    print(f"decode host time with launches stubbed: {statistics.median(rounds):.0f} us/step median, "
          f"{min(rounds):.0f} min over {len(rounds)} rounds of 100 (python {sys.version.split()[0]}, "
          f"torch {torch.__version__})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(max(1, steps // 4)):
        m.decode(h, cache)
    prof.disable()
pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
