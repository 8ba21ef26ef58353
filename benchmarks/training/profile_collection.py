"""Where the time of a table-collection step goes (one device call): torch.profiler over one
forward and one training step (forward + backward + fused SGD) of the `collection` workloads,
listing every GPU kernel in launch order with its duration.

    PYTHONPATH=src python3 benchmarks/training/profile_collection.py [batch]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w = Workload("p", "collection-train", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01))
grad = torch.randn(w.batch, w.dim * w.tables, device="cuda")
counts = [int(torch.unique(jt.values(), return_counts=True)[1].max()) for jt in kjt.to_dict().values()]
print(f"B={B}: {kjt.values().numel()} ids; longest run of one id per table: {counts}")


def forward():
    with torch.no_grad():
        ebc(kjt)


def train():
    ebc(kjt).values().backward(grad)


for name, step in (("forward", forward), ("train step", train)):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    print(f"==== {name}: {len(kernels)} GPU ops, {total / 1e3:.3f} ms of GPU time")
    for e in kernels:
        print(f"  {e.device_time:10.1f} us  {e.name[:90]}")
