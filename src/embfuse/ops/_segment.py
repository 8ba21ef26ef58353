"""Deterministic gradient reduction by row, shared by the backward of every lookup op.

    grad[r, :] = c_r * sum over positions p with key[p] == r of scale[p] * src[source of p, :]

with c_r = 1 / count_r under scale_grad_by_freq, else 1; key -1 means "no row" (padding, a
skipped id). Rows live in a `Layout`: one or many tables of any widths packed in one flat buffer
(a single table is the case T = 1), so one launch serves a whole table collection.

The keys are sorted once. Phase 1 gives each program a tile of BLOCK_K consecutive sorted
positions: it gathers their gradient rows as one 2-D tile (all loads in flight) and sums runs of
equal keys by multiplying the tile with the 0/1 matrix of equal keys. A run that starts and ends in the tile is finished there; the
partial sums of runs that cross a tile edge go to small per-tile buffers, and in phase 2 the tile
where such a run starts adds them in tile order. Fixed orders throughout: bitwise the same result
every call, no atomics, and nothing read back to the host (so the backward runs in CUDA graphs).
Rows no key touches keep what the output held (zeros for a dense gradient).
"""

from __future__ import annotations

import functools

import torch

from embfuse._triton import launch, next_pow2, tl, tracing, triton

_NO_TABLE = 2**62  # pads the table starts so that the in-kernel table search never picks a pad


def segment_grad_reference(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Pure-torch version for one table (CPU path and test oracle); float64 in, float64 out."""
    acc_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    rows = src.to(acc_dtype)
    if src_row is not None:
        rows = rows[src_row]
    if scale is not None:
        rows = rows * scale.to(acc_dtype)[:, None]
    keep = ids >= 0
    if padding_idx >= 0:
        keep = keep & (ids != padding_idx)
    ids_k = torch.where(keep, ids, 0).long()
    rows = rows * keep[:, None]
    grad = torch.zeros(num_rows, src.shape[1], dtype=acc_dtype, device=src.device).index_add_(0, ids_k, rows)
    if scale_by_freq:
        counts = torch.zeros(num_rows, dtype=acc_dtype, device=src.device).index_add_(
            0, ids_k, keep.to(acc_dtype)
        )
        grad = grad / counts.clamp(min=1)[:, None]
    return grad.to(out_dtype)


class Layout:
    """Where the rows of T tables live in one flat buffer: table t holds rows
    row_start[t] .. row_start[t+1]-1 (global row numbers, the sort keys) of width dims[t],
    starting at element elem_start[t]. Device tensors, padded to a power of two for the kernel."""

    def __init__(self, row_start, dims, elem_start, max_dim: int):
        self.row_start, self.dims, self.elem_start, self.max_dim = row_start, dims, elem_start, max_dim
        self.t_block = row_start.numel()

    @staticmethod
    def build(rows, dims, device) -> "Layout":
        T = len(rows)
        pad = next_pow2(T) - T
        row_start, elem_start = table_starts(rows, dims)

        def tensor(xs):
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return Layout(tensor(row_start[:-1] + [_NO_TABLE] * pad), tensor(list(dims) + [0] * pad),
                      tensor(elem_start[:-1] + [0] * pad), max(dims, default=0))


def table_starts(rows, dims) -> tuple[list[int], list[int]]:
    """First global row and first element of each table packed one after another (T + 1
    entries each: the last are the totals)."""
    row, elem = [0], [0]
    for r, d in zip(rows, dims):
        row.append(row[-1] + r)
        elem.append(elem[-1] + r * d)
    return row, elem


def _single_table(num_rows: int, dim: int, device) -> Layout:
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    return Layout(zero, torch.full((1,), dim, dtype=torch.int64, device=device), zero, dim)


_single_table_cached = functools.lru_cache(maxsize=128)(_single_table)


def single_table(num_rows: int, dim: int, device) -> Layout:
    """The layout of one (num_rows, dim) table; cached in eager code (sizes are symbolic while
    tracing, and an lru_cache cannot hash them)."""
    return _single_table(num_rows, dim, device) if tracing() else _single_table_cached(num_rows, dim, device)


def tile_rows(block_d: int) -> int:
    """Sorted positions per phase-1 program: 16 to 32 (tl.dot needs 16; the equal-keys product
    costs BLOCK_K multiply-adds per gathered element, so no more)."""
    return max(16, min(32, 2048 // block_d))


class Segments:
    """The sorted keys and the per-tile buffers of one reduction (device tensors, no host read).

    keys[p]: global row of position p or -1. Position p's gradient row starts at element
    (g % src_bags) * src_stride + src_col[g // src_bags] of src, g = src_row[p] (or p): the
    bag (feature-major over src_bags samples) whose output p fed."""

    def __init__(self, keys, layout: Layout, src, src_row=None, scale=None, src_stride=None, src_bags=None,
                 src_col=None):
        n = keys.numel()
        self.layout = layout
        self.block_d = max(16, next_pow2(layout.max_dim))  # tl.dot needs 16
        self.block_k = tile_rows(self.block_d)
        self.n, self.tiles = n, triton.cdiv(n, self.block_k)
        self.sorted_key, self.perm = torch.sort(keys.long(), stable=True)
        self.src = src
        self.src_row, self.scale = src_row, scale
        self.src_stride = src.stride(0) if src_stride is None else src_stride
        # one group of bags unless told: every source row g gives g // src_bags == 0 (not a huge
        # constant: torch 2.11's inductor fails on a 2**62 kernel argument)
        self.src_bags = max(1, src.shape[0]) if src_bags is None else src_bags
        self.src_col = layout.elem_start[:1] if src_col is None else src_col  # a zero when one table
        dev = keys.device
        self.head = torch.empty(self.tiles, self.block_d, dtype=torch.float32, device=dev)
        self.tail = torch.empty(self.tiles, self.block_d, dtype=torch.float32, device=dev)
        self.counts = torch.empty(2, self.tiles, dtype=torch.int32, device=dev)

    def launch(self, kernel, *args, count=False, **constexprs):
        """Both phases; `args` follow the kernel's shared leading arguments."""
        L = self.layout
        for phase in (1, 2):
            launch(kernel)[(self.tiles,)](
                self.sorted_key, self.perm, self.src_row if self.src_row is not None else self.perm,
                self.scale if self.scale is not None else self.head, self.head, self.tail, self.counts,
                self.n, self.tiles, self.src, self.src_stride, self.src_bags, self.src_col,
                L.row_start, L.dims, L.elem_start, *args,
                PHASE=phase, HAS_SRC_ROW=self.src_row is not None, HAS_SCALE=self.scale is not None, COUNT=count,
                T_BLOCK=L.t_block, BLOCK_K=self.block_k, BLOCK_D=self.block_d, **constexprs,
            )


@triton.jit
def _rows_of(key, row_start, dims, elem_start, T_BLOCK: tl.constexpr):
    """Width and first element of each global row in `key` (any shape [R])."""
    starts = tl.load(row_start + tl.arange(0, T_BLOCK))
    t = tl.maximum(tl.sum((starts[None, :] <= key[:, None]).to(tl.int32), axis=1) - 1, 0)
    D = tl.load(dims + t)
    return D, tl.load(elem_start + t) + (key - tl.load(row_start + t)) * D


@triton.jit
def segment_rows(PHASE: tl.constexpr, sorted_key, perm, src_row, scale, head, tail, counts, n, tiles,
                 src, src_stride, src_bags, src_col, row_start, dims, elem_start,
                 HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, COUNT: tl.constexpr,
                 T_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """For this program: (key [R], width [R], first element [R], fp32 sums [R, BLOCK_D], run
    lengths [R], mask of the rows this program finishes [R]); R = BLOCK_K in phase 1, 1 in 2."""
    tile = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    first = tile * BLOCK_K
    last = tl.minimum(first + BLOCK_K, n) - 1
    prev = tl.load(sorted_key + first - 1, mask=tile > 0, other=-2)
    if PHASE == 1:
        j = first + tl.arange(0, BLOCK_K)
        inside = j < n
        key = tl.load(sorted_key + j, mask=inside, other=-1)
        real = inside & (key >= 0)
        # 1-D loads are masked by `inside` alone (in bounds for any key): Triton 3.6 fails to
        # compile a load whose mask derives from `key` (layout mismatch, "mask type matches ptr
        # type") when key also feeds the equal-keys product
        p = tl.load(perm + j, mask=inside, other=0)
        D, base = _rows_of(key, row_start, dims, elem_start, T_BLOCK)
        if HAS_SRC_ROW:
            g = tl.load(src_row + p, mask=inside, other=0).to(tl.int64)
        else:
            g = p
        f = g // src_bags
        s0 = (g - f * src_bags) * src_stride + tl.load(src_col + f, mask=inside, other=0)
        m2 = real[:, None] & (cols[None, :] < D[:, None])
        x = tl.load(src + s0[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_SCALE:
            x = x * tl.load(scale + p, mask=inside, other=0.0).to(tl.float32)[:, None]
        # each row's run total within the tile: a 0/1 matrix of equal keys times the tile, in
        # exact fp32 (ieee: no tf32 rounding) and in a fixed order
        same = key[:, None] == key[None, :]
        acc = tl.dot(same.to(tl.float32), x, input_precision="ieee")
        cnt = tl.sum((same & real[None, :]).to(tl.int32), axis=1)
        nxt = tl.load(sorted_key + j + 1, mask=j + 1 < n, other=-2)
        ends = inside & (nxt != key)
        # partial sums of the runs crossing the tile's edges: the first run's if it began
        # before this tile, the last run's if it goes on after it
        head_row = (j == first) & (key == prev)
        tail_row = (j == last) & ~ends
        at = tile * BLOCK_D + cols[None, :] + 0 * j[:, None]
        tl.store(head + at, acc, mask=head_row[:, None])
        tl.store(tail + at, acc, mask=tail_row[:, None])
        if COUNT:
            tl.store(counts + tile + 0 * j, cnt, mask=head_row)
            tl.store(counts + tiles + tile + 0 * j, cnt, mask=tail_row)
        done = real & ends & (key != prev)
    else:
        # the tile where a crossing run starts adds the pieces the later tiles left, in order
        k = tl.load(sorted_key + last)
        nxt = tl.load(sorted_key + last + 1, mask=last + 1 < n, other=-2)
        todo = (nxt == k) & (k != prev) & (k >= 0)
        acc1 = tl.where(todo, tl.load(tail + tile * BLOCK_D + cols), 0.0)  # (in bounds either way)
        cnt1 = tl.where(todo, tl.load(counts + tiles + tile), 0)
        q0 = tile + 1
        more = todo
        while more:
            q = q0 + tl.arange(0, 16)
            valid = (q < tiles) & (tl.load(sorted_key + q * BLOCK_K, mask=q < tiles, other=-2) == k)
            acc1 += tl.sum(tl.load(head + q[:, None] * BLOCK_D + cols[None, :], mask=valid[:, None], other=0.0),
                           axis=0)
            if COUNT:
                cnt1 += tl.sum(tl.load(counts + q, mask=valid, other=0), axis=0)
            more = tl.sum(valid.to(tl.int32), axis=0) == 16
            q0 += 16
        key = tl.full([1], 0, tl.int64) + k
        D, base = _rows_of(key, row_start, dims, elem_start, T_BLOCK)
        acc = acc1[None, :]
        cnt = tl.full([1], 0, tl.int32) + cnt1
        done = tl.full([1], 0, tl.int1) | todo
    return key, D, base, acc, cnt, done


@triton.jit
def _segment_grad_kernel(
    sorted_key, perm, src_row, scale, head, tail, counts, n, tiles, src, src_stride, src_bags, src_col,
    row_start, dims, elem_start, grad,
    PHASE: tl.constexpr, HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, COUNT: tl.constexpr,
    T_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    key, D, base, acc, cnt, done = segment_rows(
        PHASE, sorted_key, perm, src_row, scale, head, tail, counts, n, tiles, src, src_stride, src_bags, src_col,
        row_start, dims, elem_start, HAS_SRC_ROW, HAS_SCALE, COUNT, T_BLOCK, BLOCK_K, BLOCK_D)
    if COUNT:  # scale_grad_by_freq
        acc = acc / tl.maximum(cnt, 1).to(tl.float32)[:, None]
    cols = tl.arange(0, BLOCK_D)
    tl.store(grad + base[:, None] + cols[None, :], acc.to(grad.dtype.element_ty),
             mask=done[:, None] & (cols[None, :] < D[:, None]))


def reduce_segments(keys, layout: Layout, src, out, scale_by_freq=False, **src_args):
    """Write each touched row's gradient sum into the flat buffer `out` (laid out as `layout`)."""
    if keys.numel() == 0 or layout.max_dim == 0:
        return out
    Segments(keys, layout, src, **src_args).launch(_segment_grad_kernel, out, count=scale_by_freq)
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
