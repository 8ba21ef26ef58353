"""Where the host time of a small checked call goes: wall time per call of embedding_bag
(D64, B512, L8, no grad) in each bounds_check mode and torch's F.embedding_bag, then a cProfile of the default's calls.

    PYTHONPATH=src python3 benchmarks/host/host_overhead.py
"""

import cProfile
import pstats
import time

import torch

import embfuse

w = torch.randn(100_000, 64, device="cuda")
ids = torch.randint(0, 100_000, (512, 8), device="cuda")


def per_call_us(mode, calls=2000):
    call = ((lambda: torch.nn.functional.embedding_bag(ids, w, mode="sum")) if mode == "torch" else
            (lambda: embfuse.embedding_bag(ids, w, mode="sum", bounds_check=mode)))
    with torch.no_grad():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


for mode in ("torch", "off", "deferred", "sync", "torch", "off", "deferred"):
    print(f"{mode:9s} {per_call_us(mode):6.1f} us a call (wall, back to back)")
with torch.no_grad():
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        embfuse.embedding_bag(ids, w, mode="sum")
    prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(22)
embfuse.check_errors()
