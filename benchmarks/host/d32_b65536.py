"""One table D32 B65536 L64 (10M rows, 2-D ids, sum), default against `off`, fp32 and fp16,
power-law and uniform ids: do_bench three times, then the GPU's busy time (profiler) and the
host's time a call over 200 back-to-back calls (host_default_b2048.per_call). Asks whether a
quick bench's default row that reads twice `off`'s (H200, benchmarks/NOTES.md session 59) is
GPU time or host time.

    PYTHONPATH=src python3 benchmarks/host/d32_b65536.py
"""

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.workloads import Workload, generate_batch

sys.path.insert(0, str(Path(__file__).parent))
from host_default_b2048 import per_call  # noqa: E402


def measure(w: Workload) -> None:
    table = torch.randn(w.rows, w.dim, device="cuda").to(w.torch_dtype)
    ids, offsets = generate_batch(w, "cuda")
    for mode in ("deferred", "off"):
        def f(mode=mode):
            return embfuse.embedding_bag(ids, table, offsets, mode="sum", bounds_check=mode)

        f()
        b = [do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
        host, _, gpu = per_call(f)
        print(f"{w.dtype} D32 B65536 {w.dist} {mode}: do_bench {' '.join('%.1f' % x for x in b)} "
              f"gpu {gpu:.1f} host {host:.1f}", flush=True)


def main() -> None:
    torch.set_grad_enabled(False)
    for dtype in ("float32", "float16", "float32"):
        for dist, alpha in (("powerlaw", 1.05), ("uniform", 0.0)):
            measure(Workload("x", "bag", 10_000_000, 32, 65536, 64, dist, alpha, dtype=dtype))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
