"""Training steps of the collection workloads, one line each (one device call, for A/B runs of
two trees or of two settings in separate processes on one instance): the Criteo collection step
(SGD, B16384 and B65536) and the 26 x 1M x 128 and 8 x 10M x 64 steps of one
EmbeddingBagCollection (SGD and row-wise Adagrad). Medians of CUDA-event timings (do_bench).

    PYTHONPATH=src python3 benchmarks/training/steps.py [label]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import COLLECTION_PROVIDERS, make_batch
from embfuse.bench.train import _collection, batches
from embfuse.bench.workloads import Workload

label = sys.argv[1] if len(sys.argv) > 1 else ""


def report(name, step):
    step()
    print(f"{label} {name}: {do_bench(step, warmup=3, rep=300, return_mode='median') * 1e3:.0f} us", flush=True)


for batch in (16384, 65536):
    w = Workload("c", "collection-train", 10_000_000, 128, batch, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    forward = COLLECTION_PROVIDERS["embfuse"](w, kjt, "cuda", True)[0]
    grad = torch.randn(w.batch, w.dim * w.tables, device="cuda")
    report(f"Criteo B{batch} SGD", lambda: forward(kjt).backward(grad))
    forward = kjt = grad = None
    torch.cuda.empty_cache()
for w in (Workload("t", "train", 1_000_000, 128, 16384, 20, "powerlaw", 1.05, tables=26),
          Workload("t", "train", 10_000_000, 64, 65536, 32, tables=8)):
    ids = batches(w, "cuda")
    for name, opt in (("SGD", embfuse.optim.SGD(lr=0.01)), ("row-wise", embfuse.optim.RowWiseAdagrad(lr=0.01))):
        step, keep = _collection(opt)(w, ids, "cuda")
        report(f"{w.tables} x {w.rows} x {w.dim} {name}", step)
        step = keep = None
        torch.cuda.empty_cache()
    ids = None
