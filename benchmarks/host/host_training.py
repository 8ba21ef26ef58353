"""Host time of single-table training steps (one device call): per call, the time to enqueue
(host) and the time to finish (wall) of a fused-SGD module step, its forward, and a dense
backward step, on 16384 bags of 20 over a 1M x 128 table. host ~= wall means host-bound.

    PYTHONPATH=src python3 benchmarks/host/host_training.py
"""

import time

import torch

import embfuse
from embfuse.bench.workloads import Workload, generate_batch

w = Workload("h", "backward", 1_000_000, 128, 16384, 20, "powerlaw", 1.05)
x = generate_batch(w, "cuda")[0]
grad = torch.randn(w.batch, w.dim, device="cuda")
module = embfuse.nn.EmbeddingBag(w.rows, w.dim, mode="sum", optimizer=embfuse.optim.SGD(lr=0.01), device="cuda",
                                 bounds_check="off")
table = torch.randn(w.rows, w.dim, device="cuda", requires_grad=True)


def dense():
    table.grad = None
    embfuse.embedding_bag(x, table, mode="sum", bounds_check="off").backward(grad)


def timed(name, fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls
    print(f"{name:32s} host {host * 1e6:7.0f} us   wall {wall * 1e6:7.0f} us", flush=True)


timed("fused SGD step (module)", lambda: module(x).backward(grad))
timed("module forward", lambda: module(x))
timed("dense backward step", dense)
