"""A prototype, kept to be measured again: the Criteo collection step's backward with a dense
path for each table's K hottest rows (benchmarks/NOTES.md, session 8). Not the library's path.

Hot values (their row in a hot set taken from the batch itself, outside the timing) get key -1,
which the sparse path skips, and add 1 to C[f, b, slot] (fp32 atomics of integers: exact, so the
order does not matter). A GEMM kernel takes partial sums over bag splits,
P[f, s, k, :] = sum over b in split s of C[f, b, k] * grad[b, col_f:col_f + D], as three tf32
products of an exact split of grad (C is exact below 2048). The partials then go through
fused_update with the hot rows' keys like any other entries. Prints the largest difference to
the sparse path's update, both backwards' times and the dense one's kernels.

    PYTHONPATH=src python3 benchmarks/hot_rows_proto.py [batch [K [splits]]]
"""
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

DEV = os.environ.get("DEV", "cuda")
ROWS = int(os.environ.get("ROWS", 10_000_000))

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops.collection import backward_inputs
from embfuse.optim.fused import fused_update


@triton.jit
def _hot_inputs_kernel(values, offsets, meta, hot_map, keys, bag_out, counts, FB, B, stride_m,
                       K: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    real = g < FB
    f = g // B
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    key0 = tl.load(meta + f * stride_m + 6, mask=real, other=0)
    row0 = tl.load(meta + f * stride_m + 4, mask=real, other=0)
    for i in range(0, tl.max(end - start), BLOCK):
        p = start[:, None] + i + tl.arange(0, BLOCK)[None, :]
        m = p < end[:, None]
        v = tl.load(values + p, mask=m, other=0)
        slot = tl.load(hot_map + row0[:, None] + v, mask=m, other=-1)
        hot = slot >= 0
        tl.store(keys + p, tl.where(hot, -1, key0[:, None] + v).to(keys.dtype.element_ty), mask=m)
        tl.store(bag_out + p, (g[:, None] + 0 * p).to(bag_out.dtype.element_ty), mask=m)
        tl.atomic_add(counts + g[:, None] * K + slot, 1.0 + 0.0 * p.to(tl.float32), mask=m & hot, sem="relaxed")


@triton.jit
def _split(x):
    """The top 11 significant bits of x (what a tf32 product reads) and the rest, exactly."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _hot_grad_kernel(counts, grad, stride_g, meta, partial, B, stride_m, BAGS_PER: tl.constexpr,
                     K: tl.constexpr, BB: tl.constexpr, BLOCK_D: tl.constexpr):
    f = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    D = tl.load(meta + f * stride_m + 1)
    col = tl.load(meta + f * stride_m + 2)
    cols = tl.arange(0, BLOCK_D)
    ks = tl.arange(0, K)
    acc = tl.zeros([K, BLOCK_D], dtype=tl.float32)
    for b0 in range(0, BAGS_PER, BB):
        b = s * BAGS_PER + b0 + tl.arange(0, BB)
        inb = (b < B) & (b0 + tl.arange(0, BB) < BAGS_PER)
        c = tl.load(counts + (f * B + b)[:, None] * K + ks[None, :], mask=inb[:, None], other=0.0)
        x = tl.load(grad + b[:, None] * stride_g + col + cols[None, :], mask=inb[:, None] & (cols < D)[None, :],
                    other=0.0)
        ct = tl.trans(c)
        hi, r = _split(x)
        mid, lo = _split(r)
        acc = tl.dot(ct, lo, acc, input_precision="tf32")
        acc = tl.dot(ct, mid, acc, input_precision="tf32")
        acc = tl.dot(ct, hi, acc, input_precision="tf32")
    n_s = tl.num_programs(1)
    tl.store(partial + ((f * n_s + s) * K + ks)[:, None] * BLOCK_D + cols[None, :], acc)


def main():
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    K = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    SPLITS = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    w = Workload("c", "collection-train", ROWS, 128, B, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, DEV)
    F, D = w.tables, w.dim
    ebc = make_collection(w, DEV, embfuse.optim.SGD(lr=0.01))
    plan = ebc._plan(kjt.keys(), DEV)
    values, offsets = kjt.values(), kjt.offsets()
    weights, sgd = ebc.weights.detach(), embfuse.optim.SGD(lr=0.01)
    grad = torch.randn(B, F * D, device=DEV)
    # hot sets from this batch (the prototype's stand-in for a refreshed one)
    keys0, _, _ = backward_inputs(values, offsets, None, plan.meta, B, plan.layout.wide_keys, plan.mean)
    uniq, cnt = torch.unique(keys0.long(), return_counts=True)
    table = uniq >> plan.layout.shift
    hot_keys = torch.full((F, K), -1, dtype=torch.int64, device=DEV)
    hot_map = torch.full((plan.num_rows,), -1, dtype=torch.int32, device=DEV)
    meta = plan.meta
    for t in range(F):
        sel = table == t
        top = uniq[sel][torch.topk(cnt[sel], min(K, int(sel.sum()))).indices].sort().values
        hot_keys[t, :top.numel()] = top
        rows = meta[t, 4] + (top - meta[t, 6])
        hot_map[rows] = torch.arange(top.numel(), dtype=torch.int32, device=DEV)
    entry_keys = hot_keys[:, None, :].expand(F, SPLITS, K).reshape(-1).int()
    hot_meta = plan.src_meta.clone()
    hot_meta[:, 0] = torch.arange(F, device=DEV) * SPLITS * K * D
    n, FB = values.numel(), F * B
    bags_per = -(-B // SPLITS)

    def dense_backward(grad):
        keys = torch.empty(n, dtype=torch.int32, device=DEV)
        bag = torch.empty(n, dtype=torch.int32, device=DEV)
        counts = torch.zeros(FB * K, dtype=torch.float32, device=DEV)
        _hot_inputs_kernel[(triton.cdiv(FB, 8),)](values, offsets, meta, hot_map, keys, bag, counts, FB, B,
                                                 meta.stride(0), K=K, BAGS=8, BLOCK=32)
        fused_update(weights, [], sgd, keys, plan.layout, grad, 1, src_row=bag, scale=None,
                     src_stride=grad.stride(0), src_bags=B, src_meta=plan.src_meta)
        partial = torch.empty(F * SPLITS * K, D, device=DEV)
        _hot_grad_kernel[(F, SPLITS)](counts, grad, grad.stride(0), meta, partial, B, meta.stride(0),
                                      BAGS_PER=bags_per, K=K, BB=64 if K <= 64 else 32, BLOCK_D=D,
                                      num_warps=4 if K <= 64 else 8, num_stages=2)
        fused_update(weights, [], sgd, entry_keys, plan.layout, partial, 1, src_row=None, scale=None,
                     src_stride=D, src_bags=SPLITS * K, src_meta=hot_meta)

    def sparse_backward(grad):
        keys, bag, _ = backward_inputs(values, offsets, None, plan.meta, B, plan.layout.wide_keys, plan.mean)
        fused_update(weights, [], sgd, keys, plan.layout, grad, 1, src_row=bag, scale=None,
                     src_stride=grad.stride(0), src_bags=B, src_meta=plan.src_meta)

    # correctness: one update each from the same weights, on the rows either path touched
    touched = torch.zeros(weights.numel() // 1, dtype=torch.bool, device=DEV)
    w0 = weights.clone()
    sparse_backward(grad)
    touched |= weights != w0
    sparse_delta = (weights - w0)[touched]
    weights.copy_(w0)
    dense_backward(grad)
    dense_delta = (weights - w0)[touched]
    same = torch.equal((weights != w0), touched)
    del w0
    diff = (dense_delta - sparse_delta).abs().max().item()
    print(f"B{B} K{K} splits{SPLITS}: max |dense - sparse| {diff:.3g} (largest update "
          f"{sparse_delta.abs().max().item():.3g}); rows changed alike: {same}", flush=True)
    del touched, sparse_delta, dense_delta
    for name, fn in (("sparse", sparse_backward), ("dense+sparse", dense_backward)):
        t = do_bench(lambda: fn(grad), warmup=3, rep=300, return_mode="median") * 1e3
        step = do_bench(lambda: (ebc(kjt).values(), fn(grad)), warmup=3, rep=300, return_mode="median") * 1e3
        print(f"  {name}: backward {t:.0f} us, forward + backward {step:.0f} us", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dense_backward(grad)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 20:
            print(f"    {e.device_time_total:9.0f} us  {e.key[:70]}")


main()
