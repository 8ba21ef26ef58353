"""Backward fused with the optimizer: the gradient never materialises as a dense table.

The ids are sorted and each run of equal ids reduced in a fixed order (ops/segments.py: tiles
of sorted positions, then level by level the runs that cross tiles); the program that finishes
a row's gradient reads the row's weight and state, applies the rule and writes them back. In
place, deterministic, no atomic sums.
"""

from __future__ import annotations

import torch

from embfuse._triton import tl, triton, use_kernels
from embfuse.ops.bags import accumulation, backward_inputs, backward_inputs_reference
from embfuse.ops.collection import feature_grad_rows, one_width, one_width_rows, table_view
from embfuse.ops.deferred import known_good
from embfuse.ops.validate import check_fused_table
from embfuse.ops.segments import (Layout, Segments, columns, next_level, row_sums_reference, segment_rows,
                                  single_table)
from embfuse.ops import tuning
from embfuse.optim.rules import (K_ADAGRAD_KIND, K_HYPER_STEP, K_ROWWISE_ADAGRAD_KIND, K_SGD_KIND, GraphStep, Hyper,
                                  joined, stochastic_round_reference)


def apply_sparse_update_reference(weight, state, optimizer, ids, src, src_row, scale, step, padding_idx=-1):
    """Pure torch: sum the gradient rows per distinct id (in input order), update those rows."""
    step, acc = joined(step), accumulation(weight)
    touched, g, _ = row_sums_reference(ids, src, src_row, scale, padding_idx, acc)
    w, st = optimizer.update(weight[touched].to(acc), g, {k: v[touched].to(acc) for k, v in state.items()}, step)
    with torch.no_grad():
        weight[touched] = stochastic_round_reference(w, weight.dtype, optimizer.dropped_bits(weight.dtype), step)
        for k, v in st.items():
            state[k][touched] = v.to(state[k].dtype)


@triton.jit
def _halves(x, BLOCK_K: tl.constexpr):
    """The first and the last BLOCK_K // 2 entries of a [BLOCK_K] vector."""
    return tl.split(tl.permute(tl.reshape(x, [2, BLOCK_K // 2]), [1, 0]))


@triton.jit
def _row_halves(x, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """The first and the last BLOCK_K // 2 rows of a [BLOCK_K, BLOCK_D] tile: with one warp a
    128 columns every row of a column sits in one thread, so this renames registers."""
    return tl.split(tl.permute(tl.reshape(x, [2, BLOCK_K // 2, BLOCK_D]), [1, 2, 0]))


@triton.jit
def _rowwise_state(state1, row, done, g, D):
    """Row-wise Adagrad's accumulator of the rows `done`, fed the mean of g^2 over each row,
    written back and returned."""
    s = tl.load(state1 + row, mask=done, other=0.0) + tl.sum(g * g, axis=1) / tl.maximum(D, 1).to(tl.float32)
    tl.store(state1 + row, s, mask=done)
    return s


@triton.jit
def _update_rows(weight, state1, state2, g, rate, row, D, base, done, hp, seed, VEC: tl.constexpr,
                 BLOCK_D: tl.constexpr, KIND: tl.constexpr, WD: tl.constexpr, DROP: tl.constexpr):
    """Apply the rule to the rows `done` of a group: g their summed gradients, base their first
    weight element (element-wise state shares the weights' layout), row their global row, hp the
    step's Hyper. For row-wise Adagrad without weight decay (WD), `rate` is each row's step size,
    already taken (its state already written)."""
    cols = columns(BLOCK_D)
    m = done[:, None] & ((cols // VEC)[None, :] < (D // VEC)[:, None])
    # the 16-byte groups restated: Triton loses them when `base` went through a split
    at = tl.max_contiguous(tl.multiple_of(base[:, None] + cols[None, :], [1, VEC]), [1, VEC])
    w = tl.load(weight + at, mask=m, other=0.0).to(tl.float32)
    if WD:
        g = g + hp.weight_decay * w
    if KIND == K_SGD_KIND:
        w = w - hp.lr * g
    elif KIND == K_ADAGRAD_KIND:
        s = tl.load(state1 + at, mask=m, other=0.0) + g * g
        tl.store(state1 + at, s, mask=m)
        w = w - hp.lr * g / (tl.sqrt(s) + hp.eps)
    elif KIND == K_ROWWISE_ADAGRAD_KIND:  # one value per global row; whole rows are in this program
        if WD:
            w = w - hp.lr * g / (tl.sqrt(_rowwise_state(state1, row, done, g, D))[:, None] + hp.eps)
        else:
            w = w - rate[:, None] * g
    else:  # Adam; lr arrives divided by the first bias correction
        mo = tl.load(state1 + at, mask=m, other=0.0)
        mo = mo + hp.one_minus_beta1 * (g - mo)
        v = tl.load(state2 + at, mask=m, other=0.0)
        v = v + hp.one_minus_beta2 * (g * g - v)
        tl.store(state1 + at, mo, mask=m)
        tl.store(state2 + at, v, mask=m)
        w = w - hp.lr * mo / (tl.sqrt(v) / hp.bc2_sqrt + hp.eps)
    if DROP > 0:  # stochastic rounding: DROP random bits added below the stored precision, then cut
        noise = tl.randint(seed, at) >> (32 - DROP)  # uint32 throughout: shifts keep the type
        w = (((w.to(tl.uint32, bitcast=True) + noise) >> DROP) << DROP).to(tl.float32, bitcast=True)
    tl.store(weight + at, w.to(weight.dtype.element_ty), mask=m)


@triton.jit
def _update_halves(weight, state1, state2, g, rate, row, D, base, done, hp, seed, VEC: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, WD: tl.constexpr,
                   DROP: tl.constexpr, QUARTERS: tl.constexpr):
    """`_update_rows` on each half of the rows in turn (on each quarter if QUARTERS)."""
    g0, g1 = _row_halves(g, BLOCK_K, BLOCK_D)
    q0, q1 = _halves(rate, BLOCK_K)
    r0, r1 = _halves(row, BLOCK_K)
    d0, d1 = _halves(D, BLOCK_K)
    b0, b1 = _halves(base, BLOCK_K)
    k0, k1 = _halves(done, BLOCK_K)
    if QUARTERS:
        _update_halves(weight, state1, state2, g0, q0, r0, d0, b0, k0, hp, seed, VEC, BLOCK_K // 2, BLOCK_D, KIND,
                       WD, DROP, False)
        _update_halves(weight, state1, state2, g1, q1, r1, d1, b1, k1, hp, seed, VEC, BLOCK_K // 2, BLOCK_D, KIND,
                       WD, DROP, False)
    else:
        _update_rows(weight, state1, state2, g0, q0, r0, d0, b0, k0, hp, seed, VEC, BLOCK_D, KIND, WD, DROP)
        _update_rows(weight, state1, state2, g1, q1, r1, d1, b1, k1, hp, seed, VEC, BLOCK_D, KIND, WD, DROP)


@triton.jit
def _update_tile(
    keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info, tile, at,
    weight, state1, state2, hp, seed,
    FIRST: tl.constexpr, HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr,
    COUNT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROW_D: tl.constexpr,
    KIND: tl.constexpr, WD: tl.constexpr, DROP: tl.constexpr, QUARTERS: tl.constexpr,
):
    # (the entries loaded and their rows found here, before the sums: see ops/segments.py _grad_tile)
    j = tile.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    if FIRST:
        key = tl.load(keys + j, mask=j < n, other=-1)
        p = tl.load(perm + j, mask=j < n, other=0)
        if HAS_SRC_ROW:
            bag = tl.load(src_row + p, mask=j < n, other=0).to(tl.int64)
        else:
            bag = p
        f = bag // src_bags
    else:
        key = tl.load(up_keys + at + j, mask=j < n, other=-1, cache_modifier=".cg")
        p = j
        bag = j
        f = tl.load(up_info + 2 * (at + j), mask=j < n, other=0, cache_modifier=".cg").to(tl.int64)
    # the row's width, first element and global row
    D = tl.load(src_meta + 4 * f + 1, mask=j < n, other=0)
    base = tl.multiple_of(tl.load(src_meta + 4 * f + 2, mask=j < n, other=0) + key * D, VEC)
    row = tl.load(src_meta + 4 * f + 3, mask=j < n, other=0) + key
    g, cnt, done = segment_rows(
        keys, key, p, bag, f, D, n, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info, tile,
        at, FIRST, HAS_SCALE, COUNT, VEC, BLOCK_K, BLOCK_D, ROW_D)
    # row-wise Adagrad without weight decay needs only g for its state and step size: taken
    # here, on the whole tile, they cost fewer registers than in each group (ptxas: 120 bytes
    # of spills against 388 in halves)
    if KIND == K_ROWWISE_ADAGRAD_KIND and not WD:
        rate = hp.lr / (tl.sqrt(_rowwise_state(state1, row, done, g, D)) + hp.eps)
    else:
        rate = tl.zeros([BLOCK_K], dtype=tl.float32)
    # the rows updated a half (QUARTERS: a quarter) at a time: the summed rows, the weights and
    # the state of the whole tile do not fit in registers together (see tuning.update_in_quarters)
    _update_halves(weight, state1, state2, g, rate, row, D, base, done, hp, seed, VEC, BLOCK_K, BLOCK_D, KIND, WD, DROP,
                   QUARTERS)


# the seed is the step number, and n, src_bags (a plain lookup's count of ids), at and levels a
# batch's counts: specialising on them (1, multiples of 16) compiled new variants in the middle
# of training, about half a second each (as for every kernel that takes a batch's count of
# values or of examples, B and FB; benchmarks/NOTES.md, sessions 63 and 65)
@triton.jit(do_not_specialize=["seed", "n", "src_bags", "at", "levels"])
def _fused_update_kernel(
    keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info, counters,
    at, levels, weight, state1, state2, lr, eps, weight_decay, one_minus_beta1, one_minus_beta2, bc2_sqrt, seed,
    graph_hyper,
    FIRST: tl.constexpr, HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr,
    COUNT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROW_D: tl.constexpr,
    KIND: tl.constexpr, WD: tl.constexpr, DROP: tl.constexpr, QUARTERS: tl.constexpr, GRAPH_HYPER: tl.constexpr,
):
    if GRAPH_HYPER:  # a CUDA graph's step: the hyper-parameters and the step from its float64 copy (rules.graph_hyper)
        lr = tl.load(graph_hyper).to(tl.float32)
        eps = tl.load(graph_hyper + 1).to(tl.float32)
        weight_decay = tl.load(graph_hyper + 2).to(tl.float32)
        one_minus_beta1 = tl.load(graph_hyper + 3).to(tl.float32)
        one_minus_beta2 = tl.load(graph_hyper + 4).to(tl.float32)
        bc2_sqrt = tl.load(graph_hyper + 5).to(tl.float32)
        seed = tl.load(graph_hyper + K_HYPER_STEP).to(tl.int32)
    hp = Hyper(lr, eps, weight_decay, one_minus_beta1, one_minus_beta2, bc2_sqrt)
    if FIRST:
        _update_tile(keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info,
                     tl.program_id(0), 0, weight, state1, state2, hp, seed, FIRST, HAS_SRC_ROW,
                     HAS_SCALE, COUNT, VEC, BLOCK_K, BLOCK_D, ROW_D, KIND, WD, DROP, QUARTERS)
    else:  # upper levels, `levels` of them from entry `at` (ops/segments.py Segments.launch)
        # (every loop-carried value a tensor of n's width: Inductor passes a 1, n's too, as a constant)
        zero = tl.program_id(0) * 0 + n * 0
        tile, ctr, n, at, levels = tl.program_id(0), zero, n + zero, at + zero, levels + zero
        go = levels > 0
        while go:
            _update_tile(keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals,
                         up_info, tile, at, weight, state1, state2, hp, seed, FIRST, HAS_SRC_ROW,
                         HAS_SCALE, COUNT, VEC, BLOCK_K, BLOCK_D, ROW_D, KIND, WD, DROP, QUARTERS)
            go, tile, n, at, ctr, levels = next_level(counters, tile, n, at, ctr, levels, BLOCK_K)


def fused_update(weight, states, optimizer, keys, layout: Layout, src, step, **src_args):
    """Kernel form for any layout: `weight` and element-wise state are flat buffers laid out as
    `layout`, row-wise state has one value per global row; keys are global rows or -1."""
    if keys.numel() == 0 or layout.max_dim == 0:
        return
    states = list(states) + [None] * (2 - len(states))  # (never read)
    # `step` a GraphStep (or its tensor): a CUDA graph's copy of the hyper-parameters and step
    # (FusedOptimizer.stepping), read once the sort below has run beside the ops that advance it
    graph = isinstance(step, (GraphStep, torch.Tensor))
    hyper = optimizer.hyper(1 if graph else step)
    segments = Segments(keys, layout, src, **src_args)
    columns = tuning.update_columns(optimizer.element_states)
    step = joined(step)
    segments.launch(
        _fused_update_kernel, weight, states[0], states[1], *hyper, 0 if graph else step, step if graph else None,
        KIND=optimizer.kind, WD=hyper.weight_decay != 0, DROP=optimizer.dropped_bits(weight.dtype), columns=columns,
        QUARTERS=tuning.update_in_quarters(optimizer.element_states, segments.width(columns)), GRAPH_HYPER=graph)


def apply_sparse_update(weight, state, optimizer, ids, src, src_row=None, scale=None, step=1, padding_idx=-1,
                        kernel=None):
    """Update `weight` (and `state`) in place from per-position gradients.

    ids[p]: the row position p updates (-1: none); its gradient is src[src_row[p]] * scale[p]
    (src_row None: src[p]; scale None: 1). Duplicates are summed before the update. `step` is
    the optimizer step (from 1) for learning-rate schedules and bias corrections. `kernel`
    forces the Triton kernel (True, e.g. interpreted on the CPU in tests) or the reference.
    """
    if kernel is None:
        kernel = use_kernels(weight) and weight.dtype != torch.float64
    if not kernel:
        return apply_sparse_update_reference(weight, state, optimizer, ids, src, src_row, scale, step, padding_idx)
    check_fused_table(weight)
    if padding_idx >= 0:
        ids = torch.where(ids == padding_idx, -1, ids)
    fused_update(weight, list(state.values()), optimizer, ids, single_table(*weight.shape, weight.device),
                 src.contiguous(), step, src_row=src_row, scale=scale)
    return None


def _one_width_update(weights, state, optimizer, values, offsets, psw, plan, B, grad, step, acc):
    """The CPU update of a collection whose features share one width D: the flat buffer and its
    element state as one (rows, D) table, every value's gradient row gathered at once, one update
    of all touched rows (not a pass a table)."""
    D, meta = plan.max_dim, plan.meta
    keys, bag, scale = backward_inputs_reference(values, offsets, psw, meta, B, dtype=acc, scaled=plan.scaled)
    ids, src_row = one_width_rows(values, keys, bag, meta, B, D, grad.shape[1] // max(D, 1))
    per = optimizer.state_spec()
    views = {k: v.view(-1, D) if per[k][0] == "element" else v for k, v in state.items()}
    apply_sparse_update_reference(weights.view(-1, D), views, optimizer, ids, grad.reshape(-1, D), src_row, scale,
                                  step)


def collection_update(weights, state, optimizer, values, offsets, psw, plan, B, grad, step, kernel=None,
                      status=None):
    """A fused update of a table collection's flat `weights` (and flat `state`) from the
    gradient of its pooled output: one sort and the reduction's launches for every table. `status`:
    the batch's deferred check (ops/validate.py); a bad batch updates nothing."""
    if kernel is None:
        kernel = use_kernels(weights) and weights.dtype != torch.float64
    if kernel:
        keys, bag, scale = backward_inputs(values, offsets, psw, plan.meta, B, wide_keys=plan.layout.wide_keys,
                                           scaled=plan.scaled, weight_sums=plan.weight_sums, status=status,
                                           kernel=True, skips=plan.skips, tail=plan.tail)
        grad = grad.contiguous()
        fused_update(weights, list(state.values()), optimizer, keys, plan.layout, grad, step, src_row=bag,
                     scale=scale, src_stride=grad.stride(0), src_bags=B, src_meta=plan.src_meta)
        return
    if not known_good(status):
        return
    acc = accumulation(weights)
    if one_width(plan.meta, plan.total_dim, plan.max_dim):
        return _one_width_update(weights, state, optimizer, values, offsets, psw, plan, B, grad, step, acc)
    # reference: per table, the gradient rows of all its features, then one update
    keys, bag, scale = backward_inputs_reference(values, offsets, psw, plan.meta, B, dtype=acc, scaled=plan.scaled)
    by_table = {}
    for f, ids, rows in feature_grad_rows(grad, values, keys, bag, scale, plan.rows, B, acc):
        by_table.setdefault(plan.feature_table[f], []).append((ids, rows))
    per = optimizer.state_spec()
    for t, parts in by_table.items():
        rows, dim, elem, row = plan.tables[t]
        views = {k: v[row:row + rows] if per[k][0] == "row" else table_view(v, elem, rows, dim)
                 for k, v in state.items()}
        apply_sparse_update_reference(table_view(weights, elem, rows, dim), views, optimizer,
                                      torch.cat([i for i, _ in parts]), torch.cat([r for _, r in parts]), None,
                                      None, step)
