"""Host time of the default path against `off` at B2048, where a fast GPU leaves the host behind:
the 26-table Criteo-like collection's forward (power-law ids, bags of 1-99) and one table D128
L64's `embfuse.embedding_bag` beside torch's. Per call: the time to enqueue 200 calls (host), to
finish them (wall) and the GPU's busy time (profiler); two rounds each; then a cProfile of each
call. host ~= wall > GPU busy means host-bound.

    PYTHONPATH=src python3 benchmarks/host/host_default_b2048.py
"""

import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_batch


def per_call(f, n: int = 200) -> tuple[float, float, float]:
    """(host, wall, GPU busy) us a call over n back-to-back calls."""
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    gpu = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 10
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6, gpu


def print_profile(f, label: str, n: int = 200) -> None:
    p = cProfile.Profile()
    p.enable()
    for _ in range(n):
        f()
    p.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    stats = pstats.Stats(p, stream=s)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    print(f"==== cProfile {label} ({n} calls)\n" + s.getvalue(), flush=True)


def report(label: str, calls: dict) -> None:
    for r in range(2):
        for mode, f in calls.items():
            print(f"{label} {mode} round {r}: host %.1f wall %.1f gpu %.1f" % per_call(f), flush=True)
    for mode in ("default", "off"):
        print_profile(calls[mode], f"{label} {mode}")


def main() -> None:
    torch.set_grad_enabled(False)
    w = Workload("c", "collection", 10_000_000, 128, 2048, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    default, off = (make_collection(w, "cuda", None, bounds_check=m) for m in ("deferred", "off"))
    report("collection fwd", {"default": lambda: default(kjt).values(), "off": lambda: off(kjt).values()})
    del default, off
    torch.cuda.empty_cache()
    ids, _ = generate_batch(Workload("one", "bag", 10_000_000, 128, 2048, 64, "powerlaw", 1.05), "cuda")
    table = torch.randn(10_000_000, 128, device="cuda")
    report("one table fwd", {"default": lambda: embfuse.embedding_bag(ids, table),
                             "off": lambda: embfuse.embedding_bag(ids, table, bounds_check="off"),
                             "torch": lambda: torch.nn.functional.embedding_bag(ids, table)})


if __name__ == "__main__":
    main()
