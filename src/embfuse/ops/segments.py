"""Deterministic gradient reduction by row, shared by the backward of every lookup op.

    grad[r, :] = c_r * sum over positions p whose key names row r of scale[p] * src[source of p, :]

with c_r = 1 / count_r under scale_grad_by_freq, else 1; key -1 means "no row" (padding, a
skipped id). Rows live in a `Layout`: one or many tables of any widths packed in one flat buffer
(a single table is the case T = 1), so the same launches serve a whole table collection.

The keys are sorted once. Level 1 gives each program a tile of BLOCK_K consecutive sorted
positions (or a block of the tile's columns, see Segments.launch): it gathers their gradient
rows as one 2-D tile (all loads in flight) and sums runs of equal keys by a segmented scan down
the tile, in each thread's registers (_run_sums). A run that starts and ends in the tile is
finished there. The partial sums of runs that cross a tile edge become the entries of level 2,
the same problem a tile's size times smaller, and so on until one tile holds the rest: a hot row
met a million times is finished after a few levels of parallel tiles, never by one program
walking its run. The small upper levels run as one tree in one launch (Segments.launch). Fixed
orders throughout: bitwise the same result every call, no atomic sums (the tree's only atomics
count programs), and nothing read back to the host (so the backward runs in CUDA graphs).
Rows no key touches keep what the output held (zeros for a dense gradient).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from embfuse._triton import HAS_TRITON, cdiv, interpreting, launch, next_pow2, tl, tracing, triton
from embfuse.ops import tuning
from embfuse.ops.bags import accumulation


def _named(ids, padding_idx):
    """The mask of positions that name a row (not -1, not padding)."""
    return ids >= 0 if padding_idx < 0 else (ids >= 0) & (ids != padding_idx)


def _source_rows(ids, src, src_row, scale, padding_idx, acc_dtype):
    """Each position's scaled gradient row in `acc_dtype`, and `_named`'s mask: what the dense
    pure-torch reduction starts from."""
    rows = src.to(acc_dtype)
    if src_row is not None:
        rows = rows[src_row]
    if scale is not None:
        rows = rows * scale.to(acc_dtype)[:, None]
    return rows, _named(ids, padding_idx)


def segment_grad_reference(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Pure-torch version for one table (CPU path and test oracle); float64 in, float64 out."""
    acc_dtype = accumulation(src)
    rows, keep = _source_rows(ids, src, src_row, scale, padding_idx, acc_dtype)
    # positions that name no row add into one row past the table, dropped after (not a product
    # with the mask: 0 * NaN is NaN; no host read, as a compaction would need)
    ids_k = torch.where(keep, ids, num_rows).long()
    grad = torch.zeros(num_rows + 1, src.shape[1], dtype=acc_dtype, device=src.device).index_add_(0, ids_k, rows)
    grad = grad[:num_rows]
    if scale_by_freq:
        counts = torch.zeros(num_rows + 1, dtype=acc_dtype, device=src.device).index_add_(0, ids_k, keep.to(acc_dtype))
        grad = grad / counts[:num_rows].clamp(min=1)[:, None]
    return grad.to(out_dtype)


def row_sums_reference(ids, src, src_row, scale, padding_idx, acc_dtype):
    """Pure torch: (the distinct rows named, ascending; their summed gradient rows in
    `acc_dtype`; how many positions name each). Each distinct row's sum is a bag of torch's
    embedding_bag over `src`: its positions in input order (one stable sort), weighted by
    `scale`, so no position's scaled row is materialised first (benchmarks/NOTES.md, session 30)."""
    at = _named(ids, padding_idx).nonzero()[:, 0]
    named, order = torch.sort(ids[at].long(), stable=True)
    touched, counts = torch.unique_consecutive(named, return_counts=True)
    at = at[order]
    weights = None if scale is None else scale[at].to(acc_dtype)
    sums = F.embedding_bag(at if src_row is None else src_row[at], src.to(acc_dtype), counts.cumsum(0) - counts,
                           mode="sum", per_sample_weights=weights)
    return touched, sums, counts


class Layout:
    """How the rows of T tables sit in one flat buffer, as the reduction needs to know it (host
    values): the widest width, the power of two dividing every width (the vector width of row
    accesses), and whether sort keys need 64 bits. A sort key names a row as (t << shift) | row
    in table t, so keys sort in table order and fit 32 bits for nearly every collection. Where
    each row's gradient and weights lie comes with the keys (Segments' src_meta); a lone table
    brings its own."""

    def __init__(self, max_dim: int, vec: int, wide_keys: bool, shift: int = 0, own_source=None):
        self.max_dim, self.vec, self.wide_keys, self.shift = max_dim, vec, wide_keys, shift
        self.own_source = own_source

    @staticmethod
    def build(rows, dims) -> "Layout":
        shift = key_shift(rows)
        return Layout(max(dims, default=0), _pow2_factor(*dims), shift + (len(rows) - 1).bit_length() > 31, shift)


def key_shift(rows) -> int:
    """Bits of a row number within the largest table: the shift of the table in a sort key."""
    return max(rows, default=0).bit_length()


def table_starts(rows, dims) -> tuple[list[int], list[int]]:
    """First global row and first element of each table packed one after another (T + 1
    entries each: the last are the totals)."""
    row, elem = [0], [0]
    for r, d in zip(rows, dims):
        row.append(row[-1] + r)
        elem.append(elem[-1] + r * d)
    return row, elem


def _single_table(num_rows: int, dim: int, device) -> Layout:
    # one feature: gradient column 0, width dim, weights and global rows from 0
    source = torch.tensor([[0, dim, 0, 0]], dtype=torch.int64, device=device)
    return Layout(dim, _pow2_factor(dim), key_shift([num_rows]) > 31, 0, source)


_single_table_cached = functools.lru_cache(maxsize=128)(_single_table)


def single_table(num_rows: int, dim: int, device) -> Layout:
    """The layout of one (num_rows, dim) table; cached in eager code (sizes are symbolic while
    tracing, and an lru_cache cannot hash them)."""
    return _single_table(num_rows, dim, device) if tracing() else _single_table_cached(num_rows, dim, device)


def _pow2_factor(*xs) -> int:
    """The largest power of two (at most 8) dividing every x: the vector width of row accesses."""
    g = functools.reduce(math.gcd, [int(x) for x in xs], 0) or 8
    return min(8, g & -g)


class Segments:
    """The sorted keys of one reduction and the buffers of its levels (device tensors, no host read).

    keys[p]: sort key of position p's row (see Layout) or -1. Position p's gradient row is the
    D = src_meta[f, 1] elements from element (g % src_bags) * src_stride + src_meta[f, 0] of
    src, g = src_row[p] (or p): the bag (feature-major over src_bags samples) whose output p
    fed, f = g // src_bags its feature. The row's first weight element is src_meta[f, 2] +
    key * D and its global row src_meta[f, 3] + key."""

    def __init__(self, keys, layout: Layout, src, src_row=None, scale=None, src_stride=None, src_bags=None,
                 src_meta=None):
        self.layout = layout
        self.n = keys.numel()
        self.block_d = max(4, next_pow2(layout.max_dim))  # (widths 1-3 run 4 wide: the narrowest tested)
        # int32 keys sort in half the radix passes of int64 ones
        keys = keys.long() if layout.wide_keys else keys.int()
        self.sorted_key, self.perm = torch.sort(keys, stable=True)
        self.src = src
        self.src_row, self.scale = src_row, scale
        self.src_stride = src.stride(0) if src_stride is None else src_stride
        # one group of bags unless told: every source row g gives g // src_bags == 0 (not a huge
        # constant: torch 2.11's inductor fails on a 2**62 kernel argument)
        self.src_bags = max(1, src.shape[0]) if src_bags is None else src_bags
        self.src_meta = layout.own_source if src_meta is None else src_meta
        # row starts in the weights and in src (columns: sums of widths) share the widths' factor
        self.vec = _pow2_factor(layout.vec, self.src_stride)

    def compact(self) -> torch.Tensor:
        """Renumber the sorted keys 0..U-1 by distinct key (-1 stays -1), so that the kernels
        write row u of a compact (U, D) output; returns the U distinct keys in order. One host
        read: U, the size of the output."""
        uniq, rank = torch.unique_consecutive(self.sorted_key, return_inverse=True)
        if uniq.numel() and uniq[0] < 0:
            uniq, rank = uniq[1:], rank - 1
        self.sorted_key = rank.to(self.sorted_key.dtype)
        return uniq

    def width(self, columns=None) -> int:
        """Columns a program takes when tiles are cut in blocks of `columns` (see launch)."""
        return min(self.block_d, columns or self.block_d)

    def launch(self, kernel, *args, count=False, columns=None, **constexprs):
        """Every level; `args` follow the kernel's shared leading arguments. Level 1 reduces the
        sorted positions in tiles; the partial sums of runs that cross tile edges (two slots a
        tile: the run coming in, the run going on) are the entries of level 2, a problem a
        tile's size times smaller, and so on until one tile holds everything.

        A level of more than tuning.TREE_LEVEL entries is a launch of its own; the levels after
        run as one tree in one launch: a program a tile of its first level, and the program that
        finishes last of the tiles feeding a tile of the next level (counted in `counters`) goes
        on with that tile. A launch costs host time, and the step of a small batch
        is host-bound (NOTES: "the upper levels in one launch"). `columns`: the tiles' columns
        are cut in blocks of this many (a power of two), a program each, so that a program holds
        fewer registers (None: whole rows, as row-wise state needs). Each block loads the tile's
        keys and source rows again; where the tile's registers spilled, that costs less than the
        spills (tuning.GRAD_COLUMNS, tuning.update_columns)."""
        dev = self.sorted_key.device
        block_d = self.width(columns)
        blocks = self.block_d // block_d
        block_k, warps = tuning.level_shape(block_d, self.n)
        tiles = cdiv(self.n, block_k)
        # the upper levels' (entries, tile shape); the tree (from level `tree`, there always is
        # one: the last level fits a tile) takes its first level's shape throughout
        levels, n, tree, shape = [], 2 * tiles, None, None
        while tiles > 1:
            if tree is None and n <= tuning.TREE_LEVEL:
                tree, shape = len(levels), tuning.level_shape(block_d, n)
            levels.append((n, shape or tuning.level_shape(block_d, n)))
            tiles = cdiv(n, levels[-1][1][0])
            n = 2 * tiles
        # their entries one after another, then two spare (the last level's tile, level 1's when
        # it is the only one, writes its two slots, both empty); a counter a tile of the tree's
        # levels after its first
        total = sum(n for n, _ in levels)
        all_keys = torch.empty(total + 2, dtype=self.sorted_key.dtype, device=dev)
        all_vals = torch.empty(total + 2, self.block_d, dtype=torch.float32, device=dev)
        all_info = torch.empty(total + 2, 2, dtype=torch.int32, device=dev)
        counted = sum(cdiv(n, k) for n, (k, _) in levels[tree + 1:]) if levels else 0
        # (with nothing to count, a tensor no program reads; never another argument: a traced
        # launch must get each tensor once, see _triton._Distinct)
        counters = (torch.zeros(counted * blocks, dtype=torch.int32, device=dev) if counted else
                    torch.empty(1, dtype=torch.int32, device=dev))
        shared = dict(HAS_SRC_ROW=self.src_row is not None, HAS_SCALE=self.scale is not None, COUNT=count,
                      VEC=self.vec, BLOCK_D=block_d, ROW_D=self.block_d, **constexprs)
        launch(kernel)[(cdiv(self.n, block_k), blocks)](
            self.sorted_key, self.n, self.perm, self.src_row, self.scale, self.src, self.src_stride, self.src_bags,
            self.src_meta, all_keys, all_vals, all_info, counters, 0, 1, *args,
            FIRST=True, BLOCK_K=block_k, num_warps=warps, **shared)
        at = 0
        for i, (n, (k, w)) in enumerate(levels):
            if i <= tree:  # a level of its own, or the tree's first and all after it
                # (upper levels read only the upper buffers: the first level's inputs are not
                # passed, so a traced graph sees each read by one launch)
                launch(kernel)[(cdiv(n, k), blocks)](
                    None, n, None, None, None, None, self.src_stride, self.src_bags, self.src_meta, all_keys,
                    all_vals, all_info, counters, at, 1 if i < tree else len(levels) - i, *args,
                    FIRST=False, BLOCK_K=k, num_warps=w, **shared)
            at += n


# Triton reads this when the kernels are defined (a constexpr global): see _run_sums
_INTERPRET = tl.constexpr(interpreting()) if HAS_TRITON else False


@triton.jit
def _seg_add(start_a, a, start_b, b):
    """The segmented sum's operator: b's run started at or after a's end, or goes on from it."""
    return start_a | start_b, tl.where(start_b, b, a + b)


@triton.jit
def _run_sums(key, start, x, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """For each entry of a tile of sorted keys: the sum of x over its run of equal keys, from
    the run's first entry in the tile up to and including itself (an inclusive segmented scan;
    `start` marks each run's first entry). On the GPU a scan down the tile: with one warp a
    program every entry of a column sits in one thread, so it is BLOCK_K - 1 adds in registers
    (no shuffles, no shared memory; checked in the PTX). The interpreter runs a scan one element
    at a time in Python (seconds a tile), so there the same sums are taken as one masked sum,
    in another order: the two may differ in the last bit, each is deterministic."""
    if _INTERPRET:
        j = tl.arange(0, BLOCK_K)
        upto = (key[:, None] == key[None, :]) & (j[None, :] <= j[:, None])
        return tl.sum(tl.where(upto[:, :, None], x[None, :, :], 0.0), axis=1)
    else:
        flags = tl.broadcast_to(start[:, None], (BLOCK_K, BLOCK_D))
        _, sums = tl.associative_scan((flags, x), 0, _seg_add)
        return sums


@triton.jit
def columns(BLOCK_D: tl.constexpr):
    """The columns of this program's column block."""
    return tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)


@triton.jit
def _peek(ptr, mask, other, FIRST: tl.constexpr):
    """A load of a level's keys or entries. Upper levels read what other programs of their launch
    wrote: from L2 (.cg), never from an SM's L1, which is not kept coherent."""
    if FIRST:
        return tl.load(ptr, mask=mask, other=other)
    else:
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")


@triton.jit
def next_level(counters, tile, n, at, ctr, levels, BLOCK_K: tl.constexpr):
    """After a tile of an upper level (n entries from entry `at` of the upper buffers) wrote its
    two entries of the next level: whether this program goes on with the next level's tile that
    they feed, and that tile's (tile, n, at, ctr, levels). `levels`: the levels this launch
    takes, this one included; `ctr`: where the counters of the next level's tiles start. A
    program goes on when it is the last of the tile's feeding programs to count itself in: the
    others' entries are then written (release: every thread's stores before the count; acquire:
    the tile's loads after it)."""
    tiles = (n + BLOCK_K - 1) // BLOCK_K
    go = (tiles > 1) & (levels > 1)
    half: tl.constexpr = BLOCK_K // 2
    u = tile // half
    nxt = 2 * tiles
    if go:
        tl.debug_barrier()
        seen = tl.atomic_add(counters + (ctr + u) * tl.num_programs(1) + tl.program_id(1), 1, sem="acq_rel")
        go = seen == tl.minimum(half, tiles - u * half) - 1
    return go, u, nxt, at + n, ctr + (nxt + BLOCK_K - 1) // BLOCK_K, levels - 1


@triton.jit
def segment_rows(keys, key, p, g, f, D, n, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info,
                 tile, at, FIRST: tl.constexpr, HAS_SCALE: tl.constexpr, COUNT: tl.constexpr, VEC: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROW_D: tl.constexpr):
    """Tile `tile` of one level, in this program's BLOCK_D columns (`columns`) of rows ROW_D wide
    (the partial rows' width). The caller loads the entries' keys `key`, their source features
    `f` and widths `D` and, at FIRST, each sorted position's position `p` and source row `g` (see
    _grad_tile), and finds the rows from them. Returns, for the tile's BLOCK_K entries: (fp32 sums
    [BLOCK_K, BLOCK_D], counts, mask of the rows this program finishes). FIRST: the entries are
    sorted positions (keys), gathered from src, and the next level's entries go to the start of
    the upper buffers (up_keys, up_vals, up_info). Upper levels: the level's n entries start at
    entry `at` of the upper buffers (the partial rows of the level before, each entry's (source
    feature, count)), and the next level's follow them; keys, scale and src are not read. The
    row's table is never looked up from the key: per-row gathers from the table arrays cost
    several times the tile's own work (measured: Triton replicates anything derived from the key
    per thread)."""
    if FIRST:
        keys_out, vals_out, info_out, info_in = up_keys, up_vals, up_info, up_info
    else:
        base_at = at.to(tl.int64)
        keys = up_keys + base_at
        src = up_vals + base_at * ROW_D
        info_in = up_info + 2 * base_at
        keys_out = keys + n
        vals_out = src + n * ROW_D
        info_out = info_in + 2 * n
    tile = tile.to(tl.int64)
    cols = columns(BLOCK_D)
    first = tile * BLOCK_K
    last = tl.minimum(first + BLOCK_K, n) - 1
    j = first + tl.arange(0, BLOCK_K)
    inside = j < n
    real = inside & (key >= 0)
    if FIRST:  # the key before the tile, and after each entry
        prev = tl.load(keys + first - 1, mask=tile > 0, other=-2)
        nxt = tl.load(keys + j + 1, mask=j + 1 < n, other=-2)
    else:
        # only this tile's entries, which its feeding programs have written (next_level; the
        # neighbours' may not be yet): the head slot holds the key of the run coming in across
        # the tile's first edge (else -1), the tail slot that of the run going on past its last
        prev = _peek(keys + first, True, -2, FIRST)
        nxt = tl.where(j == last, key, _peek(keys + j + 1, j < last, -2, FIRST))
    before = _peek(keys + j - 1, inside & (j > first), -2, FIRST)
    # 1-D loads are masked by `inside` alone (in bounds for any key): Triton 3.6 failed to
    # compile a load whose mask derived from `key` (layout mismatch, "mask type matches ptr
    # type") when key also fed a tl.dot here
    if FIRST:
        covered = j < 0
        s0 = tl.multiple_of((g - f * src_bags) * src_stride + tl.load(src_meta + 4 * f, mask=inside, other=0), VEC)
        # in groups of VEC columns (every width is a multiple): 16-byte loads
        m_src = real[:, None] & ((cols // VEC)[None, :] < (D // VEC)[:, None])
        x = tl.load(src + s0[:, None] + cols[None, :], mask=m_src, other=0.0).to(tl.float32)
        if HAS_SCALE:
            x = x * tl.load(scale + p, mask=inside, other=0.0).to(tl.float32)[:, None]
    else:
        # partial rows (zero past their width); an odd (tail) entry with its tile's head key is
        # a run that covered the whole tile: already in the head entry, left unwritten
        covered = (j % 2 == 1) & (before == key)
        x = _peek(src + j[:, None] * ROW_D + cols[None, :], (real & ~covered)[:, None], 0.0, FIRST)
    # each run's sum within the tile so far, in a fixed order
    start = (j == first) | (key != before)
    acc = _run_sums(key, start, x, BLOCK_K, BLOCK_D)
    if COUNT:  # each run's count within the tile, at every one of its entries
        same = key[:, None] == key[None, :]
        if FIRST:
            cnt = tl.sum((same & real[None, :]).to(tl.int32), axis=1)
        else:
            c = tl.where(covered, 0, _peek(info_in + 2 * j + 1, inside, 0, FIRST))
            cnt = tl.sum(tl.where(same & real[None, :], c[None, :], 0), axis=1)
    else:
        cnt = tl.zeros([BLOCK_K], dtype=tl.int32)
    ends = inside & (nxt != key)
    # runs crossing the tile's edges: the first one if it began before this tile (its sum here
    # is at its last entry in the tile), the last one if it goes on after it; they are finished
    # by a later level
    head_row = real & (j == first) & (key == prev)
    head_sum = real & (key == prev) & (ends | (j == last))
    tail_row = real & (j == last) & ~ends
    # the next level's entries of this tile: its head run's partial, then its tail run's (the
    # same key, and no row written, when one run covers the whole tile: its partial is the
    # head's; the next level knows it by the key). The last level's tile writes two empty slots
    # (Segments.launch allocates them).
    slot = 2 * tile + 0 * j
    tail_new = tail_row & (key != prev)
    tl.store(keys_out + slot, tl.where(head_row, key, -1), mask=j == first)
    tl.store(keys_out + slot + 1, tl.where(tail_row, key, -1), mask=j == last)
    slot_at = slot[:, None] * ROW_D + cols[None, :]
    tl.store(vals_out + slot_at, acc, mask=head_sum[:, None])
    tl.store(vals_out + slot_at + ROW_D, acc, mask=tail_new[:, None])
    # (every slot gets a feature: the next level reads it for any entry, real or not; with
    # several column blocks each writes the same keys and features)
    info = info_out + 2 * slot
    tl.store(info, tl.where(head_row, f, 0).to(tl.int32), mask=j == first)
    tl.store(info + 2, tl.where(tail_row, f, 0).to(tl.int32), mask=j == last)
    if COUNT:
        tl.store(info + 1, cnt, mask=head_row)
        tl.store(info + 3, cnt, mask=tail_row)
    done = real & ends & (key != prev)
    return acc, cnt, done


@triton.jit
def _grad_tile(keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info,
               tile, at, grad, FIRST: tl.constexpr, HAS_SRC_ROW: tl.constexpr,
               HAS_SCALE: tl.constexpr, COUNT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_D: tl.constexpr, ROW_D: tl.constexpr):
    # The entries are loaded and their rows found here, not in a helper: torch's trace of a
    # traced launch (pytorch#195628) counts every tensor a helper takes as written when the
    # helper's result addresses a store, and Inductor then copies each one; a loaded value ends
    # the trace. (optim/fused.py _update_tile has the same lines.) Loaded before the tile's sums:
    # after them they would wait behind its stores to the upper levels (a fused update took 6.6%
    # longer so; benchmarks/NOTES.md, session 43).
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
    # the row's table from the source side: its feature's width and first element of key 0
    D = tl.load(src_meta + 4 * f + 1, mask=j < n, other=0)
    base = tl.multiple_of(tl.load(src_meta + 4 * f + 2, mask=j < n, other=0) + key * D, VEC)
    acc, cnt, done = segment_rows(
        keys, key, p, bag, f, D, n, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info, tile,
        at, FIRST, HAS_SCALE, COUNT, VEC, BLOCK_K, BLOCK_D, ROW_D)
    if COUNT:  # scale_grad_by_freq
        acc = acc / tl.maximum(cnt, 1).to(tl.float32)[:, None]
    cols = columns(BLOCK_D)
    tl.store(grad + base[:, None] + cols[None, :], acc.to(grad.dtype.element_ty),
             mask=done[:, None] & ((cols // VEC)[None, :] < (D // VEC)[:, None]))


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["n", "src_bags", "at", "levels"])
def _segment_grad_kernel(
    keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info, counters,
    at, levels, grad, FIRST: tl.constexpr, HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr,
    COUNT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROW_D: tl.constexpr,
):
    if FIRST:
        _grad_tile(keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals, up_info,
                   tl.program_id(0), 0, grad, FIRST, HAS_SRC_ROW, HAS_SCALE, COUNT, VEC, BLOCK_K,
                   BLOCK_D, ROW_D)
    else:  # upper levels, `levels` of them from entry `at` (Segments.launch)
        # (every loop-carried value a tensor of n's width: Inductor passes a 1, n's too, as a constant)
        zero = tl.program_id(0) * 0 + n * 0
        tile, ctr, n, at, levels = tl.program_id(0), zero, n + zero, at + zero, levels + zero
        go = levels > 0
        while go:
            _grad_tile(keys, n, perm, src_row, scale, src, src_stride, src_bags, src_meta, up_keys, up_vals,
                       up_info, tile, at, grad, FIRST, HAS_SRC_ROW, HAS_SCALE, COUNT, VEC, BLOCK_K,
                       BLOCK_D, ROW_D)
            go, tile, n, at, ctr, levels = next_level(counters, tile, n, at, ctr, levels, BLOCK_K)


def reduce_segments(keys, layout: Layout, src, out, scale_by_freq=False, **src_args):
    """Write each touched row's gradient sum into the flat buffer `out` (laid out as `layout`)."""
    if keys.numel() == 0 or layout.max_dim == 0:
        return out
    Segments(keys, layout, src, **src_args).launch(_segment_grad_kernel, out, count=scale_by_freq,
                                                   columns=tuning.GRAD_COLUMNS)
    return out


def segment_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Triton version of `segment_grad_reference` (same arguments); returns a dense gradient."""
    D = src.shape[1]
    grad = torch.zeros(num_rows, D, dtype=out_dtype, device=src.device)
    if padding_idx >= 0:
        ids = torch.where(ids == padding_idx, -1, ids)
    reduce_segments(ids, single_table(num_rows, D, src.device), src.contiguous(), grad, scale_by_freq,
                    src_row=src_row, scale=scale)
    return grad


def rowwise_grad_reference(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Pure-torch row-wise sparse gradient: (the distinct rows touched, ascending; their
    gradient rows), the sums `segment_grad_reference` would write at those rows. Arguments as
    `segment_grad_reference`'s."""
    acc_dtype = accumulation(src)
    touched, values, counts = row_sums_reference(ids, src, src_row, scale, padding_idx, acc_dtype)
    if scale_by_freq:
        values = values / counts[:, None].to(acc_dtype)
    return touched, values.to(out_dtype)


def rowwise_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Triton version of `rowwise_grad_reference`: the segment reduction of `segment_grad` with
    rows renumbered by rank, so nothing of the size of the table is written."""
    D = src.shape[1]
    if padding_idx >= 0:
        ids = torch.where(ids == padding_idx, -1, ids)
    segments = Segments(ids, single_table(num_rows, D, src.device), src.contiguous(), src_row=src_row, scale=scale)
    touched = segments.compact().long()
    values = torch.zeros(touched.numel(), D, dtype=out_dtype, device=src.device)
    if touched.numel() and D:
        segments.launch(_segment_grad_kernel, values, count=scale_by_freq, columns=tuning.GRAD_COLUMNS)
    return touched, values


@torch.library.custom_op("embfuse::rowwise_grad", mutates_args=())
def _rowwise_grad_op(ids: torch.Tensor, src: torch.Tensor, src_row: Optional[torch.Tensor],
                     scale: Optional[torch.Tensor], num_rows: int, padding_idx: int, scale_by_freq: bool,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rowwise_grad` as one opaque op of a traced backward (its output's size is the data's).
    Traced into, it failed on the GPU three ways: branches on the distinct keys; torch 2.11
    giving unique_consecutive's inverse the keys' dtype (pytorch#179401), so Inductor read the
    ranks wrongly; and Inductor's re-inplacing pass asking the sparse tensor built from the
    kernels' output for its storage (benchmarks/NOTES.md, session 44)."""
    return rowwise_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype)


@_rowwise_grad_op.register_fake
def _(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    touched = torch.library.get_ctx().new_dynamic_size()
    return ids.new_empty(touched, dtype=torch.long), src.new_empty(touched, src.shape[1], dtype=out_dtype)


def rowwise_sparse_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, kernel):
    """sparse="rowwise": the row-wise gradient (Triton when `kernel`, else the reference) as
    torch's sparse tensor, coalesced, one entry per touched row."""
    reduce = (_rowwise_grad_op if tracing() else rowwise_grad) if kernel else rowwise_grad_reference
    touched, values = reduce(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, src.dtype)
    return torch.sparse_coo_tensor(touched[None], values, (num_rows, values.shape[1]), is_coalesced=True,
                                   check_invariants=False)
