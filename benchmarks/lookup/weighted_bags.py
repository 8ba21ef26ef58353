"""Weighted against plain pooling, as users call it (the default check): one table (2M rows,
power-law ids, fixed and 1-99 ids a bag) and the 26-table Criteo-like collection, D32 / D64 /
D128, forward under no_grad. The GPU time alone (gpu_time.py's method: L2 flushed, the host's
enqueue hidden behind a sleep), so host-bound small calls read what the GPU spends.

The weighted loop's unroll (bags.pool_bag; benchmarks/NOTES.md, session 38) is compared by
running this on two trees in turn:
    PYTHONPATH=<old tree>/src python benchmarks/lookup/weighted_bags.py
    PYTHONPATH=src python benchmarks/lookup/weighted_bags.py
"""

import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_ids

sys.path.insert(0, "benchmarks/residency")
from gpu_time import gpu_us  # noqa: E402

ROWS = 2_000_000


def one_table(D, B, L, flush):
    """(plain, weighted) us; L None: 1-99 ids a bag."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if L is None:
        lengths = torch.randint(1, 100, (B,), device="cuda", generator=g)
    else:
        lengths = torch.full((B,), L, device="cuda")
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    n = int(lengths.sum())
    ids = generate_ids(Workload("t", "bag", ROWS, D, B, 64, "powerlaw", 1.05), n, "cuda", g)
    psw = torch.rand(n, device="cuda", generator=g)
    bag = embfuse.nn.EmbeddingBag(ROWS, D, mode="sum", device="cuda")
    with torch.no_grad():
        return tuple(gpu_us(lambda: bag(ids, offsets, per_sample_weights=p), flush) for p in (None, psw))


def collection(D, B, flush):
    w = Workload("c", "collection", 10_000_000, D, B, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    weighted = embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values(), torch.rand(kjt.values().numel(), device="cuda"),
                                         lengths=kjt.lengths(), stride=B)
    times = []
    for is_weighted, batch in ((False, kjt), (True, weighted)):
        ebc = make_collection(w, "cuda", is_weighted=is_weighted)
        with torch.no_grad():
            times.append(gpu_us(lambda: ebc(batch), flush))
        del ebc
        torch.cuda.empty_cache()
    return tuple(times)


def main():
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    cases = [(f"one table D{D} B{B} L{L or '1-99'}", lambda D=D, B=B, L=L: one_table(D, B, L, flush))
             for D in (32, 64, 128) for B, L in ((65536, 64), (65536, 20), (16384, None))]
    cases += [(f"collection D{D} B{B}", lambda D=D, B=B: collection(D, B, flush))
              for D, B in ((32, 16384), (128, 2048), (128, 16384))]
    for label, fn in cases:
        plain, weighted = fn()
        print(f"{label}: plain {plain:.1f} us, weighted {weighted:.1f} us ({100 * (weighted / plain - 1):+.0f}%)",
              flush=True)


if __name__ == "__main__":
    main()
