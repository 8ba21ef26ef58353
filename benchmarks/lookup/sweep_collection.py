"""Sweep the collection forward's launch shape on the GPU (one device call): tile elements x
warps on the Criteo-like batch of the `collection` workloads (26 tables x 128, power-law ids),
fp32 and bf16, against the rule's choice.

    PYTHONPATH=src python3 benchmarks/lookup/sweep_collection.py [batch]
"""

import itertools
import sys

import torch
from triton.testing import do_bench

from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops.collection import collection_forward

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w = Workload("sweep", "collection", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
values, offsets = kjt.values(), kjt.offsets()
for dtype in (torch.float32, torch.bfloat16):
    ebc = make_collection(w, "cuda", data_type=dtype)
    plan = ebc._plan(kjt.keys(), ebc.weights.device)
    args = (ebc.weights.detach(), values, offsets, None, plan.meta, B, plan.total_dim, plan.max_dim, plan.layout.vec)
    ref = collection_forward(*args)
    rule = do_bench(lambda: collection_forward(*args), warmup=25, rep=100, return_mode="median") * 1e3
    print(f"{dtype} B{B}: rule {rule:.1f} us", flush=True)
    for elems, warps in itertools.product((256, 512, 1024, 2048, 4096), (1, 2, 4, 8)):
        cfg = {"elems": elems, "num_warps": warps}
        ok = torch.allclose(collection_forward(*args, config=cfg).float(), ref.float(), rtol=1e-2, atol=1e-3)
        us = do_bench(lambda: collection_forward(*args, config=cfg), warmup=25, rep=100, return_mode="median") * 1e3
        print(f"  elems {elems:5d} warps {warps}: {us:8.1f} us{'' if ok else '  MISMATCH'}", flush=True)
    del ebc
