"""Training with and without the hot-row path, as a user would run it: a student collection
(26 tables x 100K x 64, row-wise Adagrad fused, hot_rows=64 refreshed every 10 steps and taken
for every batch, or none)
fits a fixed teacher collection's outputs on fresh power-law batches; both students start from
the same weights and see the same batches. Prints both loss curves and the largest relative
difference between them. (Its batches, 2.1M values, are below the size where the hot path pays:
benchmarks/hot_rows/hot_rows_sizes.py times that.)

    PYTHONPATH=src python3 benchmarks/hot_rows/hot_rows_training.py [steps]
"""

import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
w = Workload("c", "collection-train", 100_000, 64, 8192, 10, "powerlaw", 1.05, tables=26)
teacher = make_collection(w, "cuda")
students = {name: make_collection(w, "cuda", embfuse.optim.RowWiseAdagrad(lr=0.05)) for name in ("sparse", "hot")}
students["hot"] = embfuse.EmbeddingBagCollection(students["hot"].tables, device="cuda",
                                                 optimizer=embfuse.optim.RowWiseAdagrad(lr=0.05), bounds_check="off",
                                                 hot_rows=64, hot_refresh=10, hot_min_values=0)
students["hot"].load_state_dict(students["sparse"].state_dict())
head = torch.randn(w.tables * w.dim, device="cuda") / (w.tables * w.dim) ** 0.5
losses = {name: [] for name in students}
for step in range(steps):
    kjt = make_batch(w, "cuda", seed=100 + step)
    with torch.no_grad():
        target = teacher(kjt).values() @ head
    for name, ebc in students.items():
        loss = (ebc(kjt).values() @ head - target).square().mean()
        loss.backward()
        losses[name].append(loss.item())
for i in sorted({0, 9, 19, steps // 2, steps - 1}):
    print(f"step {i + 1:3d}: loss sparse {losses['sparse'][i]:.6f}, hot {losses['hot'][i]:.6f}")
rel = max(abs(a - b) / abs(a) for a, b in zip(losses["sparse"], losses["hot"]))
print(f"largest relative difference of the two loss curves: {rel:.2e}; hot rows taken "
      f"{int((students['hot'].hot_slot >= 0).sum())} slots")
