"""One warp against four at few long bags, forced through tuning.SPREAD (benchmarks/NOTES.md,
session 39): fp32 one-table calls of 512-1024 bags, whose eager form folds the check into the
pooling launch and whose CUDA-graph replay does not; and collections of 2048 bags (never
folded), fp32 and bf16, 1-8 tables of 500K x 128. Public calls with the default check, GPU time
alone (residency/gpu_time.py), eager and replayed, the best of two alternating rounds.

    PYTHONPATH=src python3 benchmarks/lookup/few_bags_folded.py
"""
import os
import sys

import torch

import embfuse
from embfuse.ops import tuning
from embfuse.ops.tuning import Spread
from embfuse.bench.workloads import Workload, generate_ids
from embfuse.bench.collection import make_batch, make_collection
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "residency"))
from gpu_time import gpu_us, captured  # noqa: E402
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
NEVER = {4: Spread(0, 64, 0), 2: Spread(0, 64, 256)}
ALWAYS = {4: Spread(4096, 64, 0), 2: Spread(4096, 64, 256)}
tuning.FOLDED_BAGS = 4096  # no folded bound: NEVER and ALWAYS decide
print(torch.cuda.get_device_name(), flush=True)


def ab(label, f):
    t = {"one": [[], []], "four": [[], []]}
    for _ in range(2):
        for name, rule in (("one", NEVER), ("four", ALWAYS)):
            tuning.SPREAD.clear(); tuning.SPREAD.update(rule)
            f()
            t[name][0].append(gpu_us(f, flush))
            t[name][1].append(gpu_us(captured(f), flush))
    e1, r1, e4, r4 = min(t["one"][0]), min(t["one"][1]), min(t["four"][0]), min(t["four"][1])
    print(f"{label}: eager {e1:.1f} -> {e4:.1f} ({100*(e4/e1-1):+.0f}%), "
          f"replay {r1:.1f} -> {r4:.1f} ({100*(r4/r1-1):+.0f}%)",
          flush=True)


with torch.no_grad():
    for D, B, L, wtd in ((128, 512, 64, False), (128, 1024, 64, False), (128, 1024, 150, False), (128, 1024, 100, True),
                         (64, 1024, 64, False), (64, 1024, 100, True), (256, 1024, 64, False), (32, 1024, 64, False)):
        g = torch.Generator(device="cuda").manual_seed(0)
        bag = embfuse.nn.EmbeddingBag(1_000_000, D, mode="sum", device="cuda")
        ids = generate_ids(Workload("t", "bag", 1_000_000, D, B, L, "powerlaw", 1.05), B * L, "cuda", g).view(B, L)
        psw = torch.rand(B, L, device="cuda", generator=g) if wtd else None
        ab(f"fp32 one D{D} B{B} L{L}{' w' if wtd else ''}", lambda: bag(ids, per_sample_weights=psw))
        del bag; torch.cuda.empty_cache()
    for dt in (torch.float32, torch.bfloat16):
        for F, B, L in ((1, 2048, 150), (2, 1024, 150), (4, 512, 150), (8, 256, 150), (4, 512, 64), (8, 256, 64)):
            w = Workload("c", "collection", 500_000, 128, B, L, "powerlaw", 1.05, tables=F)
            kjt = make_batch(w, "cuda")
            ebc = make_collection(w, "cuda", data_type=dt)
            ab(f"{str(dt)[6:]} collection F{F} B{B} L{L}", lambda: ebc(kjt))
            del ebc; torch.cuda.empty_cache()
