"""Table-batched pooled lookup: every feature of a keyed jagged batch in one launch.

    out[b, col_f : col_f + D_f] = pool over p in bag g = f * B + b of  w[p] * table_f[values[p], :]

Bags are key-major (TorchRec's layout: feature 0's B bags, then feature 1's); feature f reads
table t(f) (features may share a table) of width D_f = D_t(f), pools by sum, mean, sqrtn or wmean (the
rules of ops/bags.py), and writes its columns of the (B, sum of D_f) output. All tables live in
one flat weight buffer laid out by a `Layout` (ops/segments.py), so the backward (and a fused
optimizer) is one sort and a few launches for the whole collection, whatever the number of tables.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from embfuse import _handles
from embfuse._triton import (backward_needs_op, cdiv, eager_autograd, kernel_op, launch, needs_op, tl, tracing,
                              triton, use_kernels)
from embfuse.ops.bags import (DIM, ELEM_START, K_DIM, K_ELEM_START, K_OUT_COL, K_POOL, K_SUM, KEY_START, MEAN,
                              META_COLUMNS, K_NEGATIVE_IDS, K_NO_PADDING, K_SQRTN, OUT_COL, POOL, POOLINGS, ROW_START,
                              ROWS, SCALED, SUM, WEIGHT_SUMS, accumulation, index_sum,
                              backward_inputs, backward_inputs_reference, bag_norms_reference, divide,
                              divide_reference, guard_bags, held_offsets, pool_bag, pool_norm, torch_cpu)
from embfuse.ops.chain import ACTIVATIONS, chain_activation, layer_norm_act_reference
from embfuse.ops.safe import feature_rules
from embfuse.ops.segments import Layout, reduce_segments, segment_grad_reference, table_starts
from embfuse.ops import tuning


class Plan(_handles.Named):
    """What the kernels need to know about a collection's features, on one device.

    tables: (rows, dim) of each table; features: (table index, pooling, first output column)
    of each feature, in the order of the batch's keys. meta[f]: feature f's meta row (the
    columns ops/bags.py names). `safe`: per feature, TensorFlow's safe rules (ops/safe.py: drops
    ids < 0, drops weights <= 0, default id or None) or None; `rules` then holds them (else None)
    and the check lets those features' ids < 0 through (negated limits)."""

    def __init__(self, tables: list[tuple[int, int]], features: list[tuple[int, str, int]], device,
                 safe: Optional[list] = None):
        rows, dims = [r for r, _ in tables], [d for _, d in tables]
        self.layout = Layout.build(rows, dims)
        row, elem = table_starts(rows, dims)
        self.rows = []
        for t, pooling, col in features:
            m = [0] * META_COLUMNS
            m[ELEM_START], m[DIM], m[OUT_COL], m[POOL] = elem[t], tables[t][1], col, POOLINGS[pooling]
            m[ROW_START], m[ROWS], m[KEY_START] = row[t], tables[t][0], t << self.layout.shift
            self.rows.append(m)
        self.meta = torch.tensor(self.rows, dtype=torch.int64, device=device).reshape(-1, META_COLUMNS)
        # the narrowest feature's width, 0 when a table's ids pass int32 (tuning.narrows)
        self.narrow_dim = min((m[DIM] for m in self.rows), default=0) if max(rows, default=0) < 1 << 31 else 0
        self.rules, self.limits = feature_rules(safe, self.meta[:, ROWS].contiguous())  # (limits: the check's bounds)
        self.skips = self.rules is not None  # batches after the safe pass hold ids < 0 no bag pools
        self.tail = False  # the plan of padded batches (sparse/padded.py): nn/collection.py sets it
        self.table_names = None  # each feature's table's name, for messages: nn/collection.py sets it
        self.src_meta = source_meta(self.meta)
        self.total_dim = max((m[OUT_COL] + m[DIM] for m in self.rows), default=0)
        self.max_dim = self.layout.max_dim
        self.num_elements = elem[-1]
        self.num_rows = row[-1]
        self.tables = [(rows, dim, elem[t], row[t]) for t, (rows, dim) in enumerate(tables)]
        self.feature_table = [t for t, _, _ in features]
        # whether any feature divides its sum (else the backward of unweighted bags scales
        # nothing), and whether any norm sums its weights (sqrtn, wmean: weighted bags then sum
        # a term of each weight)
        self.scaled = any(m[POOL] in SCALED for m in self.rows)
        self.weight_sums = any(m[POOL] in WEIGHT_SUMS for m in self.rows)


def source_meta(meta: Tensor) -> Tensor:
    """Per feature, what the backward kernels read about it (ops/_segment.py Segments): its first
    column in the pooled output, its width, and the first element and global row of its table
    less its sort-key start (so that key * width and key are added directly)."""
    D = meta[:, DIM]
    return torch.stack([meta[:, OUT_COL], D, meta[:, ELEM_START] - meta[:, KEY_START] * D,
                        meta[:, ROW_START] - meta[:, KEY_START]], 1).contiguous()


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
    of the columns inside the value's width): factor = the value's scale (bags.py: w / norm), 0
    past the width (callers mask with a where: element 0 there, and 0 * NaN is NaN).
    Plain tensor ops without host reads, so the reference also traces under torch.compile."""
    keys, bag, factor = backward_inputs_reference(values, offsets, psw, meta, B, dtype=acc)
    m = meta[bag // max(B, 1)]
    cols = torch.arange(max_dim, device=values.device)
    inside = (cols[None, :] < m[:, DIM, None]) & (keys >= 0)[:, None]  # (ids < 0: no element)
    w_at = torch.where(inside, m[:, ELEM_START, None] + values.long()[:, None] * m[:, DIM, None] + cols, 0)
    o_at = torch.where(inside, (bag % max(B, 1))[:, None] * total_dim + m[:, OUT_COL, None] + cols, 0)
    return w_at, o_at, torch.where(inside, factor[:, None], 0), inside


def collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim):
    """Pure torch (CPU path and test oracle): gather every value's row, scale, add into its bag."""
    acc = accumulation(weights)
    w_at, o_at, factor, inside = _elements(values, offsets, psw, meta, B, total_dim, max_dim, acc)
    out = index_sum(B * total_dim, o_at.reshape(-1), torch.where(inside, weights.to(acc)[w_at] * factor, 0).reshape(-1))
    return out.view(B, total_dim).to(weights.dtype)


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["B"])
def _collection_fwd_kernel(
    weights, values, offsets, psw, status, meta, out, B, stride_o, stride_m, ln_w, ln_b, eps,
    HAS_PSW: tl.constexpr, WSUM: tl.constexpr, SKIP: tl.constexpr, STATUS: tl.constexpr, FULL: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr, VEC: tl.constexpr, EPILOGUE: tl.constexpr,
    ACT: tl.constexpr, HAS_LW: tl.constexpr, HAS_LB: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    f = g // B
    first_col = tl.program_id(1) * BLOCK_D
    # widths, table starts and output columns are multiples of VEC (the widths' power-of-two
    # factor): said so, the row gathers become VEC-wide vector loads (16 bytes for fp32 at VEC
    # 4); read from `meta` unannotated they were 4-byte loads. FULL: every feature BLOCK_D wide,
    # a constant width without column masks (the Criteo collection 8% faster, its tables of at
    # most 32 rows 15%: benchmarks/NOTES.md, session 45)
    if FULL:
        D = BLOCK_D
    else:
        D = tl.multiple_of(tl.load(meta + f * stride_m + K_DIM), VEC)
    # every scalar the program needs, loaded before the test on D (in bounds for any bag), so
    # that their latencies overlap instead of following one another
    start = tl.load(offsets + g).to(tl.int64)
    end = tl.load(offsets + g + 1).to(tl.int64)
    table = weights + tl.multiple_of(tl.load(meta + f * stride_m + K_ELEM_START), VEC)
    col = tl.multiple_of(tl.load(meta + f * stride_m + K_OUT_COL), VEC)
    pool = tl.load(meta + f * stride_m + K_POOL)
    if STATUS:  # a batch its check found bad pools nothing (ops/validate.py); as a product,
        # not a select: 63 registers instead of 66 at FULL (benchmarks/NOTES.md, session 46)
        end = start + (end - start) * (tl.load(status) == 0)
    if first_col < D:  # narrower features leave their last column blocks idle
        cols = first_col + tl.arange(0, BLOCK_D)
        if FULL:
            cmask = tl.full([BLOCK_D], 1, tl.int1)
        else:
            cmask = (cols // VEC) < (D // VEC)  # constant over each group of VEC columns
        result, _, count, wsum = pool_bag(table, values, psw, start, end, cols, cmask, D, 0, pool == K_SQRTN,
                                          pool != K_SUM, 0, HAS_PSW, K_NEGATIVE_IDS if SKIP else K_NO_PADDING, WSUM,
                                          BLOCK_L, BLOCK_D, EVICT)
        # a branch on the feature's mode after the loop, as before bags.py: sum features pay
        # nothing (benchmarks/NOTES.md, session 11, has what the other forms cost)
        if pool != K_SUM:
            result = divide(result, pool_norm(pool, count, wsum))
        if EPILOGUE:  # ops/chain.py's LayerNorm + activation on the pooled row, before the write
            # (every feature D wide, all of D in this program; the affine's row is the feature's)
            x = tl.where(cmask, result.to(out.dtype.element_ty).to(tl.float32), 0.0)
            mean = tl.sum(x, axis=0) / D
            diff = tl.where(cmask, x - mean, 0.0)
            z = diff / tl.sqrt(tl.sum(diff * diff, axis=0) / D + eps)
            if HAS_LW:
                z = z * tl.load(ln_w + f * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_LB:
                z = z + tl.load(ln_b + f * D + cols, mask=cmask, other=0.0).to(tl.float32)
            result = chain_activation(z, ACT)
        b = g - f * B
        tl.store(out + b * stride_o + col + cols, result.to(out.dtype.element_ty), mask=cmask)


def collection_forward(weights, values, offsets, psw, meta, B, total_dim, max_dim, vec=1, config=None, status=None,
                       weight_sums=True, epilogue=None, skips=False):
    """Triton launcher; `vec`: a power of two dividing every width (Layout.vec), for vector loads;
    `config`: launch-shape overrides for sweeps (tuning.bag_shape); `weight_sums`: Plan's (some
    feature's norm sums its weights: weighted bags then sum their terms); `skips`: Plan's (the
    batch holds ids < 0, passed over). `epilogue`: (ln_weight (F, D) or
    None, ln_bias or None, eps, activation): every feature D wide (D <= 256), and each pooled row
    leaves through embfuse.ops.chain's LayerNorm + activation, in the same program."""
    F = meta.shape[0]
    out = torch.empty(B, total_dim, dtype=weights.dtype, device=weights.device)
    if B == 0 or total_dim == 0:
        return out
    cfg = tuning.pooling_shape(max_dim, values.numel(), F * B, config, tracing(), weights.element_size())
    ln_w, ln_b, eps, act = epilogue if epilogue is not None else (None, None, 0.0, "none")
    if epilogue is not None and (cfg["BLOCK_D"] < max_dim or not one_width(meta, total_dim, max_dim)):
        raise ValueError(f"a LayerNorm epilogue needs every feature {max_dim} wide and at most 256 wide")
    launch(_collection_fwd_kernel)[(F * B, cdiv(max_dim, cfg["BLOCK_D"]))](
        weights, values, offsets, psw, status, meta, out, B, out.stride(0), meta.stride(0), ln_w, ln_b, float(eps),
        HAS_PSW=psw is not None,
        WSUM=psw is not None and weight_sums, SKIP=skips, STATUS=status is not None, VEC=vec,
        FULL=cfg["BLOCK_D"] == max_dim and one_width(meta, total_dim, max_dim),
        EPILOGUE=epilogue is not None, ACT=ACTIVATIONS.index(act),
        HAS_LW=ln_w is not None, HAS_LB=ln_b is not None, **cfg)
    return out


def collection_backward(grad, values, offsets, psw, meta, src_meta, layout: Layout, B, num_elements, scaled=True,
                        weight_sums=True, status=None, skips=False, tail=False):
    """Gradient of the flat weight buffer (dense), by one segment reduction (src_meta, scaled,
    weight_sums and tail: Plan's)."""
    out = torch.zeros(num_elements, dtype=grad.dtype, device=grad.device)
    if values.numel() == 0:
        return out
    keys, bag, scale = backward_inputs(values, offsets, psw, meta, B, wide_keys=layout.wide_keys, scaled=scaled,
                                       weight_sums=weight_sums, status=status, kernel=True, skips=skips, tail=tail)
    grad = grad.contiguous()  # (a column slice of a wider output, as torch.cat's backward gives, is strided)
    return reduce_segments(keys, layout, grad, out, src_row=bag, scale=scale, src_stride=grad.stride(0), src_bags=B,
                           src_meta=src_meta)


def one_width_rows(values, keys, bag, meta, B, D, slots):
    """For a collection whose features share one width D, each value's global row in the flat
    buffer seen as one (rows, D) table (-1 where no bag pools it: `keys` < 0), and its row of the
    pooled output seen as B * `slots` rows of D (feature f's block at column OUT_COL[f])."""
    feature = bag // max(B, 1)
    ids = torch.where(keys >= 0, meta[:, ROW_START][feature] + values.long(), -1)
    return ids, (bag % max(B, 1)) * slots + meta[:, OUT_COL][feature] // D


def feature_grad_rows(grad, values, keys, bag, scale, meta_rows, B, acc):
    """Per feature f (meta_rows[f]: its meta row as ints), the ids of its values that a bag pools
    and their gradient rows, scaled, in `acc`: what the CPU's eager backward and mixed-width fused
    update add or sum into f's table (ids < 0 touch no row)."""
    feature = bag // max(B, 1)
    for f, m in enumerate(meta_rows):
        at = ((feature == f) & (keys >= 0)).nonzero()[:, 0]
        rows = grad[bag[at] % max(B, 1), m[OUT_COL]:m[OUT_COL] + m[DIM]].to(acc)
        yield f, values[at].long(), rows if scale is None else rows * scale[at][:, None]


def feature_native_backward(grad, values, offsets, psw, meta, B, num_elements, scaled=True):
    """The eager CPU backward of any widths (it compacts by feature, a host read): each feature's
    scaled gradient rows added into its table's view of the flat gradient. Faster than
    collection_native_backward at one width too (benchmarks/NOTES.md, session 30)."""
    acc = accumulation(grad)
    keys, bag, scale = backward_inputs_reference(values, offsets, psw, meta, B, dtype=acc, scaled=scaled)
    out, meta_rows = torch.zeros(num_elements, dtype=acc), meta.tolist()
    for f, ids, rows in feature_grad_rows(grad, values, keys, bag, scale, meta_rows, B, acc):
        m = meta_rows[f]
        table_view(out, m[ELEM_START], m[ROWS], m[DIM]).index_add_(0, ids, rows)
    return out.to(grad.dtype)


def collection_native_backward(grad, values, offsets, psw, meta, B, num_elements, max_dim, scaled=True):
    """The traced CPU backward of features of one width D (no host read): one table's dense
    reduction over the flat buffer seen as (rows, D), each value's gradient row scaled into its
    global row (rows, not the reference's elements)."""
    D = max_dim
    keys, bag, scale = backward_inputs_reference(values, offsets, psw, meta, B, dtype=accumulation(grad),
                                                 scaled=scaled)
    ids, src_row = one_width_rows(values, keys, bag, meta, B, D, grad.shape[1] // D)
    return segment_grad_reference(ids, grad.reshape(-1, D), src_row, scale, num_elements // D, -1, False,
                                  grad.dtype).reshape(-1)


def collection_backward_reference(grad, values, offsets, psw, meta, B, num_elements, max_dim):
    """Pure torch: every value's scaled gradient row added into its table row."""
    acc = accumulation(grad)
    w_at, o_at, factor, inside = _elements(values, offsets, psw, meta, B, grad.shape[1], max_dim, acc)
    out = index_sum(num_elements, w_at.reshape(-1),
                    torch.where(inside, grad.to(acc).reshape(-1)[o_at] * factor, 0).reshape(-1))
    return out.to(grad.dtype)


def one_width(meta: Tensor, total_dim: int, max_dim: int) -> bool:
    """Whether every feature has the widest width (then the flat buffer is one (rows, D) table)."""
    return meta.shape[0] * max_dim == total_dim


def _feature_runs(values, offsets, psw, B):
    """What the per-feature CPU paths slice: (values, held offsets (bags.held_offsets), weights)
    with ids < 0 (ops/safe.py) left out and the offsets renumbered over the rest, and the
    F + 1 first values of each feature's run (host ints)."""
    offsets = held_offsets(offsets, values.numel())
    named = values >= 0
    if not bool(named.all()):  # (left out, not weighted 0: 0 * an inf row is NaN)
        before = torch.cat([named.new_zeros(1, dtype=torch.int64), named.long().cumsum(0)])
        offsets, values = before[offsets], values[named]
        psw = None if psw is None else psw[named]
    return values, offsets, psw, offsets[::B].tolist()


def _one_call(weights, values, offsets, psw, meta_rows, native, B, starts):
    """collection_native's output from one native call over the flat buffer as one (rows, D)
    table, each feature's ids moved to its table's first row, where every feature has width D,
    one mode (torch's own mean, or a sum that no norm divides) and the columns f * D on; else
    None. (B, F, D) pooled rows then transposed into (B, F * D): small batches only, where the F
    calls' overhead outweighs that copy (tuning.CPU_ONE_CALL_OUTPUT)."""
    D, F = meta_rows[0][DIM], len(meta_rows)
    if (any(m[DIM] != D or m[ELEM_START] % D or m[OUT_COL] != f * D for f, m in enumerate(meta_rows))
            or len(set(native)) > 1 or (not native[0] and any(m[POOL] != SUM for m in meta_rows)) or starts[0]):
        return None
    # (only the features' runs: a staged batch holds values past them, which torch's last bag
    # would take, running to the end of the ids with include_last_offset; an unchecked first
    # offset past 0, which torch refuses, takes the calls a feature)
    n = starts[-1]
    first_rows = torch.tensor([m[ELEM_START] // D for m in meta_rows])
    ids = values[:n].long() + first_rows.repeat_interleave(torch.tensor(starts).diff(), output_size=n)
    pooled = torch.embedding_bag(weights.view(-1, D), ids, offsets.long(), False, 1 if native[0] else 0, False,
                                 None if psw is None else psw[:n].to(weights.dtype), True)[0]
    return pooled.view(F, B, D).transpose(0, 1).reshape(B, F * D)


def collection_native(weights, values, offsets, psw, meta, B, total_dim, max_dim):
    """The CPU path of fp32 and fp64 tables (eager: it reads the feature starts): per feature,
    torch's native embedding_bag over its table's (rows, dim) view of the flat buffer, written
    into the feature's columns. Its mean where that is embfuse's (no weights: the sum over the
    count, 0 for an empty bag); else its sum in the table's dtype, as the reference, each bag then
    divided by its norm (bags.py)."""
    out = weights.new_zeros(B, total_dim)
    if B == 0:
        return out
    meta_rows, norm = meta.tolist(), None
    native = [m[POOL] == MEAN and psw is None for m in meta_rows]  # (torch's own mean)
    if any(m[POOL] in SCALED and not own for m, own in zip(meta_rows, native)):  # (a sum's norm is 1)
        _, _, norm, _ = bag_norms_reference(values, offsets, psw, meta, B, dtype=accumulation(weights))
    values, offsets, psw, starts = _feature_runs(values, offsets, psw, B)
    if norm is None and B * total_dim < tuning.CPU_ONE_CALL_OUTPUT:
        one = _one_call(weights, values, offsets, psw, meta_rows, native, B, starts)
        if one is not None:
            return one
    for f, m in enumerate(meta_rows):
        a, b = starts[f], starts[f + 1]
        table = table_view(weights, m[ELEM_START], m[ROWS], m[DIM])
        pooled = torch.nn.functional.embedding_bag(
            values[a:b], table, offsets[f * B:(f + 1) * B + 1] - a, mode="mean" if native[f] else "sum",
            include_last_offset=True, per_sample_weights=None if psw is None else psw[a:b].to(table.dtype))
        if m[POOL] in SCALED and not native[f]:
            pooled = divide_reference(pooled, norm[f * B:(f + 1) * B])
        out[:, m[OUT_COL]:m[OUT_COL] + m[DIM]] = pooled
    return out


def pool_collection(weights, values, offsets, psw, plan, B, status=None):
    """The forward without the op's dispatch: kernel, native or reference by device."""
    meta, total_dim, max_dim = plan.meta, plan.total_dim, plan.max_dim
    if use_kernels(weights) and weights.dtype != torch.float64:
        return collection_forward(weights, values, offsets, psw, meta, B, total_dim, max_dim, plan.layout.vec,
                                  status=status, weight_sums=plan.weight_sums, skips=plan.skips)
    return _pool_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim, status)


def _pool_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim, status):
    if status is None and torch_cpu(weights) and not tracing():
        return collection_native(weights, values, offsets, psw, meta, B, total_dim, max_dim)
    if status is not None:
        values, offsets = guard_bags(values, offsets, status)
        return collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim) * (status[0] == 0)
    return collection_reference(weights, values, offsets, psw, meta, B, total_dim, max_dim)


def _collection_body(weights: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                     status: Optional[Tensor], meta: Tensor, src_meta: Tensor, B: int, total_dim: int, max_dim: int,
                     vec: int, wide_keys: bool, scaled: bool, weight_sums: bool, skips: bool, tail: bool) -> Tensor:
    if use_kernels(weights) and weights.dtype != torch.float64:
        return collection_forward(weights, values, offsets, per_sample_weights, meta, B, total_dim, max_dim, vec,
                                  status=status, weight_sums=weight_sums, skips=skips)
    return _pool_reference(weights, values, offsets, per_sample_weights, meta, B, total_dim, max_dim, status)


_collection_op = kernel_op("embfuse::embedding_bag_collection")(_collection_body)


@_collection_op.register_fake
def _(weights, values, offsets, per_sample_weights, status, meta, src_meta, B, total_dim, max_dim, vec, wide_keys,
      scaled, weight_sums, skips, tail):
    return weights.new_empty(B, total_dim)


def _collection_backward_body(grad: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                              status: Optional[Tensor], meta: Tensor, src_meta: Tensor, B: int, num_elements: int,
                              max_dim: int, vec: int, wide_keys: bool, scaled: bool, weight_sums: bool,
                              skips: bool, tail: bool) -> Tensor:
    if use_kernels(grad) and grad.dtype != torch.float64:
        layout = Layout(max_dim, vec, wide_keys)
        return collection_backward(grad, values, offsets, per_sample_weights, meta, src_meta, layout, B,
                                   num_elements, scaled, weight_sums, status, skips, tail)
    if status is not None:
        values, offsets = guard_bags(values, offsets, status)
        grad = grad * (status[0] == 0)
    if grad.device.type == "cpu" and not tracing():
        return feature_native_backward(grad, values, offsets, per_sample_weights, meta, B, num_elements, scaled)
    if grad.device.type == "cpu" and max_dim > 0 and one_width(meta, grad.shape[1], max_dim):  # (traced: no host read)
        return collection_native_backward(grad, values, offsets, per_sample_weights, meta, B, num_elements, max_dim,
                                          scaled)
    return collection_backward_reference(grad, values, offsets, per_sample_weights, meta, B, num_elements, max_dim)


_collection_backward_op = kernel_op("embfuse::embedding_bag_collection_backward")(_collection_backward_body)


@_collection_backward_op.register_fake
def _(grad, values, offsets, per_sample_weights, status, meta, src_meta, B, num_elements, max_dim, vec, wide_keys,
      scaled, weight_sums, skips, tail):
    return grad.new_empty(num_elements)


def _setup_context(ctx, inputs, output):
    (weights, values, offsets, psw, status, meta, src_meta, B, total_dim, max_dim, vec, wide_keys, scaled,
     weight_sums, skips, tail) = inputs
    ctx.save_for_backward(values, offsets, psw, status, meta, src_meta)
    ctx.args = (B, weights.numel(), max_dim, vec, wide_keys, scaled, weight_sums, skips, tail)


def _autograd_backward(ctx, grad):
    values, offsets, psw, status, meta, src_meta = ctx.saved_tensors
    g = None
    if ctx.needs_input_grad[0]:
        dense = _collection_backward_op if backward_needs_op(grad) else _collection_backward_body
        g = dense(grad, values, offsets, psw, status, meta, src_meta, *ctx.args)
    return (g,) + (None,) * 15


_collection_op.register_autograd(_autograd_backward, setup_context=_setup_context)
_eager_collection = eager_autograd(_collection_body, _setup_context, _autograd_backward)


def _layer_norm_body(weights, values, offsets, per_sample_weights, status, meta, ln_weight, ln_bias, B, total_dim,
                     max_dim, vec, weight_sums, skips, eps, activation):
    if use_kernels(weights) and weights.dtype != torch.float64:
        return collection_forward(weights, values, offsets, per_sample_weights, meta, B, total_dim, max_dim, vec,
                                  status=status, weight_sums=weight_sums,
                                  epilogue=(ln_weight, ln_bias, eps, activation), skips=skips)
    x = _pool_reference(weights, values, offsets, per_sample_weights, meta, B, total_dim, max_dim, status)
    return layer_norm_act_reference(x.view(B, -1, max_dim), ln_weight, ln_bias, eps, activation).view(B, total_dim)


@kernel_op("embfuse::embedding_bag_collection_layer_norm", mutates_args=())
def _collection_layer_norm_op(weights: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                              status: Optional[Tensor], meta: Tensor, ln_weight: Optional[Tensor],
                              ln_bias: Optional[Tensor], B: int, total_dim: int, max_dim: int, vec: int,
                              weight_sums: bool, skips: bool, eps: float, activation: str) -> Tensor:
    return _layer_norm_body(weights, values, offsets, per_sample_weights, status, meta, ln_weight, ln_bias, B,
                            total_dim, max_dim, vec, weight_sums, skips, eps, activation)


@_collection_layer_norm_op.register_fake
def _(weights, values, offsets, per_sample_weights, status, meta, ln_weight, ln_bias, B, total_dim, max_dim, vec,
      weight_sums, skips, eps, activation):
    return weights.new_empty(B, total_dim)


def collection_layer_norm(weights: Tensor, values: Tensor, offsets: Tensor, psw: Optional[Tensor], plan: Plan, B: int,
                          status: Optional[Tensor], ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], eps: float,
                          activation: str) -> Tensor:
    """For inference (no autograd): the pooled lookup, each pooled row leaving through LayerNorm
    (ln_weight, ln_bias: (F, D) or None) + `activation`; in the pooling kernel's epilogue on a
    GPU (every feature D wide, D <= 256). An op under tracing (torch.compile keeps it in its
    graph); eager calls skip the op's dispatch."""
    run = _collection_layer_norm_op if tracing() else _layer_norm_body
    return run(weights, values, offsets, psw, status, plan.meta, ln_weight, ln_bias, B, plan.total_dim, plan.max_dim,
               plan.layout.vec, plan.weight_sums, plan.skips, float(eps), activation)


def embedding_bag_collection(weights: Tensor, values: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                             plan: Plan, B: int, status: Optional[Tensor] = None) -> Tensor:
    """Pooled lookup of every feature (checked input, canonical offsets); (B, plan.total_dim).
    `status`: the batch's deferred check (validate_collection), or None."""
    if per_sample_weights is not None and per_sample_weights.requires_grad:
        raise ValueError("per-sample weights of a collection get no gradient; detach them")
    if needs_op(weights):
        L = plan.layout
        run = _collection_op if tracing() else _eager_collection
        return run(weights, values, offsets, per_sample_weights, status, plan.meta, plan.src_meta, B, plan.total_dim,
                   plan.max_dim, L.vec, L.wide_keys, plan.scaled, plan.weight_sums, plan.skips, plan.tail)
    return pool_collection(weights, values, offsets, per_sample_weights, plan, B, status)
