"""One table's check (issue 18): the default-path row one table D128 B65536 L64, power-law 1.05,
default against `off` (do_bench medians, the middle of three) and the check kernel's own time
(profiler, 50 calls), with int64 and int32 ids. Optional arguments set tuning.IDS_CHECK_WARPS and
tuning.IDS_CHECK_BLOCK. Run it on two trees to compare them.

    PYTHONPATH=src python3 benchmarks/validation/ids_check.py [WARPS [BLOCK]]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops import tuning

warps = int(sys.argv[1]) if len(sys.argv) > 1 else None
if warps is not None:
    tuning.IDS_CHECK_WARPS = warps
if len(sys.argv) > 2:
    tuning.IDS_CHECK_BLOCK = int(sys.argv[2])
w = Workload("one table", "bag", 10_000_000, 128, 65536, 64, "powerlaw", 1.05)
table = torch.randn(w.rows, w.dim, device="cuda")
ids, offsets = generate_batch(w, "cuda")
assert offsets is None
for dt in (torch.int64, torch.int32):
    x = ids.to(dt)
    calls = {"default": lambda: embfuse.embedding_bag(x, table),
             "off": lambda: embfuse.embedding_bag(x, table, bounds_check="off")}
    with torch.no_grad():
        t = {k: [] for k in calls}
        for _ in range(3):
            for k, f in calls.items():
                t[k].append(do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                calls["default"]()
            torch.cuda.synchronize()
    chk = sum(e.device_time_total for e in prof.key_averages() if "check" in e.key) / 50
    d, o = sorted(t["default"])[1], sorted(t["off"])[1]
    nbytes = x.numel() * x.element_size()
    print(f"{dt}: default {d:.1f} us, off {o:.1f} (+{100 * (d / o - 1):.1f}%), check kernel {chk:.1f} us = "
          f"{nbytes / chk / 1e3:.0f} GB/s of ids", flush=True)
