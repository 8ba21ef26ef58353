"""Pooling tiles for 2-byte tables at few long bags (benchmarks/NOTES.md, session 39): 256 elements
x 1 warp (16 bytes a thread a step), 512 x 4 (tuning.spreads' shape: 8 bytes a thread) and
1024 x 4 (16 bytes a thread). One table of 1M rows, power-law ids, sum: the kernels alone
(do_bench medians, three alternating rounds, L2 flushed) at D 32-256 x L 64/150 x B 256-2048, and
the public eager call (default check, folded into the pooling launch) with the shape forced
through tuning.pooling_shape, GPU time alone (residency/gpu_time.py).

    PYTHONPATH=src python3 benchmarks/lookup/few_bags_tiles.py [bfloat16|float16]
"""
import os
import sys

import torch

import embfuse
from triton.testing import do_bench
from embfuse.bench.workloads import Workload, generate_ids
from embfuse.ops import tuning
from embfuse.ops.bags import SUM
from embfuse.ops.embedding_bag import embedding_bag_forward
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "residency"))
from gpu_time import gpu_us  # noqa: E402
SHAPES = {"256x1": {"elems": 256, "num_warps": 1}, "512x4": {"elems": 512, "num_warps": 4},
          "1024x4": {"elems": 1024, "num_warps": 4}}
us = lambda fn: do_bench(fn, rep=50, return_mode="median") * 1e3
dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
print(torch.cuda.get_device_name(), dt, flush=True)
W = {D: torch.randn(1_000_000, D, device="cuda", dtype=dt) for D in (32, 64, 128, 256)}
for D in (32, 64, 128, 256):
    for L in (64, 150):
        for B in (256, 1024, 2048):
            ids = generate_ids(Workload("t", "bag", 1_000_000, D, B, L, "powerlaw", 1.05), B * L, "cuda",
                               torch.Generator(device="cuda").manual_seed(0))
            offs = torch.arange(0, B * L + 1, L, device="cuda")
            fn = lambda cfg: embedding_bag_forward(W[D], ids, offs, None, SUM, -1, config=cfg, with_max_ids=False)[0]
            ref = fn(SHAPES["256x1"])
            t = {k: [] for k in SHAPES}
            for _ in range(3):
                for k, cfg in SHAPES.items():
                    assert torch.allclose(fn(cfg).float(), ref.float(), rtol=2e-2, atol=2e-2)
                    t[k].append(us(lambda: fn(cfg)))
            print(f"kernel D{D} L{L} B{B}: " + ", ".join(f"{k} {min(v):.1f}" for k, v in t.items()), flush=True)
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
plain = tuning.pooling_shape
for D in (32, 128):
    for B in (512, 1024):
        L = 64
        bag = embfuse.nn.EmbeddingBag(1_000_000, D, mode="sum", device="cuda", dtype=dt)
        ids = generate_ids(Workload("t", "bag", 1_000_000, D, B, L, "powerlaw", 1.05), B * L, "cuda",
                           torch.Generator(device="cuda").manual_seed(0)).view(B, L)
        t = {k: [] for k in SHAPES}
        with torch.no_grad():
            for _ in range(3):
                for k, cfg in SHAPES.items():
                    tuning.pooling_shape = (lambda D_, v, b, c=None, tr=False, *a, cfg=cfg, **kw:
                                            plain(D_, v, b, cfg, True))
                    bag(ids)
                    t[k].append(gpu_us(lambda: bag(ids), flush))
        tuning.pooling_shape = plain
        print(f"public eager D{D} L{L} B{B}: " + ", ".join(f"{k} {min(v):.1f}" for k, v in t.items()), flush=True)
        del bag
