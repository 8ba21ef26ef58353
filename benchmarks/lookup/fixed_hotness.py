"""2-D input (bags of one length) through the public call, for an A/B of two source trees.

`embfuse.embedding_bag(ids (B, L), weight, mode=...)` without gradients, default checks and
`bounds_check="off"`, on one table of 10M rows; prints one line a case: the tree's label, the
case, and the GPU time of each path (triton do_bench, median, L2 flushed). Run it once per tree,
alternating, on one machine:
    for t in base new; do PYTHONPATH=$t/src python benchmarks/lookup/fixed_hotness.py $t; done
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.workloads import Workload, generate_batch

CASES = [  # (D, B, dist, dtype, mode, weighted)
    *[(D, B, "powerlaw", "float32", "sum", False) for D in (32, 64, 128, 256) for B in (2048, 65536)],
    *[(D, 65536, "uniform", "float32", "sum", False) for D in (32, 128)],
    (128, 65536, "powerlaw", "bfloat16", "sum", False), (32, 65536, "powerlaw", "bfloat16", "sum", False),
    (128, 65536, "powerlaw", "float32", "mean", False), (32, 65536, "powerlaw", "float32", "sum", True),
    (128, 65536, "powerlaw", "float32", "max", False),
]


def us(fn):
    return do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3


def main(label, rows=10_000_000, L=64):
    tables = {}
    for D, B, dist, dtype, mode, weighted in CASES:
        w = Workload("f", "bag", rows, D, B, L, dist, 1.05, dtype=dtype)
        key = (D, dtype)
        if key not in tables:
            tables.clear()
            torch.cuda.empty_cache()
            tables[key] = torch.randn(rows, D, device="cuda").to(w.torch_dtype)
        weight = tables[key]
        ids = generate_batch(w, "cuda", 0)[0]
        psw = torch.rand(ids.shape, device="cuda").to(weight.dtype) if weighted else None
        with torch.no_grad():
            ref = torch.nn.functional.embedding_bag(ids, weight, mode=mode, per_sample_weights=psw)
            torch.testing.assert_close(embfuse.embedding_bag(ids, weight, mode=mode, per_sample_weights=psw), ref,
                                       rtol=2e-2, atol=2e-2)
            times = [us(lambda bc=bc: embfuse.embedding_bag(ids, weight, mode=mode, per_sample_weights=psw,
                                                            bounds_check=bc)) for bc in ("deferred", "off")]
        embfuse.check_errors()
        name = f"{dtype} D{D} B{B} {dist} {mode}{' weighted' if weighted else ''}"
        print(f"{label:5s} {name:40s} default {times[0]:8.1f}  off {times[1]:8.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
