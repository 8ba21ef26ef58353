"""A dense path for each table's hottest rows in a collection's fused training step.

Under power-law ids most values of a batch fall on a few rows of each table, and the sparse
backward gathers the bag's gradient row for every one of them (most of the Criteo step's time
at B65536; benchmarks/NOTES.md, session 8). For feature f and its table's K hot rows the same
gradient is a matrix product,

    hot_grad_f[k, :] = sum over bags b of C_f[b, k] * scale_f[b] * grad[b, col_f : col_f + D_f]

C_f[b, k] = the times bag b holds hot row k, which reads each gradient row once. The step:
1. `_hot_split_kernel`, a pass over the values: a hot value adds 1 to C[f, b, slot] (fp32
   atomics of integers: exact, so the order does not matter) and gets key -1; a cold one its
   sort key. Each bag's count of cold values is written.
2. One host read (the cold total) and the shared backward-inputs kernel (ops/bags.py, its COLD
   form) packs the cold values' (key, bag, scale) in value order: the sparse path's sort and
   levels then see the cold values only.
3. `_hot_grad_kernel`: C^T @ grad over splits of the bags, in three tf32 products of an exact
   split of each (scaled) gradient element; C is exact in tf32 while every count is at most
   2048, which HOT_CAP guarantees (positions of a bag past it are cold). A split's entry for a
   hot row no bag of it holds gets key -1.
4. The cold entries, then the partial sums of the hot rows the batch touched, go through
   fused_update: every row is updated once, by every optimizer, deterministically.

The hot set is the K most looked-up rows of each table in one batch, taken again every
`refresh` steps (one torch.unique over the batch: a host read). Which rows are hot changes the
speed only, never the update. The host reads keep this path out of CUDA graphs: a step being
captured takes the sparse path, as do batches under `min_values` values (tuning.HOT_MIN_VALUES) and
weighted ones: per-sample weights do not fold into C (EmbeddingBagCollection refuses hot_rows
when is_weighted).
"""

from __future__ import annotations

import torch

from embfuse import _handles
from embfuse._triton import cdiv, launch, next_pow2, tl, triton
from embfuse.ops.bags import (K_DIM, K_KEY_START, K_OUT_COL, K_POOL, K_ROW_START, ROW_START, backward_inputs,
                              bag_of_value, bag_scale, program_bags)
from embfuse.ops.collection import ranked_rows
from embfuse.ops import tuning
from embfuse.optim.fused import fused_update

# a bag's positions from this one on are cold, so that a count of C never passes 2048 (tf32
# holds integers exactly up to 2^11)
HOT_CAP = 2048


class HotRows(_handles.Named):
    """The hot set of a collection's tables: `slot[r]` the slot (0..k-1) of global row r in
    its table's hot set, or -1; `keys[t, s]` the sort key (see Layout) of table t's row in slot
    s, or -1. Taken from a batch every `refresh` steps by `maybe_refresh`; used for batches of
    at least `min_values` values."""

    def __init__(self, k: int, refresh: int, num_rows: int, num_tables: int, device, min_values=tuning.HOT_MIN_VALUES):
        if k < 1 or refresh < 1:
            raise ValueError(f"hot_rows and hot_refresh must be positive; got {k} and {refresh}")
        self.k, self.refresh, self.min_values = k, refresh, min_values
        self.width = max(16, next_pow2(k))  # slots a table (tl.dot needs 16)
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self.keys = torch.full((num_tables, self.width), -1, dtype=torch.int64, device=device)
        self.taken_at = None  # the step whose batch gave the hot set
        self.partial_meta = {}  # (plan, splits, row width) -> src_meta of the partial sums
        _handles.register(self)  # (a compiled step names it)

    def maybe_refresh(self, values, offsets, plan, B, step):
        """Take the hot set from this batch at the first step, `refresh` steps after the last
        one, or when the step count went back (a checkpoint loaded)."""
        if self.taken_at is None or not 0 <= step - self.taken_at < self.refresh:
            self.take(values, offsets, plan, B)
            self.taken_at = step

    def take(self, values, offsets, plan, B):
        """Each table's k most looked-up rows in this batch (features sharing a table counted
        together; ties: lower row first) become its hot set."""
        dev = values.device
        starts = torch.tensor([r for _, _, _, r in plan.tables] + [plan.num_rows], device=dev)
        rows = plan.meta[:, ROW_START][bag_of_value(offsets, values.numel()) // max(B, 1)] + values.long()
        rows, _, table, order, rank = ranked_rows(rows, starts)
        top = order[rank < self.k]
        t, r = table[top], rank[rank < self.k]
        self.slot.fill_(-1)
        self.slot[rows[top]] = r.int()
        self.keys.fill_(-1)
        self.keys[t, r] = (t << plan.layout.shift) + rows[top] - starts[t]


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["FB", "B"])
def _hot_split_kernel(values, offsets, meta, slot_of, keys, counts, cold, FB, B, stride_m,
                      K: tl.constexpr, CAP: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr):
    g, real, f = program_bags(FB, B, BAGS)
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    key0 = tl.load(meta + f * stride_m + K_KEY_START, mask=real, other=0)
    row0 = tl.load(meta + f * stride_m + K_ROW_START, mask=real, other=0)
    n_cold = tl.zeros([BAGS], dtype=tl.int32)
    for i in range(0, tl.max(end - start), BLOCK):
        q = i + tl.arange(0, BLOCK)
        p = start[:, None] + q[None, :]
        m = p < end[:, None]
        v = tl.load(values + p, mask=m, other=0)
        s = tl.load(slot_of + row0[:, None] + v, mask=m & (q < CAP)[None, :], other=-1)
        hot = s >= 0
        tl.store(keys + p, tl.where(hot, -1, key0[:, None] + v).to(keys.dtype.element_ty), mask=m)
        tl.atomic_add(counts + g[:, None] * K + s, 1.0 + 0.0 * p.to(tl.float32), mask=hot, sem="relaxed")
        n_cold += tl.sum((m & (s < 0)).to(tl.int32), axis=1)
    tl.store(cold + g, n_cold, mask=real)


@triton.jit
def _split(x):
    """The top 11 significant bits of x (all a tf32 product reads) and the rest, exactly."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit(do_not_specialize=["B", "bags_per"])
def _hot_grad_kernel(counts, grad, stride_g, offsets, meta, hot_keys, shift, partial, entry_keys, B, stride_m, bags_per,
                     ROW_D: tl.constexpr, SCALED: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, BB: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    # program (slot block, split, feature x column block): the slot blocks of one split and
    # column block run side by side and read its gradient rows through the L2 once
    s = tl.program_id(1).to(tl.int64)
    f = tl.program_id(2).to(tl.int64) // (ROW_D // BLOCK_D)
    cb = tl.program_id(2) % (ROW_D // BLOCK_D)
    D = tl.load(meta + f * stride_m + K_DIM)
    col = tl.load(meta + f * stride_m + K_OUT_COL)
    pool = tl.load(meta + f * stride_m + K_POOL)
    cols = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    ks = tl.program_id(0) * KB + tl.arange(0, KB)
    acc = tl.zeros([KB, BLOCK_D], dtype=tl.float32)
    seen = tl.zeros([KB], dtype=tl.float32)
    for b0 in range(0, bags_per, BB):
        j = b0 + tl.arange(0, BB)
        b = s * bags_per + j
        inb = (b < B) & (j < bags_per)
        c = tl.load(counts + (f * B + b)[:, None] * K + ks[None, :], mask=inb[:, None], other=0.0)
        x = tl.load(grad + b[:, None] * stride_g + col + cols[None, :], mask=inb[:, None] & (cols < D)[None, :],
                    other=0.0).to(tl.float32)
        if SCALED:  # the sparse path's scale, so that the products round alike
            count = tl.load(offsets + f * B + b + 1, mask=inb, other=0) - tl.load(offsets + f * B + b, mask=inb,
                                                                                  other=0)
            x = x * bag_scale(pool, count, count)[:, None]
        seen = tl.maximum(seen, tl.max(c, axis=0))
        ct = tl.trans(c)
        hi, r = _split(x)
        mid, lo = _split(r)
        acc = tl.dot(ct, lo, acc, input_precision="tf32")
        acc = tl.dot(ct, mid, acc, input_precision="tf32")
        acc = tl.dot(ct, hi, acc, input_precision="tf32")
    e = (f * tl.num_programs(1) + s) * K + ks
    tl.store(partial + e[:, None] * ROW_D + cols[None, :], acc)
    # the entry's key: its hot row, or -1 where no bag of the split holds it (nothing to add,
    # and a row the batch does not touch must not be updated)
    key = tl.load(hot_keys + (tl.load(meta + f * stride_m + K_KEY_START) >> shift) * K + ks)
    tl.store(entry_keys + e, tl.where(seen > 0, key, -1).to(entry_keys.dtype.element_ty),
             mask=ks < tl.where(cb == 0, K, 0))  # (column block 0's)


def hot_update(weights, states, optimizer, values, offsets, plan, B, grad, step, hot: HotRows):
    """collection_update's kernel path with the hot rows taken densely (see the module's
    docstring); unweighted features only."""
    n, FB, F, K = values.numel(), offsets.numel() - 1, plan.meta.shape[0], hot.width
    if n == 0 or FB == 0:
        return
    dev, layout = values.device, plan.layout
    key_dtype = torch.int64 if layout.wide_keys else torch.int32
    keys = torch.empty(n, dtype=key_dtype, device=dev)
    counts = torch.zeros(FB * K, dtype=torch.float32, device=dev)
    cold = torch.empty(FB, dtype=torch.int32, device=dev)
    bags, block = tuning.BAG_PASS_SHAPE
    launch(_hot_split_kernel)[(cdiv(FB, bags),)](
        values, offsets, plan.meta, hot.slot, keys, counts, cold, FB, B, plan.meta.stride(0), K=K,
        CAP=HOT_CAP, BAGS=bags, BLOCK=block)
    cold_start = torch.zeros(FB + 1, dtype=torch.int64, device=dev)
    torch.cumsum(cold, 0, out=cold_start[1:])
    n_cold = int(cold_start[-1])
    if n_cold:
        cold_keys, cold_bag, scale = backward_inputs(keys, offsets, None, plan.meta, B, wide_keys=layout.wide_keys,
                                                     scaled=plan.scaled, kernel=True, cold=(cold_start, n_cold))
        fused_update(weights, states, optimizer, cold_keys, layout, grad, step, src_row=cold_bag, scale=scale,
                     src_stride=grad.stride(0), src_bags=B, src_meta=plan.src_meta)
    splits = cdiv(B, tuning.BAGS_PER_SPLIT)
    row_d = max(16, next_pow2(plan.max_dim))  # the partial rows' width
    block_d = min(row_d, 128)  # columns a program
    partial = torch.empty(F * splits * K, row_d, dtype=torch.float32, device=dev)
    entry = torch.empty(F * splits * K, dtype=key_dtype, device=dev)
    shape = tuning.product_shape(K)
    launch(_hot_grad_kernel)[(K // shape["KB"], splits, F * (row_d // block_d))](
        counts, grad, grad.stride(0), offsets, plan.meta, hot.keys, layout.shift, partial, entry, B,
        plan.meta.stride(0), cdiv(B, splits),
        ROW_D=row_d, SCALED=plan.scaled, K=K, BLOCK_D=block_d, **shape)
    meta = hot.partial_meta.get((plan, splits, row_d))
    if meta is None:  # feature f's partial rows start at row f * splits * K
        meta = plan.src_meta.clone()
        meta[:, 0] = torch.arange(F, device=dev) * splits * K * row_d
        hot.partial_meta[plan, splits, row_d] = meta
    fused_update(weights, states, optimizer, entry, layout, partial, step, src_stride=row_d,
                 src_bags=splits * K, src_meta=meta)
