"""What the library's pooling loop pays over a minimal one, by feature (one table, sum, fp32).

A minimal probe kernel (one warp a bag, 256-element tiles, as tuning.bag_shape) pooled one
table's D128 power-law batch at 241 us where the library's lookup took 282
(benchmarks/residency/l1_hot_rows.py). This adds the library's features one at a time:
  fixed     the bag length a constant (L), no masks;
  runtime   the bag's [start, end) from runtime arguments (b * n, + n), no masks;
  offsets   start and end read from the offsets, rows masked by pos < end;
  width     + the runtime width (a column mask, the row stride an argument);
  tail      offsets, full tiles unmasked and one masked tail;
  tail+w    tail with the runtime width;
  unroll U  offsets, U masked tiles a step (a constant inner loop), U = 2, 4;
and the library's own lookup (`embedding_bag_forward`, checks off) on the same batch.
B65536 x L64, 10M rows, D128 and D32, power-law 1.05 (hashed, the bench's) and uniform ids, and
CSR bags of 0-128 power-law ids (the variants that assume one length left out).
Kernel times (do_bench, L2 flushed), two rounds. Registers from the compiled kernel.
Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/lookup/pool_loop.py
"""

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops.embedding_bag import embedding_bag_forward

VARIANTS = ("fixed", "runtime", "offsets", "width", "tail", "tail+w", "unroll 2", "unroll 4")


@triton.jit
def _pool(weight, ids_ptr, offsets, out, n_per, d, stride_w, L: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_L: tl.constexpr, V: tl.constexpr, U: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    if V >= 2:  # the bag from the offsets
        start = tl.load(offsets + b)
        end = tl.load(offsets + b + 1)
    cmask = cols < BLOCK_D
    stride = BLOCK_D
    if V == 3 or V == 5:  # the runtime width
        cmask = cols < d
        stride = stride_w
    if V == 0:  # fixed
        for s in range(0, L, BLOCK_L):
            ids = tl.load(ids_ptr + b * L + s + lane)
            acc += tl.load(weight + ids[:, None] * BLOCK_D + cols[None, :])
    elif V == 1:  # runtime
        start = b * n_per
        for s in range(start, start + n_per, BLOCK_L):
            ids = tl.load(ids_ptr + s + lane)
            acc += tl.load(weight + ids[:, None] * BLOCK_D + cols[None, :])
    elif V == 2 or V == 3:  # offsets (+ width)
        for s in range(start, end, BLOCK_L):
            pos = s + lane
            lmask = pos < end
            ids = tl.load(ids_ptr + pos, mask=lmask, other=0)
            acc += tl.load(weight + ids[:, None] * stride + cols[None, :], mask=lmask[:, None] & cmask[None, :],
                           other=0.0)
    elif V >= 6:  # unroll U
        for s in range(start, end, BLOCK_L * U):
            for u in tl.static_range(U):
                pos = s + u * BLOCK_L + lane
                lmask = pos < end
                ids = tl.load(ids_ptr + pos, mask=lmask, other=0)
                acc += tl.load(weight + ids[:, None] * BLOCK_D + cols[None, :], mask=lmask[:, None], other=0.0)
    else:  # tail (+ width)
        full = start + (end - start) // BLOCK_L * BLOCK_L
        for s in range(start, full, BLOCK_L):
            ids = tl.load(ids_ptr + s + lane)
            if V == 5:
                acc += tl.load(weight + ids[:, None] * stride + cols[None, :], mask=cmask[None, :], other=0.0)
            else:
                acc += tl.load(weight + ids[:, None] * stride + cols[None, :])
        pos = full + lane
        lmask = pos < end
        ids = tl.load(ids_ptr + pos, mask=lmask, other=0)
        acc += tl.load(weight + ids[:, None] * stride + cols[None, :], mask=lmask[:, None] & cmask[None, :], other=0.0)
    tl.store(out + b * BLOCK_D + cols, tl.sum(acc, axis=0))


CASES = (("powerlaw", "fixed"), ("uniform", "fixed"), ("powerlaw", "csr"))


def us(fn):
    return do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3


def measure(D, dist, layout="fixed", dev="cuda", rows=10_000_000, B=65536, L=64):
    w = Workload("p", "bag", rows, D, B, L, dist, 1.05, layout=layout)
    ids, offsets = generate_batch(w, dev, 0)
    ids = ids.reshape(-1)
    if offsets is None:
        offsets = torch.arange(0, ids.numel() + 1, L, device=dev)
    # (bags of 0-128 ids: the variants that assume one length are left out)
    variants = range(len(VARIANTS)) if layout == "fixed" else range(2, len(VARIANTS))
    weight = torch.randn(rows, D, device=dev)
    out = torch.empty(B, D, device=dev)
    ref = embedding_bag_forward(weight, ids, offsets, None, 0, -1)[0]
    regs = {}

    def probe(v):
        k = _pool[(B,)](weight, ids, offsets, out, L, D, D, L=L, BLOCK_D=D, BLOCK_L=max(1, 256 // D), V=v,
                        U=(1, 1, 1, 1, 1, 1, 2, 4)[v], num_warps=1)
        regs[v] = k.n_regs
        return out

    times = {name: [] for name in ("library",) + tuple(VARIANTS[v] for v in variants)}
    for v in variants:
        torch.testing.assert_close(probe(v), ref, rtol=1e-5, atol=1e-4)
    for _ in range(2):
        times["library"].append(us(lambda: embedding_bag_forward(weight, ids, offsets, None, 0, -1)))
        for v in variants:
            times[VARIANTS[v]].append(us(lambda v=v: probe(v)))
    cells = "  ".join(f"{k} {min(t):.1f}" + (f" ({regs[VARIANTS.index(k)]} r)" if k in VARIANTS else "")
                      for k, t in times.items())
    spread = max(abs(t[0] - t[1]) for t in times.values())
    return f"D{D} {dist} {layout}: {cells}  (rounds differ by at most {spread:.1f} us)"


def main(dists=None):
    cases = CASES if not dists else [(d, "fixed") for d in dists]
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    for D in (128, 32):
        for dist, layout in cases:
            print(measure(D, dist, layout), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
