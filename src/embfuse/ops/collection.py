"""Table-batched pooled lookup: every feature of a keyed jagged batch in one launch.

    out[b, col_f : col_f + D_f] = pool over p in bag g = f * B + b of  w[p] * table_f[values[p], :]

Bags are key-major (TorchRec's layout: feature 0's B bags, then feature 1's); feature f reads
table t(f) (features may share a table) of width D_f = D_t(f), pools by sum or mean, and writes
its columns of the (B, sum of D_f) output. All tables live in one flat weight buffer laid out by
a `Layout` (ops/_segment.py), so the backward (and a fused optimizer) is one sort and a few
launches for the whole collection, whatever the number of tables.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import cdiv, kernel_op, launch, needs_op, next_pow2, tl, tracing, triton, use_kernels
from embfuse.ops._segment import Layout, reduce_segments, table_starts
from embfuse.ops.validate import (BAD_ID, BAD_OFFSETS, DEFAULT_BOUNDS_CHECK, BadBatchError, BadIdError,
                                  TracedCheck, check_bounds_mode, check_index_dtype,
                                  caller_stacklevel, launch_bags_check, run_check, traced_mode)
from embfuse.ops.embedding_bag import MEAN, SUM, _config, _config_cached, pool_bag

POOLING = {"sum": SUM, "mean": MEAN}
# columns of Plan.meta, one row per feature
ELEM_START, DIM, OUT_COL, POOL, ROW_START, ROWS, KEY_START = range(7)


class Plan:
    """What the kernels need to know about a collection's features, on one device.

    tables: (rows, dim) of each table; features: (table index, pooling, first output column)
    of each feature, in the order of the batch's keys. meta[f] = (first element of f's table in
    the flat buffer, width, first output column, pooling, first global row, rows, sort key of the
    table's row 0: see Layout)."""

    def __init__(self, tables: list[tuple[int, int]], features: list[tuple[int, str, int]], device):
        rows, dims = [r for r, _ in tables], [d for _, d in tables]
        self.layout = Layout.build(rows, dims)
        row, elem = table_starts(rows, dims)
        self.rows = [[elem[t], tables[t][1], col, POOLING[pooling], row[t], tables[t][0], t << self.layout.shift]
                     for t, pooling, col in features]
        self.meta = torch.tensor(self.rows, dtype=torch.int64, device=device).reshape(-1, KEY_START + 1)
        self.limits = self.meta[:, ROWS].contiguous()  # rows of each feature's table: the check's bounds
        self.src_meta = source_meta(self.meta)
        self.total_dim = max((m[OUT_COL] + m[DIM] for m in self.rows), default=0)
        self.max_dim = self.layout.max_dim
        self.num_elements = elem[-1]
        self.num_rows = row[-1]
        self.tables = [(rows, dim, elem[t], row[t]) for t, (rows, dim) in enumerate(tables)]
        self.feature_table = [t for t, _, _ in features]
        # whether any feature averages: else the backward of unweighted bags scales nothing
        self.mean = any(m[POOL] == MEAN for m in self.rows)


def source_meta(meta: Tensor) -> Tensor:
    """Per feature, what the backward kernels read about it (ops/_segment.py Segments): its first
    column in the pooled output, its width, and the first element and global row of its table
    less its sort-key start (so that key * width and key are added directly)."""
    D = meta[:, DIM]
    return torch.stack([meta[:, OUT_COL], D, meta[:, ELEM_START] - meta[:, KEY_START] * D,
                        meta[:, ROW_START] - meta[:, KEY_START]], 1).contiguous()


def bag_of_value(offsets: Tensor, n: int) -> Tensor:
    """Bag g of every value (offsets: F * B + 1, starting at 0); no host read."""
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(bags, lengths, output_size=n)


def feature_slices(offsets, rows, B):
    """Per feature: (its meta row, its values' slice, its bags' offsets from 0). Host reads."""
    for f, m in enumerate(rows):
        o = offsets[f * B:(f + 1) * B + 1].long()
        lo, hi = (int(v) for v in o[[0, -1]]) if B else (0, 0)
        yield m, slice(lo, hi), o - lo


def ranked_rows(global_rows: Tensor, row_starts: Tensor):
    """The distinct rows of `global_rows` ranked within their tables (row_starts: T + 1 first
    global rows): (rows ascending, times each is looked up, its table, order, rank), `order`
    listing rows by table, most looked-up first (ties: lower row first), rank[i] the place of
    rows[order[i]] in its table. Device ops and one host read (torch.unique's size)."""
    rows, counts = torch.unique(global_rows, return_counts=True)
    row_table = torch.bucketize(rows, row_starts[1:], right=True)
    # stable sorts keep torch.unique's ascending rows among equal counts
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[torch.argsort(row_table[order], stable=True)]
    distinct = torch.bincount(row_table, minlength=row_starts.numel() - 1)
    first = torch.cumsum(distinct, 0) - distinct
    rank = torch.arange(order.numel(), device=order.device) - first[row_table[order]]
    return rows, counts, row_table, order, rank


def table_view(buffer, elem_start, rows, dim):
    """Table of the flat buffer as a (rows, dim) view."""
    return buffer[elem_start:elem_start + rows * dim].view(rows, dim)


def _elements(values, offsets, psw, meta, B, total_dim, max_dim, acc):
    """Per value and column c < max_dim: (flat weight element, flat output element, factor, mask
    of the columns inside the value's width): factor = psw x (1 / bag length under mean), 0
    past the width (callers mask with a where: element 0 there, and 0 * NaN is NaN).
    Plain tensor ops without host reads, so the reference also traces under torch.compile."""
    bag = bag_of_value(offsets, values.numel())
    m = meta[bag // max(B, 1)]
    cols = torch.arange(max_dim, device=values.device)
    inside = cols[None, :] < m[:, DIM, None]
    w_at = torch.where(inside, m[:, ELEM_START, None] + values.long()[:, None] * m[:, DIM, None] + cols, 0)
    o_at = torch.where(inside, (bag % max(B, 1))[:, None] * total_dim + m[:, OUT_COL, None] + cols, 0)
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)[bag].to(acc)
    factor = torch.where(m[:, POOL] == MEAN, 1.0 / lengths, 1.0)
    if psw is not None:
        factor = factor * psw.to(acc)
    return w_at, o_at, torch.where(inside, factor[:, None], 0), inside


def collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim):
    """Pure torch (CPU path and test oracle): gather every value's row, scale, add into its bag."""
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    w_at, o_at, factor, inside = _elements(values, offsets, psw, meta, B, total_dim, max_dim, acc)
    out = torch.zeros(B * total_dim, dtype=acc, device=weights.device)
    out.index_add_(0, o_at.reshape(-1), torch.where(inside, weights.to(acc)[w_at] * factor, 0).reshape(-1))
    return out.view(B, total_dim).to(weights.dtype)


@triton.jit
def _collection_fwd_kernel(
    weights, values, offsets, psw, status, meta, out, B, stride_o, stride_m,
    HAS_PSW: tl.constexpr, STATUS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr,
    VEC: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    f = g // B
    first_col = tl.program_id(1) * BLOCK_D
    # widths, table starts and output columns are multiples of VEC (the widths' power-of-two
    # factor): said so, the row gathers become VEC-wide vector loads (16 bytes for fp32 at VEC
    # 4); read from `meta` unannotated they were 4-byte loads
    D = tl.multiple_of(tl.load(meta + f * stride_m + 1), VEC)
    # every scalar the program needs, loaded before the test on D (in bounds for any bag), so
    # that their latencies overlap instead of following one another
    start = tl.load(offsets + g).to(tl.int64)
    end = tl.load(offsets + g + 1).to(tl.int64)
    table = weights + tl.multiple_of(tl.load(meta + f * stride_m), VEC)
    col = tl.multiple_of(tl.load(meta + f * stride_m + 2), VEC)
    mean = tl.load(meta + f * stride_m + 3) == 1
    if STATUS:  # a batch its check found bad pools nothing (ops/validate.py)
        end = tl.where(tl.load(status) == 0, end, start)
    if first_col < D:  # narrower features leave their last column blocks idle
        cols = first_col + tl.arange(0, BLOCK_D)
        cmask = (cols // VEC) < (D // VEC)  # constant over each group of VEC columns
        result, _ = pool_bag(table, values, psw, start, end, cols, cmask, D, -1, 0, HAS_PSW, False, BLOCK_L,
                             BLOCK_D, EVICT)
        if mean:
            result = result / tl.maximum(end - start, 1).to(tl.float32)
        b = g - f * B
        tl.store(out + b * stride_o + col + cols, result.to(out.dtype.element_ty), mask=cmask)


def collection_forward(weights, values, offsets, psw, meta, B, total_dim, max_dim, vec=1, config=None, status=None):
    """Triton launcher; `vec`: a power of two dividing every width (Layout.vec), for vector loads;
    `config`: launch-shape overrides for sweeps (see embedding_bag._config)."""
    F = meta.shape[0]
    out = torch.empty(B, total_dim, dtype=weights.dtype, device=weights.device)
    if B == 0 or total_dim == 0:
        return out
    avg = next_pow2(max(1, values.numel() // max(1, F * B)))
    cfg = _config(max_dim, avg, config) if config or tracing() else _config_cached(max_dim, avg)
    launch(_collection_fwd_kernel)[(F * B, cdiv(max_dim, cfg["BLOCK_D"]))](
        weights, values, offsets, psw if psw is not None else weights, status if status is not None else offsets,
        meta, out, B, out.stride(0), meta.stride(0), HAS_PSW=psw is not None, STATUS=status is not None, VEC=vec,
        **cfg)
    return out


def backward_inputs_reference(values, offsets, psw, meta, B, wide_keys=True, mean=True):
    """Per value: (sort key of its row, see Layout; bag; scale, None where every scale is 1:
    no weights, and `mean` False), in torch ops."""
    bag = bag_of_value(offsets, values.numel())
    f = bag // max(B, 1)
    keys = meta[:, KEY_START][f] + values.long()
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)[bag].to(torch.float32)
    scale = torch.where(meta[:, POOL][f] == MEAN, 1.0 / lengths, 1.0)
    if psw is None and not mean:
        scale = None
    elif psw is not None:
        scale = psw.to(torch.float32) * scale
    return keys if wide_keys else keys.int(), bag, scale


@triton.jit
def program_bags(offsets, FB, B, BAGS: tl.constexpr):
    """The BAGS bags (feature-major) of this program, side by side: (bag, in range, feature,
    first value, end). A program a bag spent most of its time waiting on the offsets
    (latency-bound, measured)."""
    g = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    real = g < FB
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    return g, real, g // B, start, end


@triton.jit
def bag_scale(meta, f, stride_m, real, start, end):
    """Each bag's gradient scale: 1 / length under mean pooling (IEEE division, as torch
    divides: the approximate one differs in the last bit), else 1."""
    inv = tl.math.div_rn(1.0, tl.maximum(end - start, 1).to(tl.float32))
    return tl.where(tl.load(meta + f * stride_m + 3, mask=real, other=0) == 1, inv, 1.0)


@triton.jit
def _backward_inputs_kernel(values, offsets, psw, status, meta, keys, bag_out, scale_out, n, FB, B, stride_m,
                            HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr, STATUS: tl.constexpr,
                            BAGS: tl.constexpr, BLOCK: tl.constexpr):
    g, real, f, start, end = program_bags(offsets, FB, B, BAGS)
    key0 = tl.load(meta + f * stride_m + 6, mask=real, other=0)  # KEY_START
    scale = bag_scale(meta, f, stride_m, real, start, end)
    if STATUS:  # a bad batch: every value gets key -1, the bags splitting [0, n) evenly
        bad = tl.load(status) != 0
        chunk = (n + FB - 1) // FB
        start = tl.where(bad, tl.minimum(g * chunk, n), start)
        end = tl.where(bad, tl.minimum(start + chunk, n), end)
        key0 = tl.where(bad, -1, key0)
    for i in range(0, tl.max(end - start), BLOCK):
        p = start[:, None] + i + tl.arange(0, BLOCK)[None, :]
        m = p < end[:, None]
        v = tl.load(values + p, mask=m, other=0)
        if STATUS:
            v = tl.where(key0[:, None] < 0, 0, v)
        tl.store(keys + p, (key0[:, None] + v).to(keys.dtype.element_ty), mask=m)
        tl.store(bag_out + p, (g[:, None] + 0 * p).to(bag_out.dtype.element_ty), mask=m)
        if HAS_PSW:
            w = tl.load(psw + p, mask=m, other=0.0).to(tl.float32)
            tl.store(scale_out + p, scale[:, None] * w, mask=m)
        elif HAS_SCALE:
            tl.store(scale_out + p, scale[:, None] + tl.zeros([BAGS, BLOCK], tl.float32), mask=m)


def backward_inputs(values, offsets, psw, meta, B, wide_keys=True, mean=True, status=None):
    """`backward_inputs_reference` in one launch instead of ten torch ops over every value;
    keys int32 unless `wide_keys`, bags int32 while they fit. Without weights and with no
    feature averaging (`mean` False: Plan.mean) every scale is 1 and none is returned (None):
    the reduction then reads no scale a value, a 4-byte gather from a random place each.
    `status`: the batch's deferred check; a bad batch gives every value key -1."""
    n, FB = values.numel(), offsets.numel() - 1
    keys = torch.empty(n, dtype=torch.int64 if wide_keys else torch.int32, device=values.device)
    bag = torch.empty(n, dtype=torch.int64 if FB >= 2**31 else torch.int32, device=values.device)
    scaled = psw is not None or mean
    scale = torch.empty(n, dtype=torch.float32, device=values.device) if scaled else None
    if n and FB:
        launch(_backward_inputs_kernel)[(cdiv(FB, 8),)](
            values, offsets, psw if psw is not None else keys, status if status is not None else offsets, meta, keys,
            bag, scale if scaled else keys, n, FB, max(B, 1), meta.stride(0), HAS_PSW=psw is not None,
            HAS_SCALE=scaled, STATUS=status is not None, BAGS=8, BLOCK=32)
    return keys, bag, scale


def collection_backward(grad, values, offsets, psw, meta, src_meta, layout: Layout, B, num_elements, mean=True,
                        status=None):
    """Gradient of the flat weight buffer (dense), by one segment reduction (src_meta and mean:
    Plan's)."""
    out = torch.zeros(num_elements, dtype=grad.dtype, device=grad.device)
    if values.numel() == 0:
        return out
    keys, bag, scale = backward_inputs(values, offsets, psw, meta, B, layout.wide_keys, mean, status)
    return reduce_segments(keys, layout, grad.contiguous(), out, src_row=bag, scale=scale,
                           src_stride=grad.stride(0), src_bags=B, src_meta=src_meta)


def collection_backward_reference(grad, values, offsets, psw, meta, B, num_elements, max_dim):
    """Pure torch: every value's scaled gradient row added into its table row."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    w_at, o_at, factor, inside = _elements(values, offsets, psw, meta, B, grad.shape[1], max_dim, acc)
    out = torch.zeros(num_elements, dtype=acc, device=grad.device)
    out.index_add_(0, w_at.reshape(-1), torch.where(inside, grad.to(acc).reshape(-1)[o_at] * factor, 0).reshape(-1))
    return out.to(grad.dtype)


def guard_bags(values, offsets, status):
    """(values, offsets) for the torch-op paths, which would fault on a bad batch: when `status`
    says the batch is bad, every value 0 in the first bag (in range whatever the tables); the
    caller zeroes what they give. Elementwise ops, no host read (so they trace)."""
    good = status[0] == 0
    n = values.numel()
    safe = torch.cat([offsets[:1] * 0, torch.full_like(offsets[1:], n)])
    return torch.where(good, values, 0), torch.where(good, offsets, safe)


def one_width(meta: Tensor, total_dim: int, max_dim: int) -> bool:
    """Whether every feature has the widest width (then the flat buffer is one (rows, D) table)."""
    return meta.shape[0] * max_dim == total_dim


def collection_native(weights, values, offsets, psw, meta, B, total_dim, max_dim):
    """The CPU path of a collection whose features share one width: the flat buffer as one
    (rows, D) table, global rows (a table's first row + id), and torch's native embedding_bag
    over all F * B bags at once (sum; mean features divided by their bags' lengths after)."""
    D, F = max_dim, meta.shape[0]
    feature = bag_of_value(offsets, values.numel()) // max(B, 1)
    rows = meta[:, ROW_START][feature] + values.long()
    table = weights.view(-1, D)
    pooled = torch.nn.functional.embedding_bag(rows, table, offsets, mode="sum", include_last_offset=True,
                                               per_sample_weights=None if psw is None else psw.to(table.dtype))
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
    mean = (meta[:, POOL] == MEAN).repeat_interleave(B)
    pooled = torch.where(mean[:, None], pooled / lengths[:, None].to(pooled.dtype), pooled)
    out = weights.new_empty(B, F, D)
    out[:, meta[:, OUT_COL] // D] = pooled.view(F, B, D).transpose(0, 1)
    return out.view(B, total_dim)


def _forward_impl(weights, values, offsets, psw, meta, B, total_dim, max_dim, vec, status=None):
    if use_kernels(weights) and weights.dtype != torch.float64:
        return collection_forward(weights, values, offsets, psw, meta, B, total_dim, max_dim, vec, status=status)
    if status is None and weights.device.type == "cpu" and not tracing() and one_width(meta, total_dim, max_dim):
        return collection_native(weights, values, offsets, psw, meta, B, total_dim, max_dim)
    if status is not None:
        values, offsets = guard_bags(values, offsets, status)
        return collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim) * (status[0] == 0)
    return collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim)


@kernel_op("embfuse::embedding_bag_collection", mutates_args=())
def _collection_op(weights: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                   status: Optional[Tensor], meta: Tensor, src_meta: Tensor, B: int, total_dim: int, max_dim: int,
                   vec: int, wide_keys: bool, mean: bool) -> Tensor:
    return _forward_impl(weights, values, offsets, per_sample_weights, meta, B, total_dim, max_dim, vec, status)


@_collection_op.register_fake
def _(weights, values, offsets, per_sample_weights, status, meta, src_meta, B, total_dim, max_dim, vec, wide_keys,
      mean):
    return weights.new_empty(B, total_dim)


@kernel_op("embfuse::embedding_bag_collection_backward", mutates_args=())
def _collection_backward_op(grad: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                            status: Optional[Tensor], meta: Tensor, src_meta: Tensor, B: int, num_elements: int,
                            max_dim: int, vec: int, wide_keys: bool, mean: bool) -> Tensor:
    if use_kernels(grad) and grad.dtype != torch.float64:
        layout = Layout(max_dim, vec, wide_keys)
        return collection_backward(grad, values, offsets, per_sample_weights, meta, src_meta, layout, B,
                                   num_elements, mean, status)
    if status is not None:
        values, offsets = guard_bags(values, offsets, status)
        grad = grad * (status[0] == 0)
    return collection_backward_reference(grad, values, offsets, per_sample_weights, meta, B, num_elements, max_dim)


@_collection_backward_op.register_fake
def _(grad, values, offsets, per_sample_weights, status, meta, src_meta, B, num_elements, max_dim, vec, wide_keys,
      mean):
    return grad.new_empty(num_elements)


def _setup_context(ctx, inputs, output):
    weights, values, offsets, psw, status, meta, src_meta, B, total_dim, max_dim, vec, wide_keys, mean = inputs
    ctx.save_for_backward(values, offsets, psw, status, meta, src_meta)
    ctx.args = (B, weights.numel(), max_dim, vec, wide_keys, mean)


def _autograd_backward(ctx, grad):
    values, offsets, psw, status, meta, src_meta = ctx.saved_tensors
    g = None
    if ctx.needs_input_grad[0]:
        g = _collection_backward_op(grad, values, offsets, psw, status, meta, src_meta, *ctx.args)
    return (g,) + (None,) * 12


_collection_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def embedding_bag_collection(weights: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                             plan: Plan, B: int, status: Optional[Tensor] = None) -> Tensor:
    """Pooled lookup of every feature (checked input, canonical offsets); (B, plan.total_dim).
    `status`: the batch's deferred check (validate_collection), or None."""
    if per_sample_weights is not None and per_sample_weights.requires_grad:
        raise ValueError("per-sample weights of a collection get no gradient; detach them")
    if needs_op(weights):
        L = plan.layout
        return _collection_op(weights, values, offsets, per_sample_weights, status, plan.meta, plan.src_meta, B,
                              plan.total_dim, plan.max_dim, L.vec, L.wide_keys, plan.mean)
    return _forward_impl(weights, values, offsets, per_sample_weights, plan.meta, B, plan.total_dim, plan.max_dim,
                         plan.layout.vec, status)


def _raise_collection(values, offsets, limits, B, keys, tables, skip_ids):
    """The exact error of a keyed batch, if it has one (host reads: the slow path)."""
    n, FB = values.numel(), offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    neg = (lengths < 0).nonzero()
    if neg.numel():
        g = int(neg[0])
        raise BadBatchError(f"feature {keys[g // B]!r}: lengths[{g}] (sample {g % B}) = {int(lengths[g])} is "
                            f"negative")
    if int(offsets[0]) != 0 or int(offsets[-1]) != n:
        raise BadBatchError(f"lengths add up to {int(offsets[-1]) - int(offsets[0])} but there are {n} values")
    if skip_ids or n == 0:
        return
    bag = bag_of_value(offsets, n)
    bad = (values < 0) | (values >= limits[bag // B])
    if bool(bad.any()):
        raise BadIdError(_bad_value_message(values, bag, bad, limits, B, keys, tables))


def _bad_value_message(values, bag, bad, limits, B, keys, tables) -> str:
    """The first out-of-range value of a keyed batch (`bad`: the mask of them), by feature,
    table, position and sample."""
    p = int(bad.nonzero()[0])
    g = int(bag[p])
    f = g // B
    rows = int(limits[f])
    return (f"feature {keys[f]!r}: values[{p}] = {int(values[p])} (sample {g % B}) is out of range for table "
            f"{tables[f]!r} of {rows} rows (valid ids are 0..{rows - 1})")


def _collection_flags_reference(values, offsets, limits, B) -> int:
    n = values.numel()
    lengths = offsets[1:] - offsets[:-1]
    if bool((lengths < 0).any()) or int(offsets[0]) != 0 or int(offsets[-1]) != n:
        return BAD_OFFSETS
    bad = (values < 0) | (values >= limits[bag_of_value(offsets, n) // B])
    return BAD_ID if bool(bad.any()) else 0


def _run_collection_check(values, offsets, limits, B, keys, tables, bounds_check, fresh, kernel):
    raise_error = functools.partial(_raise_collection, values, offsets, limits, B, keys, tables,
                                    bounds_check == "skip")
    return run_check(
        values.device, use_kernels(values) if kernel is None else kernel, bounds_check,
        lambda log, c: launch_bags_check(log, c, values, offsets, limits, B),
        lambda: _collection_flags_reference(values, offsets, limits, B), raise_error, "EmbeddingBagCollection",
        fresh)


def validate_collection(values: Tensor, offsets: Tensor, psw: Optional[Tensor], plan: Plan, B: int,
                        keys: list[str], tables: list[str], bounds_check: str = DEFAULT_BOUNDS_CHECK,
                        fresh: bool = True, kernel: Optional[bool] = None):
    """Check a keyed batch against the collection's tables in one pass: lengths that are
    non-negative and add up to the values, every id inside its feature's table. Returns the
    (values, offsets, per_sample_weights, check) to use: compacted copies when bounds_check="skip"
    drops bad ids, and the deferred Check whose status the kernels read (or None). Errors name
    the feature, its table, the position and the sample."""
    check_bounds_mode(bounds_check)
    check_index_dtype("values", values)
    check_index_dtype("lengths", offsets)
    if psw is not None:
        if not psw.is_floating_point():
            raise TypeError(f"weights must be floating point, got {psw.dtype}")
        if psw.shape != values.shape:
            raise ValueError(f"weights has shape {tuple(psw.shape)}; values has {tuple(values.shape)}")
    n, FB = values.numel(), offsets.numel() - 1
    if FB == 0 and n:
        raise BadBatchError(f"the batch has no bags but {n} values")
    if bounds_check == "off" or FB == 0:
        return values, offsets, psw, None
    B = max(B, 1)
    if tracing():
        return values, offsets, psw, TracedCheck(_check_bags_op(values, offsets, plan.limits, B, "\n".join(keys),
                                                                "\n".join(tables), traced_mode(bounds_check)))

    check, flags = _run_collection_check(values, offsets, plan.limits, B, keys, tables, bounds_check, fresh, kernel)
    if not flags:
        return values, offsets, psw, check
    bag = bag_of_value(offsets, n)
    bad = (values < 0) | (values >= plan.limits[bag // B])
    first = _bad_value_message(values, bag, bad, plan.limits, B, keys, tables)
    warnings.warn(f"skipped {int(bad.sum())} out-of-range id(s); first: {first}", stacklevel=caller_stacklevel())
    keep = ~bad
    kept = torch.bincount(bag[keep], minlength=FB).to(offsets.dtype)
    offsets = torch.cat([offsets[:1], kept.cumsum(0).to(offsets.dtype)])
    return values[keep], offsets, None if psw is None else psw[keep], None


@torch.library.custom_op("embfuse::check_bags", mutates_args=())
def _check_bags_op(values: Tensor, offsets: Tensor, limits: Tensor, B: int, keys: str, tables: str,
                   bounds_check: str) -> Tensor:
    """validate_collection as one opaque op for torch.compile graphs: the check's status (keys
    and table names joined by newlines: an op takes no list of strings)."""
    check = _run_collection_check(values, offsets, limits, B, keys.split("\n"), tables.split("\n"), bounds_check,
                                  True, None)[0]
    return check.status.clone() if check is not None else torch.zeros(2, dtype=torch.int32, device=values.device)


@_check_bags_op.register_fake
def _(values, offsets, limits, B, keys, tables, bounds_check):
    return values.new_empty(2, dtype=torch.int32)
