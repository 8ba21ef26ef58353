"""Few long bags with 2-byte tables through the public call (tuning.spreads; benchmarks/NOTES.md,
session 39): `embfuse.nn.EmbeddingBag` with its default check, fp32, bf16 and fp16, D128/D256, B256-1024
x L64-150 (L100 weighted), power-law ids over 1M rows. GPU time alone (residency/gpu_time.py: the
L2 flushed, the host's enqueue hidden), eager and CUDA-graph replay; for D128 B1024 L64 the eager
kernels' own times from the profiler. Run it once per tree to compare two rules.

    PYTHONPATH=src python3 benchmarks/lookup/few_bags_public.py
"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import embfuse
from embfuse.bench.workloads import Workload, generate_ids

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "residency"))
from gpu_time import captured, gpu_us  # noqa: E402

CASES = ((128, 256, 64, False), (128, 512, 64, False), (128, 1024, 64, False), (128, 1024, 150, False),
         (128, 512, 100, True), (128, 1024, 100, True), (256, 1024, 64, False))
PROFILED = (128, 1024, 64, False)


def kernel_times(f, flush) -> str:
    """Median device time of each kernel of 20 eager calls (the L2 flushed before each)."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            flush.zero_()
            f()
        torch.cuda.synchronize()
    times = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            times.setdefault(e.name[:50], []).append(e.device_time)
    return ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f} x{len(v)}" for k, v in times.items())


def main():
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    print(torch.cuda.get_device_name(), embfuse.__file__)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D, B, L, weighted in CASES:
            g = torch.Generator(device="cuda").manual_seed(0)
            bag = embfuse.nn.EmbeddingBag(1_000_000, D, mode="sum", device="cuda", dtype=dtype)
            ids = generate_ids(Workload("t", "bag", 1_000_000, D, B, L, "powerlaw", 1.05), B * L, "cuda", g).view(B, L)
            psw = torch.rand(B, L, device="cuda", generator=g).to(dtype) if weighted else None
            with torch.no_grad():
                def f():
                    return bag(ids, per_sample_weights=psw)
                f()
                name = f"{str(dtype)[6:]} D{D} B{B} L{L}{' weighted' if weighted else ''}"
                eager, replay = gpu_us(f, flush), gpu_us(captured(f), flush)
                print(f"{name}: eager {eager:.1f} us, replay {replay:.1f} us", flush=True)
                if (D, B, L, weighted) == PROFILED:
                    print(f"{name} eager kernels (us): {kernel_times(f, flush)}", flush=True)
            del bag
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
