"""The floor of a forward that tells hot rows from cold ones by a lookup (benchmarks/NOTES.md,
session 9): the collection forward kernel's loop, copied, with each value's slot read from the
hot-row map (4 bytes a value) and the hot values then skipped, as a dense path for them would
skip them. Whatever a dense product for the hot rows then costs comes on top. Against the
library's forward and the same copy without the lookup, on the Criteo collection (us, medians
of CUDA-event timings; the hot set, K rows a table, from another batch).

    PYTHONPATH=src python3 benchmarks/forward_lookup.py [batch]
"""

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload


@triton.jit
def _forward_kernel(weights, values, offsets, meta, slot_of, out, B, stride_o, stride_m, LOOKUP: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    f = g // B
    D = tl.multiple_of(tl.load(meta + f * stride_m + 1), VEC)
    start = tl.load(offsets + g).to(tl.int64)
    end = tl.load(offsets + g + 1).to(tl.int64)
    table = weights + tl.multiple_of(tl.load(meta + f * stride_m), VEC)
    col = tl.multiple_of(tl.load(meta + f * stride_m + 2), VEC)
    row0 = tl.load(meta + f * stride_m + 4)
    cols = tl.arange(0, BLOCK_D)
    cmask = (cols // VEC) < (D // VEC)
    lane = tl.arange(0, BLOCK_L)
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for s in range(start, end, BLOCK_L):
        pos = s + lane
        lmask = pos < end
        ids = tl.load(values + pos, mask=lmask, other=0).to(tl.int64)
        if LOOKUP:
            lmask = lmask & (tl.load(slot_of + row0 + ids, mask=lmask, other=0) < 0)
        acc += tl.load(table + ids[:, None] * D + cols[None, :], mask=lmask[:, None] & cmask[None, :], other=0.0)
    tl.store(out + (g - f * B) * stride_o + col + cols, tl.sum(acc, axis=0), mask=cmask)


B = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
w = Workload("c", "collection-train", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
values, offsets = kjt.values(), kjt.offsets()
out = torch.empty(B, w.dim * w.tables, device="cuda")
for K in (64, 256):
    ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01), hot_rows=K)
    plan = ebc._plan(kjt.keys(), "cuda")
    weights, slot = ebc.weights.detach(), ebc.hot_slot
    hot = (slot[plan.meta[:, 4][torch.repeat_interleave(torch.arange(w.tables * B, device="cuda") // B,
                                                         offsets.diff())] + values] >= 0).float().mean().item()

    def copy(lookup):
        _forward_kernel[(w.tables * B,)](weights, values, offsets, plan.meta, slot, out, B, out.stride(0),
                                         plan.meta.stride(0), LOOKUP=lookup, BLOCK_L=2, BLOCK_D=128, VEC=4,
                                         num_warps=1)

    with torch.no_grad():
        times = [do_bench(fn, warmup=3, rep=200, return_mode="median") * 1e3
                 for fn in (lambda: ebc(kjt), lambda: copy(False), lambda: copy(True))]
    print(f"B{B} K{K} (hot values {hot:.1%}): library forward {times[0]:.0f} us, its loop copied {times[1]:.0f} us, "
          f"with the lookup and the hot values skipped {times[2]:.0f} us", flush=True)
    ebc = weights = slot = None
    torch.cuda.empty_cache()
