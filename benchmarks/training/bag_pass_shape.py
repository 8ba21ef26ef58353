"""The per-bag passes' program shape (tuning.BAG_PASS_SHAPE: bags side by side x ids of each a
step), for the backward inputs and the hot split: their GPU time a call (profiler, 4 calls) on
  coll16k: 26 tables x 128, B16384, bags of 1-39 ids, row-wise Adagrad; pooling sum and
           combiner mean with default id 0
  coll2k:  the same at B2048
  hot16k:  the same, B16384, with 64 hot rows a table (the hot split + the cold backward inputs)
  L64:     one table 1M x 128, bags of 64, B65536, mean (autograd backward of embedding_bag)
  L1:      one table 1M x 128, bags of 1, B65536, sum
The weights (gradient for one table) after the calls are compared bitwise with the first shape's.
The safe pass's own sweep: NOTES, "the safe pass's shape".

    PYTHONPATH=src python3 benchmarks/training/bag_pass_shape.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.collection import make_batch, make_collection, table_rows
from embfuse.bench.workloads import Workload
from embfuse.ops import tuning
from embfuse.optim import RowWiseAdagrad

SHAPES = [(8, 32), (16, 16), (32, 16), (64, 16), (32, 32), (16, 32), (32, 8)]  # first: in use until 02d09b7
KEYS = ("backward_inputs", "hot_split")


def collection(B: int, rules: dict, hot: int = 0):
    """(build, batches, step, state) of a 26-table collection at batch size B."""
    w = Workload("c", "collection", 1_000_000, 128, B, 20, "powerlaw", 1.05, tables=26)
    batches = [make_batch(w, "cuda", seed=i) for i in range(2, 6)]

    def build():
        torch.manual_seed(0)
        if hot:
            return make_collection(w, "cuda", RowWiseAdagrad(lr=0.01), hot_rows=hot)
        return embfuse.EmbeddingBagCollection(
            [embfuse.EmbeddingBagConfig(r, 128, f"t{i}", feature_names=[f"f{i}"], **rules)
             for i, r in enumerate(table_rows(w))], device="cuda", optimizer=RowWiseAdagrad(lr=0.01))

    def step(ebc, b):
        ebc(b).values().sum().backward()
    return build, batches, step, lambda ebc: [p.detach() for p in ebc.parameters()]


def table(L: int, mode: str):
    """(build, batches, step, state) of one 1M x 128 table, B65536 bags of L ids."""
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 1_000_000, (65536, L), device="cuda", generator=g) for _ in range(4)]

    def build():
        torch.manual_seed(0)
        return torch.randn(1_000_000, 128, device="cuda", requires_grad=True)

    def step(t, ids):
        t.grad = None
        embfuse.embedding_bag(ids, t, mode=mode).sum().backward()
    return build, batches, step, lambda t: [t.grad]


CASES = {"coll16k pooling sum": collection(16384, {}),
         "coll16k combiner mean d0": collection(16384, {"combiner": "mean", "default_id": 0}),
         "coll2k pooling sum": collection(2048, {}), "hot16k": collection(16384, {}, hot=64),
         "L64 mean": table(64, "mean"), "L1 sum": table(1, "sum")}
chosen = tuning.BAG_PASS_SHAPE
for name, (build, batches, step, state) in CASES.items():
    ref = None
    for shape in SHAPES:
        tuning.BAG_PASS_SHAPE = shape
        obj = build()
        for b in batches:
            step(obj, b)
        s = [x.clone() for x in state(obj)]
        ref = s if ref is None else ref
        same = all(torch.equal(a, c) for a, c in zip(s, ref))
        for b in batches:
            step(obj, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for b in batches:
                step(obj, b)
            torch.cuda.synchronize()
        ev = {e.key: e.device_time_total / 4 for e in p.key_averages() if e.device_time_total > 0}
        part = {k: sum(v for e, v in ev.items() if k in e) for k in KEYS}
        print(f"{name} | {shape[0]} x {shape[1]} | " + " | ".join(f"{k} {v:.1f}" for k, v in part.items() if v)
              + f" | all {sum(ev.values()):.0f} us | same {same}", flush=True)
        del obj
tuning.BAG_PASS_SHAPE = chosen
