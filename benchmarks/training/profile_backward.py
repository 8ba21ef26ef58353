"""Where the time of embfuse's backward goes (one device call): torch.profiler over a few steps
of forward + dense backward, and of a fused SGD step, on the `backward` bench workload.

    PYTHONPATH=src python3 benchmarks/training/profile_backward.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.workloads import Workload, generate_batch

w = Workload("p", "backward", 1_000_000, 128, 16384, 64, "powerlaw", 1.05)
x = generate_batch(w, "cuda")[0]
table = torch.randn(w.rows, w.dim, device="cuda", requires_grad=True)
grad = torch.randn(w.batch, w.dim, device="cuda")
fused = embfuse.nn.EmbeddingBag(w.rows, w.dim, mode="sum", optimizer=embfuse.optim.SGD(lr=0.01), device="cuda",
                                bounds_check="off")


def dense():
    table.grad = None
    embfuse.embedding_bag(x, table, mode="sum", bounds_check="off").backward(grad)


def sgd():
    fused(x).backward(grad)


for name, step in (("dense", dense), ("fused sgd", sgd)):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"==== {name}: 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
