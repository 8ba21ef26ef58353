"""Sweep embedding_bag forward launch shapes on the GPU (one device call): which tile size,
warp count and cache policy the rule in embfuse.ops.tuning.bag_shape should pick.

    PYTHONPATH=src python3 benchmarks/lookup/sweep_bag.py OUT.json
"""

import itertools
import json
import sys

import torch
from triton.testing import do_bench

from embfuse.bench.runner import copy_bandwidth, count_bytes
from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops.bags import SUM
from embfuse.ops.embedding_bag import embedding_bag_forward, embedding_bag_reference


ELEMS = (256, 512, 1024, 2048, 4096, 8192)
WARPS = (1, 2, 4, 8)


def default_us(rows, dim, dtype, dist) -> float:
    """The latest time of the default config (1024 elements, 2 warps, no eviction hint) for one case."""
    return next(r["us"] for r in rows[::-1] if r["elems"] == 1024 and r["num_warps"] == 2 and not r["evict"]
                and (r["dim"], r["dtype"], r["dist"]) == (dim, dtype, dist))


def main(path):
    bw = copy_bandwidth("cuda")
    rows = []
    for dim, dtype, (dist, alpha) in itertools.product((32, 128), ("float32", "float16"),
                                                       (("uniform", 0.0), ("powerlaw", 1.05))):
        w = Workload("sweep", "bag", 10_000_000, dim, 65536, 64, dist, alpha, dtype=dtype)
        table = torch.randn(w.rows, dim, device="cuda").to(w.torch_dtype)
        ids, _ = generate_batch(w, "cuda")
        flat = ids.reshape(-1)
        offsets = torch.arange(0, flat.numel() + 1, 64, device="cuda")
        roof = count_bytes(w, ids, None)["min_bytes"] / bw * 1e6
        ref = embedding_bag_reference(table, flat[:64 * 512], offsets[:513], None, SUM, -1)[0].float()
        for elems, warps, evict in itertools.product(ELEMS, WARPS, ("", "evict_last")):
            cfg = {"elems": elems, "num_warps": warps, "evict": evict}
            out = embedding_bag_forward(table, flat, offsets, None, SUM, -1, cfg)[0]
            ok = torch.allclose(out[:512].float(), ref, rtol=1e-2, atol=1e-2)
            us = do_bench(lambda: embedding_bag_forward(table, flat, offsets, None, SUM, -1, cfg),
                          warmup=10, rep=50, return_mode="median") * 1e3
            rows.append({"dim": dim, "dtype": dtype, "dist": dist, **cfg, "us": us, "roofline_us": roof, "ok": ok})
        best = min((r for r in rows if r["dim"] == dim and r["dtype"] == dtype and r["dist"] == dist),
                   key=lambda r: r["us"])
        print(f"D{dim} {dtype} {dist}: best {best['us']:.1f} us ({100 * roof / best['us']:.0f}% roofline) with "
              f"elems={best['elems']} warps={best['num_warps']} evict={best['evict'] or '-'}; "
              f"default {default_us(rows, dim, dtype, dist):.1f} us",
              flush=True)
        del table
        torch.cuda.empty_cache()
    json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": rows}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
