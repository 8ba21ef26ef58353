"""Host time of the safe rules' elementwise path (ops/safe.py `_drop_negative_ids`: rules that only
drop ids < 0) as one Triton launch ("launch", eager calls) against its torch ops ("ops", the
traced path), in one process, interleaved: runs of separate processes varied 2x on paths this
does not touch. 26 tables x 128, `combiner="sum"`, row-wise Adagrad; B2048 (host-bound on an
H200) and B16384; forward and step; 7 rounds of per_call (host, wall, GPU us a call), medians.

    PYTHONPATH=src python3 benchmarks/host/elementwise_launch.py
"""

import statistics
import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.workloads import Workload
from embfuse.ops import safe
from embfuse.optim import RowWiseAdagrad

sys.path.insert(0, "benchmarks/host")
from host_default_b2048 import per_call  # noqa: E402

launch = safe._drop_negative_ids
PATHS = {"ops": lambda *a: launch(*a[:-1], False), "launch": launch}  # (the last argument: kernel)
for B in (2048, 16384):
    w = Workload("c", "collection", 1_000_000, 128, B, 20, "powerlaw", 1.05, tables=26)
    b = make_batch(w, "cuda", seed=0)
    torch.manual_seed(0)
    ebc = embfuse.EmbeddingBagCollection(
        [embfuse.EmbeddingBagConfig(r, 128, f"t{i}", feature_names=[f"f{i}"], combiner="sum")
         for i, r in enumerate(table_rows(w))], device="cuda", optimizer=RowWiseAdagrad(lr=0.01))
    for phase in ("fwd", "step"):
        res = {path: [] for path in PATHS}
        for _ in range(7):
            for path, f in PATHS.items():
                safe._drop_negative_ids = f
                if phase == "fwd":
                    with torch.no_grad():
                        res[path].append(per_call(lambda: ebc(b).values(), n=100))
                else:
                    res[path].append(per_call(lambda: ebc(b).values().sum().backward(), n=30))
        for path, v in res.items():
            h, wall, gpu = (statistics.median(x[i] for x in v) for i in range(3))
            print(f"B{B} | {phase} | {path} | host {h:.1f} (min {min(x[0] for x in v):.1f}) | wall {wall:.1f} | "
                  f"GPU {gpu:.1f} us", flush=True)
    safe._drop_negative_ids = launch
