"""The check's floor by id width (issue 18): the Criteo-like collection forward (26 tables, B16384,
bags 1-99, power-law ids) with the deferred check and without, its ids as int64 and as int32, the
check kernel's own time (profiler) and the copy rate in the same run. One device call:

    PYTHONPATH=src python3 benchmarks/validation/id_width.py
"""
import torch
from triton.testing import do_bench
import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

dev = "cuda"
w = Workload("c", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26, group="collection")
kjt = make_batch(w, dev, seed=0)
ebcs = {m: make_collection(w, dev, bounds_check=m) for m in ("deferred", "off")}
x = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
copy_us = do_bench(lambda: x.clone(), warmup=10, rep=100, return_mode="median") * 1e3
print(f"copy of 256 MiB: {copy_us:.1f} us = {2 * x.numel() / copy_us / 1e6:.2f} TB/s (read + write)")
for dtype in (torch.int64, torch.int32):
    k = embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values().to(dtype), lengths=kjt.lengths().to(dtype),
                                  stride=kjt.stride(), length_per_key=kjt.length_per_key())
    with torch.no_grad():
        t = {m: do_bench(lambda e=e: e(k).values(), warmup=20, rep=200, return_mode="median") * 1e3
             for m, e in ebcs.items()}
        t2 = {m: do_bench(lambda e=e: e(k).values(), warmup=20, rep=200, return_mode="median") * 1e3
              for m, e in ebcs.items()}
    ids_mb = k.values().numel() * k.values().element_size() / 1e6
    print(f"{dtype}: ids {ids_mb:.1f} MB; deferred {t['deferred']:.1f} / {t2['deferred']:.1f} us, off {t['off']:.1f} / "
          f"{t2['off']:.1f} us: +{100 * (min(t['deferred'], t2['deferred']) / min(t['off'], t2['off']) - 1):.1f}%",
          flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            for _ in range(5):
                ebcs["deferred"](k).values()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if "check" in e.key:
            print(f"  {e.key}: {e.device_time_total / e.count:.1f} us a call", flush=True)
embfuse.check_errors()
