"""The pooling's launch shape at few bags (tuning.spreads; benchmarks/NOTES.md, session 37).

`grid`: one table (1M rows, power-law ids, int64), B 256-16384 x L 8/32/150 x D 32/128 sum (and
three max-pooling cases), every tile of 256-4096 elements x 1-8 warps against the rule.
`pair`: the one-warp shape (256 elements) against four warps (512 elements), three alternating
rounds, B 128-4096 x L 48-300 x D 32-256 (L100 weighted), and four collections of 1-8 features.
The kernels alone (bounds_check "off"), do_bench medians (the L2 flushed). JSON to $OUT.
The tables are fp32 unless a dtype is named (bf16: session 38, fp16: session 39; 2-byte tables
gain only at rows of 256 bytes or more; few_bags_public.py times them through public calls).

    PYTHONPATH=src python3 benchmarks/lookup/sweep_few_bags.py grid|pair [float16|bfloat16]
"""

import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_ids
from embfuse.ops.bags import MAX, SUM
from embfuse.ops.collection import collection_forward
from embfuse.ops.embedding_bag import embedding_bag_forward

ONE_WARP, FOUR_WARPS = {"elems": 256, "num_warps": 1}, {"elems": 512, "num_warps": 4}


def close(a, b) -> bool:
    tol = 1e-4 if a.dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def us(fn) -> float:
    return do_bench(fn, rep=50, return_mode="median") * 1e3


def table_case(weights, B, L, D, mode=SUM, weighted=False):
    w = Workload("t", "bag", weights[D].shape[0], D, B, L, "powerlaw", 1.05)
    ids = generate_ids(w, B * L, "cuda", torch.Generator(device="cuda").manual_seed(0))
    offsets = torch.arange(0, B * L + 1, L, device="cuda")
    psw = torch.rand(B * L, device="cuda") if weighted else None
    return lambda cfg: embedding_bag_forward(weights[D], ids, offsets, psw, mode, -1, config=cfg,
                                             with_max_ids=mode == MAX)[0]


def grid(weights) -> list:
    shapes = list(itertools.product((256, 512, 1024, 2048, 4096), (1, 2, 4, 8)))
    cases = [(B, L, D, SUM) for D in (128, 32) for L in (150, 32, 8) for B in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    cases += [(B, 32, 128, MAX) for B in (512, 2048, 8192)]
    rows = []
    for B, L, D, mode in cases:
        fn = table_case(weights, B, L, D, mode)
        ref = fn(None)
        row = {"B": B, "L": L, "D": D, "mode": mode, "rule": us(lambda: fn(None))}
        for elems, warps in shapes:
            cfg = {"elems": elems, "num_warps": warps}
            assert close(fn(cfg), ref)
            row[f"{elems}x{warps}"] = us(lambda: fn(cfg))
        best = min((v, k) for k, v in row.items() if "x" in k)
        print(f"B{B} L{L} D{D} {'max' if mode == MAX else 'sum'}: rule {row['rule']:.1f}, best {best[1]} {best[0]:.1f}",
              flush=True)
        rows.append(row)
    return rows


def pair(weights) -> list:
    cases = {f"B{B} L{L} D{D}{' weighted' if L == 100 else ''}": table_case(weights, B, L, D, weighted=L == 100)
             for D in (128, 32, 64, 256) for L in (48, 64, 100, 150, 300)
             for B in (128, 256, 512, 1024, 2048, 3072, 4096)}
    for F, B in ((4, 512), (2, 1024), (1, 2048), (8, 256)):
        w = Workload("c", "collection", 500_000, 128, B, 150, "powerlaw", 1.05, tables=F)
        kjt = make_batch(w, "cuda")
        ebc = make_collection(w, "cuda", data_type=weights[128].dtype, bounds_check="off")
        plan = ebc._plan(kjt.keys(), ebc.weights.device)
        args = (ebc.weights.detach(), kjt.values(), kjt.offsets(), None, plan.meta, B, plan.total_dim, plan.max_dim,
                plan.layout.vec)
        cases[f"collection F{F} B{B} L1-299"] = lambda cfg, args=args: collection_forward(*args, config=cfg)
    rows = []
    for label, fn in cases.items():
        ref, times = fn(None), {"one warp": [], "four warps": []}
        for _ in range(3):
            for name, cfg in (("one warp", ONE_WARP), ("four warps", FOUR_WARPS)):
                assert close(fn(cfg), ref)
                times[name].append(us(lambda: fn(cfg)))
        a, b = min(times["one warp"]), min(times["four warps"])
        print(f"{label}: one warp {a:.1f}, four warps {b:.1f} ({100 * (b / a - 1):+.0f}%)", flush=True)
        rows.append({"case": label, **times})
    return rows


def main(what: str = "pair", dtype: str = "float32"):
    print(torch.cuda.get_device_name(), dtype, flush=True)
    weights = {D: torch.randn(1_000_000, D, device="cuda", dtype=getattr(torch, dtype)) for D in (32, 64, 128, 256)}
    rows = {"grid": grid, "pair": pair}[what](weights)
    with open(os.path.join(os.environ.get("OUT", "."), f"sweep-few-bags-{what}-{dtype}.json"), "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
