"""How fast can a collection's check read its values? The default-path collection row (26
Criteo-like tables x 128, B16384, bags of 1-99, power-law ids: about 21M int64 values), as
ids_read_floor.py does for one table. Kernel times (profiler, 20 calls), L2 flushed before each
call and not: torch's amax, a bare Triton read with the check's program shape (CHUNKS blocks of
CHECK_BLOCK values a program, CHECK_WARPS warps, a block max and one atomic a program) and the
check kernel inside a default collection forward, beside that forward's pooling kernel.

    PYTHONPATH=src python3 benchmarks/validation/values_read_floor.py
"""

import torch
import triton
import triton.language as tl

from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops import tuning


@triton.jit
def _max_kernel(x, n, out, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (CHUNKS * BLOCK)
    lanes = tl.arange(0, BLOCK)
    m = tl.zeros([BLOCK], dtype=x.dtype.element_ty)
    for c in range(CHUNKS):
        first = start + c * BLOCK
        v = tl.load(x + first + lanes, mask=lanes < tl.maximum(tl.minimum(n - first, BLOCK), 0).to(tl.int32), other=0)
        m = tl.maximum(m, v)
    top = tl.max(m)
    tl.atomic_max(out, top, mask=top > 1 << 40)


w = Workload("collection", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
values = kjt.values()
n = values.numel()
ebc = make_collection(w, "cuda")
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
out = torch.zeros(1, dtype=torch.int64, device="cuda")
block, chunks = tuning.CHECK_BLOCK, tuning.check_chunks(n)
grid = (triton.cdiv(n, block * chunks),)
cases = {
    "torch amax": lambda: values.amax(),
    "triton read, the check's shape": lambda: _max_kernel[grid](values, n, out, BLOCK=block, CHUNKS=chunks,
                                                               num_warps=tuning.CHECK_WARPS),
    "default collection forward": lambda: ebc(kjt),
}
print(f"values {n} ({n * 8 / 1e6:.1f} MB), offsets {kjt.lengths().numel() + 1}, chunks {chunks}, programs {grid[0]}")
with torch.no_grad():
    for flushed in (True, False):
        for name, f in cases.items():
            for _ in range(5):
                f()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    if flushed:
                        flush.zero_()
                    f()
                torch.cuda.synchronize()
            times = {e.key[:40]: round(e.device_time_total / 20, 1) for e in prof.key_averages()
                     if e.device_time_total > 0 and "fill" not in e.key and "elementwise" not in e.key}
            print("flushed" if flushed else "in a loop", "|", name, times, flush=True)
