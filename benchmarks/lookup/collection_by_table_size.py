"""Where the Criteo-like collection forward's time goes, by table size: the 26 features pooled
in groups (tables of at most 32 rows, 33 to 32768 rows, more), each group its own collection
over the same batch's values, beside FBGEMM's TBE (no bounds check) over the same group. Each
cell: GPU time of a call's kernels (profiler, L2 cleared by other traffic before each call), us,
for `off` with int64 values and with int32 values (what a check's narrowed copy gives the
pooling), and FBGEMM NONE with int64 values. One H100 run: benchmarks/NOTES.md, session 45.

    PYTHONPATH=src python3 benchmarks/lookup/collection_by_table_size.py [batch]
"""

import sys
from pathlib import Path

import torch

import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.peers import Unsupported, fbgemm_tbe
from embfuse.bench.workloads import Workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "validation"))
from narrow_ids import gpu_time  # noqa: E402

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w = Workload("c", "collection", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26, group="collection")
rows = table_rows(w)
by_key = make_batch(w, "cuda").to_dict()


def batch(keys, dtype):
    return embfuse.KeyedJaggedTensor(keys, torch.cat([by_key[k].values() for k in keys]).to(dtype),
                                     lengths=torch.cat([by_key[k].lengths() for k in keys]), stride=B,
                                     length_per_key=[by_key[k].values().numel() for k in keys])


GROUPS = {"at most 32 rows": lambda r: r <= 32, "33 to 32768 rows": lambda r: 32 < r <= 32768,
          "more than 32768 rows": lambda r: r > 32768, "all 26": lambda r: True}
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B{B}, D128 fp32, power-law 1.05, "
      "bags of 1-99; GPU time, us")
print("| tables | features | ids | off, int64 | off, int32 | FBGEMM NONE |")
print("|---|---|---|---|---|---|")
with torch.no_grad():
    for name, pick in GROUPS.items():
        idx = [i for i, r in enumerate(rows) if pick(r)]
        keys = [f"f{i}" for i in idx]
        ebc = embfuse.EmbeddingBagCollection(
            [embfuse.EmbeddingBagConfig(rows[i], w.dim, f"t{i}", feature_names=[f"f{i}"]) for i in idx],
            device="cuda", bounds_check="off")
        b64, b32 = batch(keys, torch.int64), batch(keys, torch.int32)
        cells = [gpu_time(lambda: ebc(b64).values()), gpu_time(lambda: ebc(b32).values())]
        try:
            tbe = fbgemm_tbe([(rows[i], w.dim) for i in idx], checked=False)
            cells.append(gpu_time(lambda: tbe(b64.values(), b64.offsets())))
        except Unsupported:
            cells.append(float("nan"))
        print(f"| {name} | {len(idx)} | {b64.values().numel() / 1e6:.1f}M | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)
        del ebc
