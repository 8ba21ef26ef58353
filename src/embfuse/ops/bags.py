"""Bags, in one place: pooling modes, a value's bag, pooling a bag, and the backward's inputs.

A batch is F * B bags, feature-major (feature f's B bags, then feature f + 1's), over one array
of values; bag g = f * B + b holds values[offsets[g] : offsets[g + 1]] of feature f. A single
table is the case F = 1. Each bag pools its rows (padding ids left out) as

    out[b, f] = (sum over p in bag g of w[p] * row_f(values[p])) / norm(g)

with w = per-sample weights or 1, and norm by the feature's pooling mode: 1 (sum), the count of
pooled ids (mean: torch's and TorchRec's, weighted or not), the square root of the sum of squared
weights (sqrtn: TensorFlow's combiner), the sum of the weights (wmean: TensorFlow's mean). Without
weights sqrtn is the square root of the count and wmean is mean. A norm of 0 (wmean's weights
summing to 0, TensorFlow's div_no_nan) gives zeros, as does an empty bag. Max pools per column
instead. The backward sends scale[p] = w[p] / norm(g) (0 where the norm is 0) times the bag's
output gradient to row values[p].

A pooling mode is one entry of POOLINGS plus one branch of `pool_norm` and of
`pool_norm_reference` (and, if its norm sums a term of each weight, of `weight_term`). What the
kernels know about a feature is its meta row (columns named below; the kernels read them as K_ +
the name); a single table is one row, `single_meta`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import cdiv, constexprs, launch, tl, tracing, triton, use_kernels
from embfuse.ops import tuning

SUM, MEAN, MAX, SQRTN, WMEAN = 0, 1, 2, 3, 4
POOLINGS = {"sum": SUM, "mean": MEAN, "max": MAX, "sqrtn": SQRTN, "wmean": WMEAN}
SCALED = (MEAN, SQRTN, WMEAN)  # modes whose backward scales each value by 1 / norm
# an id no bag pools: ops/safe.py writes it for the entries TensorFlow's safe lookups drop
SKIPPED = -1
# what a bag leaves out (no row read, no gradient), the kernels' PADDING: nothing, torch's
# padding_idx, or every id < 0 (a batch that `skips`: SKIPPED, and the ids < 0 TensorFlow drops,
# left as they came)
NO_PADDING, PADDING_ID, NEGATIVE_IDS = range(3)
WEIGHT_SUMS = (SQRTN, WMEAN)  # modes whose norm sums a term of each weight (weight_term)

# columns of a feature's meta row: first element of its table in the flat buffer, width, first
# output column, pooling mode, first global row, rows, sort key of the table's row 0 (see
# segments.Layout)
ELEM_START, DIM, OUT_COL, POOL, ROW_START, ROWS, KEY_START = range(7)
META_COLUMNS = 7
# the kernels' copies (see _triton.constexprs)
K_SUM, K_MEAN, K_MAX, K_SQRTN, K_WMEAN, K_SKIPPED = constexprs(SUM, MEAN, MAX, SQRTN, WMEAN, SKIPPED)
K_NO_PADDING, K_PADDING_ID, K_NEGATIVE_IDS = constexprs(NO_PADDING, PADDING_ID, NEGATIVE_IDS)
K_ELEM_START, K_DIM, K_OUT_COL, K_POOL, K_ROW_START, K_ROWS, K_KEY_START = constexprs(*range(META_COLUMNS))
K_UNROLL_COLUMNS, K_UNROLL_STEPS = constexprs(*tuning.WEIGHTED_UNROLL)
K_COUNT_BLOCK = constexprs(tuning.PADDING_COUNT_BLOCK)[0]


def _single_meta(rows: int, dim: int, mode: int, device) -> Tensor:
    return torch.tensor([[0, dim, 0, mode, 0, rows, 0]], dtype=torch.int64, device=device)


_single_meta_cached = functools.lru_cache(maxsize=256)(_single_meta)


def single_meta(rows: int, dim: int, mode: int, device) -> Tensor:
    """The meta row of one (rows, dim) table pooled by `mode` (cached in eager code)."""
    return _single_meta(rows, dim, mode, device) if tracing() else _single_meta_cached(rows, dim, mode, device)


def accumulation(t) -> torch.dtype:
    """The dtype sums over `t` (a tensor, or a dtype) are taken in: float64 for float64, else float32."""
    return torch.float64 if getattr(t, "dtype", t) == torch.float64 else torch.float32


# torch's ATen numbers of the modes whose CPU kernels follow embfuse's rules
TORCH_MODES = {SUM: 0, MEAN: 1, MAX: 2}


def torch_cpu(weight: Tensor, mode: int = SUM) -> bool:
    """Whether torch's own CPU kernels follow embfuse's rules for a lookup of `weight` pooled by
    `mode` (plain rows: SUM): fp32 / fp64 CPU tables, summed in their own dtype as embfuse sums,
    and torch's modes. They pool (embedding_bag._torch_pool), and run the eager calls autograd
    records (validate.torch_records)."""
    return weight.device.type == "cpu" and mode in TORCH_MODES and weight.dtype == accumulation(weight)


# ---- references (pure torch: the CPU path and the test oracle) ----

def bag_of_value(offsets: Tensor, n: int) -> Tensor:
    """Bag g of each of n values (int64): how many offsets lie at or before its position, less one
    (-1 before the first bag, FB after the last), which is searchsorted's answer for sorted
    offsets. No host read. The CPU counts the offsets and takes a prefix sum, O(n + FB), where
    searchsorted is O(n log FB); a GPU keeps searchsorted, three launches where the count takes
    six or seven, and small batches there are the host's time (benchmarks/NOTES.md, session 30)."""
    if offsets.device.type != "cpu":
        return torch.searchsorted(offsets, torch.arange(n, device=offsets.device, dtype=offsets.dtype), right=True) - 1
    starts = torch.zeros(n + 1, dtype=torch.int64)
    starts.index_add_(0, offsets.clamp(0, n).long(), torch.ones(offsets.shape, dtype=torch.int64))
    return starts[:n].cumsum(0) - 1


def index_sum(n: int, index: Tensor, src: Tensor) -> Tensor:
    """zeros(n, *src.shape[1:]).index_add_(0, index, src), in src's dtype, made in a buffer one
    row longer: Inductor's CPU code fails to compile a scatter-add into a buffer of one element
    (pytorch/pytorch#160391), which a traced batch of one bag, or a one-row table of width 1, is."""
    return src.new_zeros((n + 1, *src.shape[1:])).index_add_(0, index, src)[:n]


def held_offsets(offsets: Tensor, n: int) -> Tensor:
    """Offsets held inside [0, n] and non-decreasing: what torch's CPU embedding_bag may be given
    (it reads ids up to the last offset, and bounds_check="off" has checked none). A valid batch
    is unchanged."""
    return offsets.clamp(0, n).cummax(0).values


def pooled_values(values: Tensor, offsets: Tensor, padding_idx: int = -1) -> tuple[Tensor, Tensor]:
    """(mask of the values a bag pools: inside [offsets[0], offsets[-1]), not padding, not
    negative (ids < 0: what ops/safe.py leaves of the entries TensorFlow drops); each value's bag,
    clamped to the last)."""
    FB = offsets.numel() - 1
    bag = bag_of_value(offsets, values.numel())
    keep = (bag >= 0) & (bag < FB) & (values >= 0)
    if padding_idx >= 0:
        keep &= values != padding_idx
    return keep, bag.clamp(min=0, max=max(FB - 1, 0)).long()


def weight_term(pool, w):
    """What a weighted bag's norm sums of each weight: w^2 under sqrtn, w under wmean."""
    return torch.where(pool == SQRTN, w * w, w)


def pool_norm_reference(pool: Tensor, count: Tensor, wsum: Tensor) -> Tensor:
    """What each bag's sum is divided by (dtype of wsum): see the module's formula. `pool`: the
    bag's mode, `count`: its pooled ids, `wsum`: the sum of its weight terms (or its count).
    Only wmean's can be 0: `divide_reference` then gives 0."""
    one = torch.ones_like(wsum)
    norm = torch.where(pool == MEAN, count.clamp(min=1).to(wsum.dtype), one)
    norm = torch.where(pool == WMEAN, wsum, norm)
    return torch.where(pool == SQRTN, torch.where(wsum > 0, wsum.clamp(min=0).sqrt(), one), norm)


def divide_reference(x: Tensor, norm: Tensor) -> Tensor:
    """x / norm per bag (norm: one a row of x, or one an element), 0 where the norm is 0
    (TensorFlow's div_no_nan)."""
    norm = (norm[:, None] if norm.dim() == 1 else norm).to(x.dtype)
    return torch.where(norm != 0, x / torch.where(norm != 0, norm, 1), 0)


def bag_norms_reference(values, offsets, psw, meta, B, padding_idx=-1, dtype=torch.float32):
    """(mask of pooled values, each value's bag, each bag's norm in `dtype`, each bag's sum of
    weight terms: its count without weights)."""
    keep, bag = pooled_values(values, offsets, padding_idx)
    FB = offsets.numel() - 1
    pool = meta[:, POOL].repeat_interleave(max(B, 1))[:FB]
    count = index_sum(FB, bag, keep.long())
    wsum = count.to(dtype)
    if psw is not None:
        w = torch.where(keep, psw.to(dtype), 0)
        wsum = index_sum(FB, bag, weight_term(pool[bag], w))
    return keep, bag, pool_norm_reference(pool, count, wsum), wsum


def backward_inputs_reference(values, offsets, psw, meta, B, padding_idx=-1, dtype=torch.float32, scaled=True):
    """Per value: (sort key of its row: KEY_START + id, or -1 when no bag pools it; its bag;
    its scale w / norm in `dtype`, or None when every scale is 1: no weights and not `scaled`)."""
    scale = None
    if psw is not None or scaled:
        keep, bag, norm, _ = bag_norms_reference(values, offsets, psw, meta, B, padding_idx, dtype)
        scale = torch.where(norm[bag] != 0, 1.0 / norm[bag], 0)
        if psw is not None:
            scale = psw.to(dtype) * scale
    else:  # (every scale is 1: no norms)
        keep, bag = pooled_values(values, offsets, padding_idx)
    keys = torch.where(keep, meta[:, KEY_START][bag // max(B, 1)] + values.long(), -1)
    return keys, bag, scale


# ---- kernel building blocks ----

@triton.jit
def program_bags(FB, B, BAGS: tl.constexpr):
    """The BAGS bags (feature-major) of this program, side by side: (bag, in range, feature). A
    program a bag spent most of its time waiting on the offsets. Each kernel loads its bags'
    starts and ends itself: where a traced kernel stores at an address a called function
    returned, torch's analysis takes every tensor handed to that function as written, and
    Inductor copies it before the launch (torch 2.11: the user's offsets; under dynamic shapes
    that copy failed to compile, pytorch#181735; benchmarks/NOTES.md, session 42)."""
    g = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    return g, g < FB, g // B


@triton.jit
def pooled(ids, padding_idx, PADDING: tl.constexpr):
    """Whether a bag pools each of `ids` (PADDING: PADDING_ID or NEGATIVE_IDS; NO_PADDING pools
    every id and needs no test)."""
    if PADDING == K_NEGATIVE_IDS:
        keep = ids >= 0
    else:
        keep = ids != padding_idx
    return keep


def padding(padding_idx: int, skips: bool) -> int:
    """The kernels' PADDING of a batch with `padding_idx` (-1: none) that `skips` or not."""
    return NEGATIVE_IDS if skips else PADDING_ID if padding_idx >= 0 else NO_PADDING


@triton.jit
def pool_norm(pool, count, wsum):
    """`pool_norm_reference` in a kernel: fp32, IEEE square root."""
    one = tl.full(count.shape, 1.0, tl.float32)
    ws = wsum.to(tl.float32)
    sqrtn = tl.where(ws > 0, tl.sqrt_rn(tl.maximum(ws, 0.0)), one)
    norm = tl.where(pool == K_MEAN, tl.maximum(count, 1).to(tl.float32), one)
    return tl.where(pool == K_SQRTN, sqrtn, tl.where(pool == K_WMEAN, ws, norm))


@triton.jit
def divide(x, norm):
    """x / norm, 0 where the norm is 0 (wmean's div_no_nan; no other mode's norm is 0)."""
    return tl.where(norm != 0, x / norm, 0.0)


@triton.jit
def weight_terms(w, square):
    """`weight_term` in a kernel: w * w where `square` (sqrtn), else w."""
    return tl.where(square, w * w, w)


@triton.jit
def bag_scale(pool, count, wsum):
    """The backward's 1 / norm (IEEE division, as torch divides), 0 where the norm is 0."""
    norm = pool_norm(pool, count, wsum)
    return tl.where(norm != 0, tl.math.div_rn(1.0, norm), 0.0)


@triton.jit
def pool_bag(weight, indices, psw, start, end, cols, cmask, stride_w, padding_idx, square, counted,
             MODE: tl.constexpr, HAS_PSW: tl.constexpr, PADDING: tl.constexpr, WSUM: tl.constexpr,
             BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """Pool rows ids[start:end] of `weight` over columns `cols`: (fp32 sum, or max under MAX;
    the ids that gave the max; pooled ids; their weight terms' sum when WSUM and weighted (w * w
    where `square`, else w), else the count). Ids that `pooled` leaves out (PADDING) are passed
    over; then the pooled ids are counted only where `counted` (the caller reads the count or its
    sum): a second, short pass over the ids, after the pooling loop (a count carried through that
    loop kept the compiler from unrolling it: benchmarks/NOTES.md, session 53); otherwise the
    count is end - start."""
    lane = tl.arange(0, BLOCK_L)
    # accumulate a whole BLOCK_L x BLOCK_D tile and reduce over rows once, after the loop: a
    # reduction per step would cross warps (shared memory + barrier) and stall the gathers
    if MODE == K_MAX:
        acc = tl.full([BLOCK_L, BLOCK_D], float("-inf"), dtype=tl.float32)
        best_pos = tl.full([BLOCK_L, BLOCK_D], -1, dtype=tl.int64)
        best_id = tl.full([BLOCK_L, BLOCK_D], -1, dtype=tl.int64)
        # each lane's first pooled value (NaN included): torch keeps a NaN that comes first
        first_pos = tl.full([BLOCK_L], 9223372036854775807, dtype=tl.int64)
        first_val = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
        first_id = tl.full([BLOCK_L], -1, dtype=tl.int64)
    else:
        acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_L], dtype=tl.float32)
    # weighted bags of narrow tiles unrolled (tuning.WEIGHTED_UNROLL)
    for s in tl.range(start, end, BLOCK_L,
                      loop_unroll_factor=(K_UNROLL_STEPS if BLOCK_D <= K_UNROLL_COLUMNS else 1) if HAS_PSW else 1):
        pos = s + lane
        lmask = pos < end
        ids = tl.load(indices + pos, mask=lmask, other=0).to(tl.int64)
        if PADDING != K_NO_PADDING:
            lmask = lmask & pooled(ids, padding_idx, PADDING)
        m2 = lmask[:, None] & cmask[None, :]
        # a BLOCK_L x BLOCK_D tile of gathered rows: many independent loads in flight
        rows = tl.load(weight + ids[:, None] * stride_w + cols[None, :], mask=m2, other=0.0,
                       eviction_policy=EVICT).to(tl.float32)
        if HAS_PSW:
            w = tl.load(psw + pos, mask=lmask, other=0.0).to(tl.float32)
            rows = rows * w[:, None]
            if WSUM:
                wsum += weight_terms(w, square)
        if MODE == K_MAX:
            # strict: a later equal value never replaces an earlier one (torch keeps the first);
            # NaN is passed over here, and the lane's first number is taken even if -inf
            better = m2 & (rows == rows) & ((rows > acc) | (best_pos < 0))
            new = lmask & (first_pos == 9223372036854775807)
            first_pos = tl.where(new, pos, first_pos)
            first_id = tl.where(new, ids, first_id)
            first_val = tl.where(new[:, None], rows, first_val)
            acc = tl.where(better, rows, acc)
            best_pos = tl.where(better, pos[:, None], best_pos)
            best_id = tl.where(better, ids[:, None], best_id)
        else:
            acc += rows
    if MODE == K_MAX:
        top = tl.max(acc, axis=0)
        # among lanes holding the max, the earliest position wins
        first = tl.min(tl.where((acc == top[None, :]) & (best_pos >= 0), best_pos, 9223372036854775807), axis=0)
        best = tl.max(tl.where(best_pos == first[None, :], best_id, -1), axis=0)
        result = tl.where(best >= 0, top, 0.0)
        # the bag's first pooled value, if NaN, is the result (and gets the gradient)
        p0 = tl.min(first_pos, axis=0)
        at0 = (first_pos == p0)[:, None]
        v0 = tl.sum(tl.where(at0, first_val, 0.0), axis=0)
        nan0 = v0 != v0
        result = tl.where(nan0, v0, result)
        best = tl.where(nan0, tl.max(tl.where(first_pos == p0, first_id, -1), axis=0), best)
    else:
        best = tl.zeros([BLOCK_D], dtype=tl.int64)
        result = tl.sum(acc, axis=0)
    n = end - start
    if PADDING != K_NO_PADDING:
        if counted:
            count = tl.zeros([K_COUNT_BLOCK], dtype=tl.int32)
            for s in range(start, end, K_COUNT_BLOCK):
                pos = s + tl.arange(0, K_COUNT_BLOCK)
                ids = tl.load(indices + pos, mask=pos < end, other=0)
                count += ((pos < end) & pooled(ids, padding_idx, PADDING)).to(tl.int32)
            n = tl.sum(count, axis=0).to(tl.int64)
    ws = n.to(tl.float32)
    if HAS_PSW and WSUM:
        ws = tl.sum(wsum, axis=0)
    return result, best, n, ws


# ---- the backward's inputs: one (key, bag, scale) a value, for the segment reduction ----

# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["n", "FB", "B"])
def _backward_inputs_kernel(values, offsets, psw, status, meta, cold_start, keys, bag_out, scale_out, n, FB, B,
                            stride_m, padding_idx, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr,
                            PADDING: tl.constexpr, NORM_PASS: tl.constexpr, COLD: tl.constexpr,
                            STATUS: tl.constexpr, TAIL: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr):
    """Per value (KEY_START + id, or -1; bag; w / norm). COLD: `values` are sort keys already
    (-1: taken elsewhere, the hot-row path) and the others are packed from cold_start[bag] on.
    TAIL (a padded batch, sparse/padded.py): the values past the last bag get key -1, bag 0,
    scale 0, shared out over the programs. Only then: the fill's code alone made the kernel 25%
    slower on plain batches (H100, benchmarks/NOTES.md session 19)."""
    g, real, f = program_bags(FB, B, BAGS)
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    if TAIL:
        last = tl.minimum(tl.maximum(tl.load(offsets + FB).to(tl.int64), 0), n)
        share = (n - last + tl.num_programs(0) - 1) // tl.num_programs(0)
        if STATUS:  # (a bad batch's values are all shared out below)
            share = tl.where(tl.load(status) != 0, 0, share)
        first = last + tl.program_id(0) * share
        for i in range(0, share, BLOCK * BAGS):
            p = first + i + tl.arange(0, BLOCK * BAGS)
            m = (p < first + share) & (p < n)
            tl.store(keys + p, tl.full([BLOCK * BAGS], -1, keys.dtype.element_ty), mask=m)
            tl.store(bag_out + p, tl.zeros([BLOCK * BAGS], bag_out.dtype.element_ty), mask=m)
            if HAS_PSW or HAS_SCALE:
                tl.store(scale_out + p, tl.zeros([BLOCK * BAGS], tl.float32), mask=m)
    key0 = tl.load(meta + f * stride_m + K_KEY_START, mask=real, other=0)
    pool = tl.load(meta + f * stride_m + K_POOL, mask=real, other=0)
    if STATUS:  # a bad batch: every value gets key -1, the bags splitting [0, n) evenly
        bad = tl.load(status) != 0
        chunk = (n + FB - 1) // FB
        start = tl.where(bad, tl.minimum(g * chunk, n), start)
        end = tl.where(bad, tl.minimum(start + chunk, n), end)
        key0 = tl.where(bad, -1, key0)
    count = end - start
    wsum = count.to(tl.float32)
    if NORM_PASS:  # padding left out of the count, or weight terms summed (sqrtn, wmean)
        count = count * 0
        wsum = wsum * 0.0
        for i in range(0, tl.max(end - start), BLOCK):
            p = start[:, None] + i + tl.arange(0, BLOCK)[None, :]
            m = p < end[:, None]
            if PADDING != K_NO_PADDING:
                m = m & pooled(tl.load(values + p, mask=m, other=0), padding_idx, PADDING)
            count += tl.sum(m.to(tl.int64), axis=1)
            if HAS_PSW:
                w = tl.load(psw + p, mask=m, other=0.0).to(tl.float32)
                wsum += tl.sum(weight_terms(w, (pool == K_SQRTN)[:, None]), axis=1)
        if not HAS_PSW:
            wsum = count.to(tl.float32)
    scale = bag_scale(pool, count, wsum)
    if COLD:
        at = tl.load(cold_start + g, mask=real, other=0)
    for i in range(0, tl.max(end - start), BLOCK):
        p = start[:, None] + i + tl.arange(0, BLOCK)[None, :]
        m = p < end[:, None]
        if COLD:
            k = tl.load(values + p, mask=m, other=-1)
            c = (k >= 0).to(tl.int32)
            to = at[:, None] + tl.cumsum(c, axis=1) - c  # a bag's cold values, in order
            keep = m & (k >= 0)
            at += tl.sum(c, axis=1)
        else:
            v = tl.load(values + p, mask=m, other=0)
            k = key0[:, None] + v
            if PADDING != K_NO_PADDING:
                k = tl.where(pooled(v, padding_idx, PADDING), k, -1)
            if STATUS:
                k = tl.where(key0[:, None] < 0, -1, k)
            to = p
            keep = m
        tl.store(keys + to, k.to(keys.dtype.element_ty), mask=keep)
        tl.store(bag_out + to, (g[:, None] + 0 * p).to(bag_out.dtype.element_ty), mask=keep)
        if HAS_PSW:
            w = tl.load(psw + p, mask=m, other=0.0).to(tl.float32)
            tl.store(scale_out + to, scale[:, None] * w, mask=keep)
        elif HAS_SCALE:
            tl.store(scale_out + to, scale[:, None] + tl.zeros([BAGS, BLOCK], tl.float32), mask=keep)


def backward_inputs(values: Tensor, offsets: Tensor, psw: Optional[Tensor], meta: Tensor, B: int, *,
                    padding_idx: int = -1, wide_keys: bool = True, scaled: bool = True, weight_sums: bool = False,
                    skips: bool = False, tail: bool = False,
                    status: Optional[Tensor] = None, dtype=torch.float32, kernel: Optional[bool] = None,
                    cold: Optional[tuple[Tensor, int]] = None):
    """`backward_inputs_reference` in one launch instead of about ten torch ops over every value.

    keys int32 unless `wide_keys` (the reference's are int64), bags int32 while they fit.
    `scaled`: some feature averages (else, without weights, every scale is 1 and none is returned:
    the reduction then reads no scale a value). `weight_sums`: some feature's norm sums its
    weights (sqrtn, wmean: with weights, a pass sums their terms). `skips`: the batch holds ids < 0
    that no bag pools (ops/safe.py), which get key -1 as padding does. `tail`: a padded batch (sparse/padded.py):
    the values past the last bag get key -1 (a plain batch has none; its kernel skips the fill).
    `status`: the batch's deferred check; a bad batch gives every value key -1. `kernel`: force
    the kernel (True, interpreted in CPU tests) or the torch ops; None: by device and `dtype`
    (the scales' dtype: float64 tables take the torch ops). `cold`: (cold_start, count) of the
    hot-row path, whose `values` are then sort keys with -1 for hot values (optim/hot.py)."""
    if kernel is None:
        kernel = use_kernels(values) and dtype != torch.float64
    if not kernel:
        if status is not None:
            values, offsets = guard_bags(values, offsets, status)
            keys, bag, scale = backward_inputs_reference(values, offsets, psw, meta, B, padding_idx, dtype, scaled)
            return torch.where(status[0] == 0, keys, -1), bag, scale
        return backward_inputs_reference(values, offsets, psw, meta, B, padding_idx, dtype, scaled)
    n, FB = values.numel(), offsets.numel() - 1
    out = n if cold is None else cold[1]
    dev = values.device
    keys = torch.empty(out, dtype=torch.int64 if wide_keys else torch.int32, device=dev)
    bag = torch.empty(out, dtype=torch.int64 if FB >= 2**31 else torch.int32, device=dev)
    has_scale = psw is not None or scaled
    scale = torch.empty(out, dtype=torch.float32, device=dev) if has_scale else None
    bags, block = tuning.BAG_PASS_SHAPE
    pad = padding(padding_idx, skips)
    if n and FB:
        launch(_backward_inputs_kernel)[(cdiv(FB, bags),)](
            values, offsets, psw, status, meta, None if cold is None else cold[0], keys, bag, scale, n, FB, max(B, 1),
            meta.stride(0), padding_idx, HAS_PSW=psw is not None, HAS_SCALE=has_scale, PADDING=pad,
            COLD=cold is not None, NORM_PASS=(pad != NO_PADDING and scaled) or (psw is not None and weight_sums),
            STATUS=status is not None, TAIL=tail and cold is None, BAGS=bags, BLOCK=block)
    return keys, bag, scale


def guard_bags(values: Tensor, offsets: Tensor, status: Tensor) -> tuple[Tensor, Tensor]:
    """(values, offsets) for the torch-op paths, which would fault on a bad batch: when `status`
    (a deferred check's) says the batch is bad, every value 0 in the first bag (in range whatever
    the tables); the caller zeroes what they give. Elementwise ops, no host read (so they trace)."""
    good = status[0] == 0
    safe = torch.cat([offsets[:1] * 0, torch.full_like(offsets[1:], values.numel())])
    return torch.where(good, values, 0), torch.where(good, offsets, safe)
