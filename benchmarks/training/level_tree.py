"""The fused training step of the Criteo-like collection (26 tables x 128, power-law ids, bags of
1-99, fused SGD, checked by default and `off`) at B2048 and B16384, with the reduction's levels
split out: per step, do_bench's median, the host's time to enqueue (best of three runs of 100
steps), the GPU's busy time, the fused-update kernel of level 1 and that of every later level
(the profiler over 10 steps), and the update launches. The argument tags the printed lines
(a variant being compared: run it once per source tree, alternating).

    PYTHONPATH=src python3 benchmarks/training/level_tree.py TAG
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import COLLECTION_PROVIDERS, make_batch
from embfuse.bench.workloads import Workload

tag = sys.argv[1]
for B in (2048, 16384):
    w = Workload("c", "collection-train", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    grad = torch.randn(B, 128 * 26, device="cuda")
    for name in ("embfuse", "embfuse-off"):
        forward, _, _, _keep = COLLECTION_PROVIDERS[name](w, kjt, "cuda", True)

        def step():
            forward(kjt).backward(grad)

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        bench = do_bench(step, warmup=3, rep=300, return_mode="median") * 1e3
        host = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(100):
                step()
            host.append((time.perf_counter() - t0) * 1e4)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        busy = sum(e.device_time for e in kernels) / 10
        updates = [e for e in kernels if e.name == "_fused_update_kernel"]
        per_step = len(updates) // 10
        first = sum(e.device_time for e in updates[::per_step]) / 10
        later = sum(e.device_time for e in updates) / 10 - first
        print(f"{tag} B{B} {name:12s} do_bench {bench:6.0f}  host {min(host):5.0f}  GPU busy {busy:6.0f}  "
              f"level 1 {first:6.1f}  later levels {later:5.1f} in {per_step - 1} launch(es)", flush=True)
embfuse.check_errors()
