"""What the selection index's sort and the eager call's allocations cost on one GPU: the two
host-path items that remain of the whole attention's launch work (docs/performance.md, "Whole
NSA attention").

- torch.sort (stable, int32 keys with their order, as ``ops.selected.index`` calls it) of the
  entries of one whole-attention call: total x 4 KV heads x 16 slots at 32K and 64K; the keys
  span [0, 4 * total] as the index's do. Beside it, the same order by other torch calls: with
  ``out=`` into buffers of the call's scratch (as the index calls it), ``torch.argsort``, and an
  unstable sort of int64 keys ``key << 32 | entry`` (unique, so any sort is deterministic and
  stable), the candidates for a cheaper host path. Device time by CUDA events (median of 50 after 5 warm-up
  calls), host time per call (median of 50 enqueues with the GPU busy, so no call waits on it).
- torch.empty on the GPU (through the caching allocator, a block it has cached): host time per
  call, median of 20 rounds of 200 calls.

Prints one line per measurement and writes host_costs.json to $OUT (default /tmp).

    PYTHONPATH=src python scripts/gpu/host_costs.py
"""

import json
import os
import statistics
import time

import torch


def device_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, reps: int = 50) -> float:
    """Median host time of one call while the GPU is kept busy by a long kernel queued before."""
    busy = torch.empty(8192, 8192, device="cuda")
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        for _ in range(4):
            busy @ busy  # ~ms of work ahead: the calls below only enqueue
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    rows = []
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for total in (32768, 65536):
        n = total * 4 * 16
        keys = torch.randint(0, 4 * total, (n,), dtype=torch.int32, device="cuda")
        packed = (keys.to(torch.int64) << 32) | torch.arange(n, device="cuda")
        out = (torch.empty_like(keys), torch.empty(n, dtype=torch.int64, device="cuda"))
        variants = {
            "sort": lambda keys=keys: torch.sort(keys, stable=True),
            "sort_out": lambda keys=keys, out=out: torch.sort(keys, stable=True, out=out),
            "argsort": lambda keys=keys: torch.argsort(keys, stable=True),
            "sort_unique_int64": lambda packed=packed: torch.sort(packed),
        }
        for what, fn in variants.items():
            row = {"what": what, "total": total, "entries": n, "device_ms": device_ms(fn), "host_us": host_us(fn)}
            rows.append(row)
            print(row, flush=True)
    torch.empty(1 << 20, device="cuda")  # a cached block for the calls below
    rounds = []
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(200):
            torch.empty(1 << 20, device="cuda")
        rounds.append((time.perf_counter() - t0) / 200 * 1e6)
    row = {"what": "empty", "host_us": statistics.median(rounds)}
    rows.append(row)
    print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host_costs.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
