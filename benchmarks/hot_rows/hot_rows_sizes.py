"""Where the hot-row path starts to pay: the Criteo-shaped collection step (26 tables capped at
1M rows, D128, power-law ids, SGD) with and without hot_rows=64 over batch sizes and bag
lengths, in one process (us, medians of CUDA-event timings; the hot set from another batch, not
refreshed while timed).

    PYTHONPATH=src python3 benchmarks/hot_rows/hot_rows_sizes.py
"""

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

for hotness in (5, 20, 50):
    for B in (1024, 4096, 16384):
        w = Workload("c", "collection-train", 1_000_000, 128, B, hotness, "powerlaw", 1.05, tables=26)
        kjt = make_batch(w, "cuda")
        grad = torch.randn(B, w.dim * w.tables, device="cuda")
        times = []
        for K in (0, 64):
            ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01), hot_rows=K)
            step = lambda: ebc(kjt).values().backward(grad)  # noqa: E731
            step()
            times.append(do_bench(step, warmup=3, rep=200, return_mode="median") * 1e3)
            ebc = None
        print(f"bags of 1-{2 * hotness - 1}, B{B}: {kjt.values().numel()} values; step sparse {times[0]:.0f} us, "
              f"hot {times[1]:.0f} us ({times[0] / times[1]:.2f}x)", flush=True)
