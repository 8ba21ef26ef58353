"""Host time against GPU time of the Criteo-like collection (26 tables x 128, power-law ids, bags
of 1-99) at B2048, fused SGD, checked by default and `off`: per call, the time to enqueue (host),
to finish (wall) and the GPU's busy time (profiler), for the training step and the forward; then
a cProfile of the default's steps. host ~= wall > GPU busy means host-bound.

    PYTHONPATH=src python3 benchmarks/host/host_collection_b2048.py
"""

import cProfile
import pstats

import torch
from host_default_b2048 import per_call as calls_of  # (this folder: the script's own)

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

w = Workload("c", "collection-train", 10_000_000, 128, 2048, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
grad = torch.randn(2048, 128 * 26, device="cuda")


def per_call(f, train: bool):
    with torch.enable_grad() if train else torch.no_grad():
        return calls_of(f, 100)


for mode in ("deferred", "off"):
    ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01), bounds_check=mode)
    calls = {"step": (lambda: ebc(kjt).values().backward(grad), True), "forward": (lambda: ebc(kjt).values(), False)}
    for name, (f, train) in calls.items():
        host, wall, gpu = per_call(f, train)
        print(f"{mode} {name}: host {host:.0f} us a call, wall {wall:.0f}, GPU busy {gpu:.0f}", flush=True)
    if mode == "deferred":
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            calls["step"][0]()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
embfuse.check_errors()
