"""The Criteo-like collection forward (26 tables x 128, bags of 1-99, power-law ids) kernel by
kernel: the default (check, then the pooling that reads its verdict), `off`, and `off` on int32
ids. Each line: the GPU time of each kernel a call (profiler, 20 calls, L2 cleared by other
traffic before each), three rounds; then each kernel variant's registers from Triton's cache.
Sessions 45-46 of benchmarks/NOTES.md (the status guard, the check's feature count).

    PYTHONPATH=src python3 benchmarks/validation/collection_kernels.py [batch ...]
"""

import sys

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops import collection, deferred


def per_kernel(call, flush, calls=20):
    """{kernel name: GPU time a call, us}, L2 cleared before each call."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.bitwise_not_()
            call()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "bitwise_not" not in e.name:
            times[e.name[:30]] = times.get(e.name[:30], 0.0) + e.device_time_total / calls
    return times


def main(batches):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU time a call, us")
    flush = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    for B in batches:
        w = Workload("c", "collection", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26, group="collection")
        kjt = make_batch(w, "cuda")
        kjt32 = embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values().int(), lengths=kjt.lengths(), stride=B,
                                          length_per_key=kjt.length_per_key())
        off, ebc = make_collection(w, "cuda", bounds_check="off"), make_collection(w, "cuda")
        calls = {"default": lambda: ebc(kjt).values(), "off": lambda: off(kjt).values(),
                 "off, int32 ids": lambda: off(kjt32).values()}
        with torch.no_grad():
            for rnd in range(3):
                for name, call in calls.items():
                    t = per_kernel(call, flush)
                    print(f"B{B} round {rnd} {name}: total {sum(t.values()):.1f} | "
                          + " | ".join(f"{k}: {v:.1f}" for k, v in sorted(t.items(), key=lambda x: -x[1])), flush=True)
        del off, ebc
    embfuse.check_errors()
    for kernel in (collection._collection_fwd_kernel, deferred._check_bags_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for key, compiled in caches[0].items():
                print(kernel.fn.__name__, "registers", compiled.n_regs, "spills", compiled.n_spills, str(key)[-120:])


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [2048, 16384])
