"""Where the host time of a small lookup goes (one device call): wall-clock per call of the raw
launcher and of the public function, then a profile of the public function.

    PYTHONPATH=src python3 benchmarks/host_overhead.py
"""

import cProfile
import pstats

import torch
import torch.nn.functional as F

import embfuse
from embfuse.bench.runner import _host_us
from embfuse.ops.embedding_bag import SUM, embedding_bag_forward


def per_call_us(fn, calls=2000):
    for _ in range(20):  # warm-up: compile and cache outside the timing
        fn()
    return _host_us(fn, calls)


w = torch.randn(100_000, 64, device="cuda")
x = torch.randint(0, 100_000, (512, 8), device="cuda")
flat = x.reshape(-1)
offsets = torch.arange(0, flat.numel() + 1, 8, device="cuda")
cases = {
    "torch F.embedding_bag": lambda: F.embedding_bag(x, w, mode="sum"),
    "embfuse launcher": lambda: embedding_bag_forward(w, flat, offsets, None, SUM, -1),
    "embfuse.embedding_bag off": lambda: embfuse.embedding_bag(x, w, mode="sum", bounds_check="off"),
    "embfuse.embedding_bag raise": lambda: embfuse.embedding_bag(x, w, mode="sum"),
}
for name, fn in cases.items():
    print(f"{name:32s} {per_call_us(fn):7.1f} us/call", flush=True)
prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    embfuse.embedding_bag(x, w, mode="sum", bounds_check="off")
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
