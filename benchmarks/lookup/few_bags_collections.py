"""Collections of 2-byte tables with few long bags (F x B <= 1024 bags) through the public call
(tuning.spreads; benchmarks/NOTES.md, session 39): `EmbeddingBagCollection`, default check,
bf16 and fp16, F tables of 500K x 128, bag lengths uniform in 1..2L-1, power-law ids. GPU time
alone (residency/gpu_time.py: the L2 flushed, the host's enqueue hidden), eager and CUDA-graph
replay. Run it once per tree to compare two rules.

    PYTHONPATH=src python3 benchmarks/lookup/few_bags_collections.py
"""
import os
import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "residency"))
from gpu_time import gpu_us, captured  # noqa: E402
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
res = []
for dt in (torch.bfloat16, torch.float16):
    for F, B, L in ((2, 512, 150), (4, 128, 150), (1, 1024, 64), (2, 512, 64), (4, 256, 100)):
        w = Workload("c", "collection", 500_000, 128, B, L, "powerlaw", 1.05, tables=F)
        kjt = make_batch(w, "cuda")
        ebc = make_collection(w, "cuda", data_type=dt)
        with torch.no_grad():
            f = lambda: ebc(kjt)
            f()
            res.append(f"{str(dt)[6:]} collection F{F} B{B} L{L} ({kjt.values().numel()} ids) "
                       f"eager {gpu_us(f, flush):.1f} "
                       f"replay {gpu_us(captured(f), flush):.1f}")
        del ebc; torch.cuda.empty_cache()
print(embfuse.__file__); print("\n".join(res), flush=True)
