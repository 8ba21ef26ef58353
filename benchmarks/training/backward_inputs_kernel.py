"""The backward-inputs kernel's time inside the fused training step (26 Criteo-sized tables x 128,
power-law ids, B2048 and B16384): medians over 40 steps from the profiler. The argument tags
the printed lines (a variant being compared).

    PYTHONPATH=src python3 benchmarks/training/backward_inputs_kernel.py TAG
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.collection import make_batch
from embfuse.bench.workloads import Workload

sys.path.insert(0, "benchmarks/training")
from compiled_step import Model, runner  # noqa: E402

tag = sys.argv[1]
for B in (2048, 16384):
    w = Workload("c", "collection-train", 1_000_000, 128, B, 20, "powerlaw", 1.05, tables=26)
    batches = [(make_batch(w, "cuda", seed=s), torch.rand(B, 1, device="cuda")) for s in range(8)]
    m = Model(w)
    step = runner(m, m)
    for b in batches:
        step(*b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for b in batches:
                step(*b)
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "backward_inputs" in e.name:
            tot.setdefault(e.name, []).append(e.device_time)
    for k, v in tot.items():
        print(tag, B, k[:40], f"n={len(v)} median {statistics.median(v):.2f} us mean {sum(v)/len(v):.2f}")
embfuse.check_errors()
