"""The pooling kernels' row loads with `eviction_policy="evict_last"` against no hint, for `off`
and the default, one table and collections (benchmarks/NOTES.md, session 37: not kept).

GPU time alone (benchmarks/residency/gpu_time.py's method: the L2 flushed, the host's enqueue
hidden behind a sleep), three alternating rounds in one process; each line gives the range of the
rounds and the change of the best. The hint goes in through tuning.pooling_shape's overrides.
Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/lookup/evict_policy.py
"""

import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_ids
from embfuse.ops import tuning

sys.path.insert(0, "benchmarks/residency")
from gpu_time import gpu_us  # noqa: E402

ROUNDS = 3
PLAIN = tuning.pooling_shape


def evict_last(D, values, bags, overrides=None, traced=False):
    return PLAIN(D, values, bags, {**(overrides or {}), "evict": "evict_last"}, traced)


def compare(label, fns, flush):
    times = {}
    for _ in range(ROUNDS):
        for hint in ("", "evict_last"):
            tuning.pooling_shape = evict_last if hint else PLAIN
            for name, fn in fns.items():
                times.setdefault((name, hint), []).append(gpu_us(fn, flush, reps=20))
    tuning.pooling_shape = PLAIN
    parts = []
    for name in fns:
        a, b = times[(name, "")], times[(name, "evict_last")]
        parts.append(f"{name} {min(a):.1f}-{max(a):.1f} -> {min(b):.1f}-{max(b):.1f} "
                     f"({100 * (min(b) / min(a) - 1):+.1f}%)")
    print(f"{label}: " + "; ".join(parts), flush=True)


def main(dev="cuda"):
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    print(torch.cuda.get_device_name(), flush=True)
    with torch.no_grad():
        for D, dist, dtype in ((32, "powerlaw", "float32"), (64, "powerlaw", "float32"),
                               (128, "powerlaw", "float32"), (256, "powerlaw", "float32"),
                               (128, "powerlaw", "bfloat16"), (32, "uniform", "float32"), (128, "uniform", "float32")):
            w = Workload("x", "bag", 10_000_000, D, 65536, 64, dist, 1.05 if dist != "uniform" else 0.0)
            g = torch.Generator(device=dev).manual_seed(0)
            ids = generate_ids(w, w.batch * w.hotness, dev, g).view(w.batch, w.hotness)
            torch.manual_seed(0)
            m = {mode: embfuse.nn.EmbeddingBag(w.rows, D, mode="sum", device=dev, dtype=getattr(torch, dtype),
                                               bounds_check="off" if mode == "off" else "deferred")
                 for mode in ("off", "default")}
            m["off"].load_state_dict(m["default"].state_dict())
            compare(f"bag {dtype} D{D} B65536 {dist}", {k: (lambda e=e: e(ids)) for k, e in m.items()}, flush)
            del m
            torch.cuda.empty_cache()
        for w in (Workload("criteo", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26),
                  Workload("dlrm", "collection", 500_000, 128, 2048, 150, "powerlaw", 1.05, tables=12)):
            kjt = make_batch(w, dev)
            c = {mode: make_collection(w, dev, bounds_check="off" if mode == "off" else "deferred")
                 for mode in ("off", "default")}
            compare(f"collection {w.name} B{w.batch}", {k: (lambda e=e: e(kjt)) for k, e in c.items()}, flush)
            del c
            torch.cuda.empty_cache()
    w = Workload("criteo", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, dev)
    c = {mode: make_collection(w, dev, embfuse.optim.SGD(lr=0.01), bounds_check="off" if mode == "off" else "deferred")
         for mode in ("off", "default")}
    compare("criteo train step B16384", {k: (lambda e=e: e(kjt).values().sum().backward()) for k, e in c.items()},
            flush)


if __name__ == "__main__":
    main()
