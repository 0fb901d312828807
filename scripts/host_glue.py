"""Host (Python) time of an NSA layer's call with every Triton launch stubbed out, on CPU.

What is left is the call's Python and its torch ops (projections included): the glue that an
eager GPU call pays on top of its kernel launches. Two paths of a tiny NativeSparseAttention
(hidden 256, 8 heads, 2 KV heads, d = 32), value checks off as in the benchmarks:

- ``decode``: one decode step (``NativeSparseAttention.decode``, fp32) on a cache filled by a
  300-token prefill;
- ``forward``: the layer's packed forward over one 64-token sequence (fp32, no_grad) with every
  branch on its Triton op (compression, window and gate "triton", selection ``--impl``);
- ``op``: the kernel benchmark's whole ``nsa_attention`` op (what the versus experiment times,
  no projections or RoPE), one 128-token sequence, 1 KV head, g = 1, d = 16, (32, 4), fp16:
  its forward under no_grad and, with ``--backward``, its backward.

Shapes are tiny so that the torch ops' own arithmetic on the CPU stays small against their
dispatch.

Every Triton function of ``fsalab.ops`` is replaced by a launcher that does nothing (grid
lambdas are still evaluated), so nothing of the kernels runs and nothing reads their outputs.
With ``--triton-launch`` (op path only) Triton's own launch path runs instead, as on the GPU up to
the compiled kernel's C launcher: the kernels are Triton's JIT functions and autotuners (not the
interpreter's), the active driver stands in for an sm_90 GPU, and compiling a kernel yields a
launcher that only counts its launches; the autotuners take their first config
(``settings.configure(autotune=False)``), which on the GPU costs the same per call as a cached tuning. The
difference of the two modes is what Triton's Python adds per launch (binding and specialising
the arguments, the cache key, the autotuner's argument dicts, launch metadata).
Prints the median and minimum microseconds per call over rounds of 100 calls (a shared 2-core
machine is noisy) and the top of a cProfile.

    PYTHONPATH=src python scripts/host_glue.py decode [--rounds 20]
    PYTHONPATH=src python scripts/host_glue.py forward [--impl fsa] [--rounds 20] [--sort tottime] [--rows 40]
    PYTHONPATH=src python scripts/host_glue.py op [--impl fsa] [--backward] [--triton-launch]
"""
import argparse
import cProfile
import importlib
import os
import pkgutil
import pstats
import statistics
import sys
import time

# Decided before Triton is imported: its decorators build interpreter functions when this is set.
TRITON_LAUNCH = "--triton-launch" in sys.argv
if TRITON_LAUNCH:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

import fsalab.ops  # noqa: E402
from fsalab import settings  # noqa: E402
from fsalab.config import NSAConfig  # noqa: E402
from fsalab.modules.nsa import NativeSparseAttention  # noqa: E402

# Any launch's meta-parameters, for grid lambdas (their values do not matter: nothing runs).
GRID_META = {name: 64 for name in ("BLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_R", "BLOCK_T", "BLOCK_X", "BLOCK_Y")}


class NoLaunch:
    def __getitem__(self, grid):
        if callable(grid):
            grid(GRID_META)
        return lambda *args, **kwargs: None


def stub_launches() -> int:
    """Replace every Triton function of fsalab.ops's modules by NoLaunch; returns how many."""
    count = 0
    for info in pkgutil.walk_packages(fsalab.ops.__path__, "fsalab.ops."):
        module = importlib.import_module(info.name)
        for name, obj in list(vars(module).items()):
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner"):
                setattr(module, name, NoLaunch())
                count += 1
    return count


def mock_gpu_launches() -> list[int]:
    """Triton's launch path as on an sm_90 GPU, up to the compiled kernel's launcher, which
    counts instead of launching; returns the one-element launch counter."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    launches = [0]

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class CountingKernel:
        function = packed_metadata = None

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            launches[0] += 1

    def compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = CountingKernel()
        return kernel

    driver.set_active(StandInDriver())
    jit.JITFunction._do_compile = compile_nothing
    for info in pkgutil.walk_packages(fsalab.ops.__path__, "fsalab.ops."):
        importlib.import_module(info.name)  # every kernel decorated as Triton's, before the next line
    # The device checks let CPU tensors through where the interpreter would run them.
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.import_module("fsalab.ops.flash").INTERPRET = True
    return launches


def decode_call():
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=4, window_size=64)
    m = NativeSparseAttention(256, 8, 2, 32, cfg, dtype=torch.float32, decode_impl="triton", selection_impl="reference",
                              compression_impl="reference", window_impl="reference", gate_impl="reference")
    cache = m.new_cache(1, 400)
    m._forward_packed(torch.randn(300, 256), torch.tensor([0, 300], dtype=torch.int32), cache)  # before the stubs
    h = torch.randn(1, 256)
    return lambda: m.decode(h, cache)


def forward_call(impl: str):
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4, window_size=32)
    m = NativeSparseAttention(256, 8, 2, 32, cfg, dtype=torch.float32, selection_impl=impl,
                              compression_impl="triton", window_impl="triton", gate_impl="triton")
    x = torch.randn(64, 256)
    cu = torch.tensor([0, 64], dtype=torch.int32)

    def call():
        with torch.no_grad():
            m(x, cu)

    return call


def op_call(impl: str, backward: bool):
    from fsalab.bench.kernel import nsa_attention_calls

    fwd, bwd = nsa_attention_calls(impl, 128, 1, 1, 16, 32, 4)
    bwd()  # one real call before the stubs, as the other paths make: caches and plans built
    return bwd if backward else fwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", choices=("decode", "forward", "op"))
    parser.add_argument("--impl", default="fsa", help="selection impl of the forward and op paths")
    parser.add_argument("--backward", action="store_true", help="op path: time the backward")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of 100 calls (25 calls a round profiled)")
    parser.add_argument("--sort", default="cumulative", help="cProfile sort key (cumulative, tottime, ...)")
    parser.add_argument("--rows", type=int, default=12, help="profile rows printed")
    parser.add_argument("--triton-launch", action="store_true",
                        help="op path: Triton's launch path runs (stand-in sm_90 driver) instead of stubs")
    args = parser.parse_args()
    if args.triton_launch and args.path != "op":
        parser.error("--triton-launch times the op path only")
    torch.manual_seed(0)
    if args.triton_launch:
        settings.configure(autotune=False)  # the stand-in driver runs nothing to time
    launches = mock_gpu_launches() if args.triton_launch else None
    with settings.override(value_checks=False):  # a stand-in launch writes nothing: no check may read its outputs
        call = {"decode": decode_call, "forward": lambda: forward_call(args.impl),
                "op": lambda: op_call(args.impl, args.backward)}[args.path]()
    if launches is None:
        what = f"{stub_launches()} Triton functions stubbed"
    else:
        with settings.override(value_checks=False):
            launches[0] = 0
            call()
        what = f"Triton's launch path, {launches[0]} launches a call"
    with settings.override(value_checks=False):
        for _ in range(20):
            call()
        rounds = []
        for _ in range(max(1, args.rounds)):
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            rounds.append((time.perf_counter() - t0) * 1e4)
        print(f"{args.path} host time with {what}: {statistics.median(rounds):.0f} us/call "
              f"median, {min(rounds):.0f} min over {len(rounds)} rounds of 100 (python {sys.version.split()[0]}, "
              f"torch {torch.__version__})")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(25 * max(1, args.rounds)):
            call()
        prof.disable()
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.rows)


if __name__ == "__main__":
    main()
