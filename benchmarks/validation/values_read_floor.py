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
def read_max_kernel(x, n, out, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """A bare read of x: CHUNKS blocks of BLOCK entries a program, their max, one atomic a program
    (never taken for ids: the mask asks for a value no table has)."""
    start = tl.program_id(0).to(tl.int64) * (CHUNKS * BLOCK)
    lanes = tl.arange(0, BLOCK)
    m = tl.zeros([BLOCK], dtype=x.dtype.element_ty)
    for c in range(CHUNKS):
        first = start + c * BLOCK
        v = tl.load(x + first + lanes, mask=lanes < tl.maximum(tl.minimum(n - first, BLOCK), 0).to(tl.int32), other=0)
        m = tl.maximum(m, v)
    top = tl.max(m)
    tl.atomic_max(out, top, mask=top > 1 << 40)


def kernel_times(f, calls: int, flushed: bool, flush: torch.Tensor, drop=("fill", "elementwise")) -> dict:
    """Profiler kernel times a call of f (us), the L2 emptied before each call if `flushed`;
    kernels whose names hold a word of `drop` (the flush's own) left out."""
    for _ in range(5):
        f()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if flushed:
                flush.zero_()
            f()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / calls, 1) for e in prof.key_averages()
            if e.device_time_total > 0 and not any(d in e.key for d in drop)}


def main():
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
        "triton read, the check's shape": lambda: read_max_kernel[grid](
            values, n, out, BLOCK=block, CHUNKS=chunks, num_warps=tuning.CHECK_WARPS),
        "default collection forward": lambda: ebc(kjt),
    }
    print(f"values {n} ({n * 8 / 1e6:.1f} MB), offsets {kjt.lengths().numel() + 1}, chunks {chunks}, "
          f"programs {grid[0]}")
    with torch.no_grad():
        for flushed in (True, False):
            for name, f in cases.items():
                times = kernel_times(f, 20, flushed, flush)
                print("flushed" if flushed else "in a loop", "|", name, times, flush=True)


if __name__ == "__main__":
    main()
