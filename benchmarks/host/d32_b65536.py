"""One table D32 B65536 L64 (10M rows, 2-D ids, sum), default against `off`, fp32 and fp16,
power-law and uniform ids: do_bench three times, the GPU's busy time (profiler) and the host's
time a call over 200 back-to-back calls. Asks whether a quick bench's default row that reads
twice `off`'s (H200, benchmarks/NOTES.md session 59) is GPU time or host time.

    PYTHONPATH=src python3 benchmarks/host/d32_b65536.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import embfuse
from embfuse.bench.workloads import Workload, generate_batch


def gpu_busy(f) -> float:
    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 10


def host(f, n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def measure(w: Workload) -> None:
    table = torch.randn(w.rows, w.dim, device="cuda").to(w.torch_dtype)
    ids, offsets = generate_batch(w, "cuda")
    for mode in ("deferred", "off"):
        def f(mode=mode):
            return embfuse.embedding_bag(ids, table, offsets, mode="sum", bounds_check=mode)

        f()
        b = [do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
        print(f"{w.dtype} D32 B65536 {w.dist} {mode}: do_bench {' '.join('%.1f' % x for x in b)} "
              f"gpu {gpu_busy(f):.1f} host {host(f):.1f}", flush=True)


def main() -> None:
    torch.set_grad_enabled(False)
    for dtype in ("float32", "float16", "float32"):
        for dist, alpha in (("powerlaw", 1.05), ("uniform", 0.0)):
            measure(Workload("x", "bag", 10_000_000, 32, 65536, 64, dist, alpha, dtype=dtype))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
