"""The hot-row path of the collection step (embfuse/optim/hot.py) on the Criteo collection:
steps with K hot rows a table against the sparse step, in one process (us, medians of CUDA-event
timings); at B65536 the largest difference of one update from the sparse one, the kernels of a
hot backward, and the bags a product program takes. The hot set comes from another batch
(make_collection), as in training.

    PYTHONPATH=src python3 benchmarks/hot_rows/hot_rows.py [batch ...]
    (env KS="0 32 64", DETAIL="32 64", OPT=sgd|rowwise|adagrad|adam)
"""

import os
import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops import tuning

batches = [int(b) for b in sys.argv[1:]] or [16384, 65536]
OPTIMIZERS = {"sgd": embfuse.optim.SGD(lr=0.01), "rowwise": embfuse.optim.RowWiseAdagrad(lr=0.01),
              "adagrad": embfuse.optim.Adagrad(lr=0.01), "adam": embfuse.optim.Adam(lr=0.01)}
OPT = os.environ.get("OPT", "sgd")  # the accuracy check below assumes SGD


def max_abs(a, b, chunk=2**28):
    return max((a[i:i + chunk] - b[i:i + chunk]).abs().max().item() for i in range(0, a.numel(), chunk))


def step_us(ebc, kjt, grad):
    step = lambda: ebc(kjt).values().backward(grad)  # noqa: E731
    step()
    return do_bench(step, warmup=3, rep=200, return_mode="median") * 1e3


for B in batches:
    w = Workload("c", "collection-train", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    grad = torch.randn(B, w.dim * w.tables, device="cuda")
    for K in [int(k) for k in os.environ.get("KS", "0 32 64 128 256").split()]:
        ebc = make_collection(w, "cuda", OPTIMIZERS[OPT], hot_rows=K)
        print(f"B{B} K{K} {OPT}: step {step_us(ebc, kjt, grad):.0f} us", flush=True)
        if B == batches[-1] and str(K) in os.environ.get("DETAIL", "64").split():
            for per in (512, 2048, tuning.BAGS_PER_SPLIT):
                tuning.BAGS_PER_SPLIT = per
                print(f"  {per} bags a product program: step {step_us(ebc, kjt, grad):.0f} us", flush=True)
            chosen = tuning.product_shape
            for kb, bb, warps in ((32, 32, 4), (32, 64, 8), (32, 64, 4), (16, 32, 4), (16, 64, 4), (64, 32, 4),
                                  (32, 32, 8)):
                tuning.product_shape = lambda K: dict(KB=min(K, kb), BB=bb, num_warps=warps, num_stages=2)  # noqa
                print(f"  product {kb} slots x {bb} bags, {warps} warps: step {step_us(ebc, kjt, grad):.0f} us",
                      flush=True)
            tuning.product_shape = chosen
            chosen = tuning.BAG_PASS_SHAPE
            for shape in ((4, 32), (16, 32), (4, 64), (8, 64), (16, 16), chosen):
                tuning.BAG_PASS_SHAPE = shape
                print(f"  passes {shape[0]} bags x {shape[1]} values: step {step_us(ebc, kjt, grad):.0f} us",
                      flush=True)
            # one update from the same weights by each path
            w0 = ebc.weights.detach().clone()
            ebc(kjt).values().backward(grad)
            hot_w = ebc.weights.detach().clone()
            ebc.weights.data.copy_(w0)
            ebc._hot = None
            ebc(kjt).values().backward(grad)
            print(f"  max |hot - sparse| {max_abs(hot_w, ebc.weights.detach()):.3g}, largest update "
                  f"{max_abs(w0, ebc.weights.detach()):.3g}", flush=True)
            # against float64 on table 8 (3 rows: every value of its feature is hot)
            jt, lo = kjt.to_dict()["f8"], ebc._starts[8]
            bag = torch.repeat_interleave(torch.arange(B, device="cuda"), jt.lengths())
            g = torch.zeros(3, w.dim, dtype=torch.float64, device="cuda").index_add_(
                0, jt.values().long(), grad[bag, 8 * w.dim:9 * w.dim].double())
            exact = w0[lo:lo + 3 * w.dim].double() - 0.01 * g.reshape(-1)
            for name, got in (("hot", hot_w), ("sparse", ebc.weights.detach())):
                err = (got[lo:lo + 3 * w.dim].double() - exact).abs().max().item()
                print(f"  table 8 (3 rows), {name} path: max error {err:.3g} against float64, update "
                      f"{(0.01 * g).abs().max().item():.3g}", flush=True)
            del w0, hot_w
            ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01), hot_rows=K)
            from torch.profiler import ProfilerActivity, profile
            out = ebc(kjt).values()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out.backward(grad)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.device_time_total > 20:
                    print(f"    {e.device_time_total:9.0f} us  {e.key[:70]}", flush=True)
        ebc = None
        torch.cuda.empty_cache()
