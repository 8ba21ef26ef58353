"""Training steps by the columns a segment-reduction program takes (one device call): the rule
in embfuse.ops.tuning (update_columns and GRAD_COLUMNS), swept on the 26 x 1M x 128
collection step (SGD, Adagrad, Adam), the dense backward (1M x 128, B16384 L64) and the Criteo
collection step (SGD).

    PYTHONPATH=src python3 benchmarks/training/sweep_columns.py 128 64 32
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import COLLECTION_PROVIDERS, make_batch
from embfuse.bench.train import BACKWARD_PROVIDERS, _collection, batches
from embfuse.bench.workloads import Workload
from embfuse.ops import tuning


def run(name, step, widths):
    line = f"{name}:"
    for c in widths:
        tuning.update_columns = lambda element_states, c=c: c
        tuning.GRAD_COLUMNS = c
        step()
        line += f" {c}: {do_bench(step, warmup=3, rep=200, return_mode='median') * 1e3:.0f}"
    print(line, flush=True)


def main(widths):
    w = Workload("t", "train", 1_000_000, 128, 16384, 20, "powerlaw", 1.05, tables=26)
    ids = batches(w, "cuda")
    for name, opt in (("SGD", embfuse.optim.SGD(lr=0.01)), ("Adagrad", embfuse.optim.Adagrad(lr=0.01)),
                      ("Adam", embfuse.optim.Adam(lr=0.01))):
        step, _keep = _collection(opt)(w, ids, "cuda")
        run(f"26 x 1M x 128 {name}", step, widths)
        del step, _keep
    del ids
    for dist, alpha in (("powerlaw", 1.05), ("uniform", 0.0)):
        w = Workload("b", "backward", 1_000_000, 128, 16384, 64, dist, alpha)
        step, _keep = BACKWARD_PROVIDERS["embfuse"](w, batches(w, "cuda"), "cuda")
        run(f"dense backward {dist}", step, widths)
        del step, _keep
    torch.cuda.empty_cache()
    for batch in (16384, 65536):
        w = Workload("c", "collection-train", 10_000_000, 128, batch, 50, "powerlaw", 1.05, tables=26)
        kjt = make_batch(w, "cuda")
        forward = COLLECTION_PROVIDERS["embfuse"](w, kjt, "cuda", True)[0]
        grad = torch.randn(w.batch, w.dim * w.tables, device="cuda")
        run(f"Criteo B{batch} SGD", lambda: forward(kjt).backward(grad), widths)
        forward = kjt = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]])
