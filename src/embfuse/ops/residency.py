"""Hot rows resident in L2: a copy of the most looked-up rows, read through a persisting window.

Power-law batches read a few rows again and again; in a plain lookup they share the L2 with the
cold rows streaming through and are read from DRAM again once evicted. Residency copies each
table's hottest rows into one small contiguous buffer (`hot`), marks it persisting for the
lookup's launch (ops/l2.py), and rewrites the batch's ids so that the unchanged pooling kernels
read a hot id's row from the copy:

    global row r (a table's first row + id) is hot  <=>  bit r % 32 of word r // 32 is set
    its slot = (hot rows before r) = prefix[r // 32] + popcount(bits below r % 32)
    new id = rel(table) + slot, where table + rel * D is the copy's slot 0 of that table

`words[r // 32]` packs (prefix << 32) | bits in one int64 (10M rows: 2.5 MB, itself L2-resident).
Hot rows are taken in global-row order, so each table's hot rows are one run of slots; each run
is placed in `hot` at a distance from its table that is a multiple of the table's width, so the
new id is an integer and `table + new_id * D` is the copy's row (another allocation, reached
from the table's pointer: the kernels' address arithmetic is 64-bit). The rewrite happens in
the check's pass over the ids (`hot_ids`, called by ops/check_kernels.py's kernels: no launch
and no read of the ids of its own; with bounds_check="off" or after "skip" drops ids, the same
kernel runs without checking). Tried first and measured slower (benchmarks/NOTES.md, session
14): the remap word read inside the pooling loop (a dependent load and registers in the hot
loop, slower with no row hot), then a pass of its own (a second read of the ids, and for a
collection a search of each value's feature).

A copy, not a permutation: the table, its optimizer state and the state_dict keep the user's
row order and are never touched; outputs are bitwise those of the plain lookup (the same values
are read, pooled in the same order). The copy is made again whenever the table may have
changed (its version counter, its storage, a fused step).

Sizing (`choose`), from the counts of a batch the module saw: a row is worth pinning when it is
looked up more often per byte than the average looked-up row (an average row gains nothing
from pinning over the L2's ordinary caching); rows are taken hottest-per-byte first up to the
persisting set-aside the device allows (cuDeviceGetAttribute: max persisting L2, max window).
If the rows taken serve fewer than MIN_HIT_RATE of the lookups, residency turns itself off
(uniform ids: nothing is hot, and the window would only take L2 away).

In place: when the counted lookups crowd into one run of rows (ids numbered by frequency, as
many vocabularies are, put the hottest rows first; a small table that most lookups hit), the window
can lie over the table itself, and there is nothing to copy or rewrite. `choose` also finds the
run of rows, as many bytes as the copy, that serves the most counted lookups, and reads in place
when that run serves at least IN_PLACE_SHARE of what the copy serves (held out, as the copy):
the rewrite costs about what the window gives at the measured shapes (benchmarks/NOTES.md,
session 25), so the run need not match the copy to win. A lookup captured into a CUDA graph
keeps an in-place window (its kernel nodes carry it; the table is read as it is at replay).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import tl, triton, use_kernels

MIN_HIT_RATE = 0.10
IN_PLACE_SHARE = 0.5
# per-feature columns of Resident.info
FIRST_ROW, ROWS, REL = 0, 1, 2


@dataclass
class HotSet:
    """A chosen hot set: `rows` the hot global rows ascending; `words` the remap words;
    `tables[t]` = (first slot, count) of table t's hot rows; `hit_rate` the share of the counted
    batch's lookups they serve (held out: see `choose`); `nbytes` the copy's size; `reason` why
    there is none (rows empty). `in_place`: (first global row, end, byte offset of the first in
    the weights) of a run read in place instead (module docstring; `nbytes` its bytes, rows and
    words empty)."""

    rows: Tensor
    words: Tensor
    tables: list[tuple[int, int]]
    hit_rate: float
    nbytes: int
    reason: str = ""
    in_place: Optional[tuple[int, int, int]] = None

    def serves(self, global_rows: Tensor) -> Tensor:
        """Which of `global_rows` the hot set holds."""
        if self.in_place is not None:
            return (global_rows >= self.in_place[0]) & (global_rows < self.in_place[1])
        return torch.isin(global_rows, self.rows)


def remap_words(rows: Tensor, num_rows: int) -> Tensor:
    """The remap words of the distinct global rows `rows` (module docstring). Device ops."""
    n_words = (num_rows + 31) // 32
    rows = rows.long()
    bits = torch.zeros(n_words, dtype=torch.int64, device=rows.device)
    bits.scatter_add_(0, rows >> 5, torch.ones_like(rows) << (rows & 31))  # distinct rows: the sum is the OR
    per_word = torch.bincount(rows >> 5, minlength=n_words)
    prefix = torch.cumsum(per_word, 0) - per_word
    return (prefix << 32) | bits


def remap_reference(global_rows: Tensor, words: Tensor) -> tuple[Tensor, Tensor]:
    """(hot?, slot) of each global row: pure torch, the test oracle of `hot_ids`."""
    g = global_rows.long()
    word = words[g >> 5]
    bits = word & 0xFFFFFFFF
    bit = g & 31
    hot = ((bits >> bit) & 1) == 1
    below = bits & ((torch.ones_like(bit) << bit) - 1)
    count = torch.zeros_like(below)
    for i in range(32):
        count += (below >> i) & 1
    return hot, (word >> 32) + count


def choose(global_rows: Tensor, row_starts: list[int], row_bytes: list[int], budget: int,
           row_at: Optional[list[int]] = None) -> HotSet:
    """The hot set for the lookups `global_rows` of tables starting at global rows `row_starts`
    (T + 1 entries) with rows of `row_bytes` bytes, at most `budget` bytes (module docstring).
    `row_at`: where each table's first row lies in the weights, in bytes (tables in order, rows
    packed), to weigh reading a run in place; None: the copy only.

    Chosen from every other lookup and judged on the others: counted in-sample, a uniform
    batch's rows seen twice look hot by chance (11% of 50K uniform lookups over 100K rows), and
    its held-out hit rate shows they are not. Device ops and one host read."""
    device = global_rows.device
    num_rows = row_starts[-1]
    empty = torch.zeros(0, dtype=torch.int64, device=device)

    def off(hit, reason):
        return HotSet(empty, remap_words(empty, num_rows), [(0, 0)] * (len(row_starts) - 1), hit, 0, reason)

    global_rows = global_rows[(global_rows >= 0) & (global_rows < num_rows)]  # a bad batch counts its good ids
    if global_rows.numel() < 2 or budget <= 0:
        return off(0.0, "no lookups counted" if budget > 0 else "the device allows no persisting L2")
    counted, judged = global_rows[0::2].long(), global_rows[1::2].long()
    rows, counts = torch.unique(counted, return_counts=True)
    starts = torch.tensor(row_starts, device=device)
    table = torch.bucketize(rows, starts[1:], right=True)
    size = torch.tensor(row_bytes, dtype=torch.float64, device=device)[table]
    density = counts / size
    average = counted.numel() / size.sum()  # lookups per byte over the distinct rows
    order = torch.argsort(density, descending=True, stable=True)
    fits = (torch.cumsum(size[order], 0) <= budget) & (density[order] > average)
    taken = order[fits]
    hot_rows = torch.sort(rows[taken]).values
    hit = torch.isin(judged, hot_rows).sum() / judged.numel()
    nbytes = size[taken].sum()
    per_table = torch.bincount(table[taken], minlength=len(row_starts) - 1)
    run = [] if row_at is None else _best_run(rows, counts, table, size, starts, row_at, nbytes, judged)
    read = torch.cat([torch.stack([t.double() for t in (hit, nbytes, *run)]), per_table.double()]).tolist()
    hit, nbytes, run, per_table = read[0], int(read[1]), read[2:2 + len(run)], [int(k) for k in read[2 + len(run):]]
    if hit < MIN_HIT_RATE:
        return off(hit, f"the hottest rows that fit serve {hit:.1%} of lookups (< {MIN_HIT_RATE:.0%}): nothing is hot")
    if run and run[0] >= max(IN_PLACE_SHARE * hit, MIN_HIT_RATE):
        in_hit, first, end, at, span = run
        return HotSet(empty, empty, [(0, 0)] * (len(row_starts) - 1), in_hit, int(span), in_place=(
            int(first), int(end), int(at)))
    tables = list(zip(itertools.accumulate(per_table, initial=0), per_table))
    return HotSet(hot_rows, remap_words(hot_rows, num_rows), tables, hit, nbytes)


def _best_run(rows, counts, table, size, starts, row_at, budget, judged) -> list[Tensor]:
    """The run of global rows lying within `budget` bytes of the weights that serves the most
    counted lookups (`rows`: the distinct counted rows ascending, `counts`, their `table` and
    row `size`): [its held-out hit rate, first row, end row, byte offset, bytes], 0-d float64
    tensors (exact below 2**53). Device ops."""
    at = torch.tensor(row_at, dtype=torch.float64, device=rows.device)[table] + (rows - starts[table]) * size
    end = at + size  # ascending with `rows`: tables in order, rows packed
    hits = torch.cumsum(counts, 0)
    last = torch.searchsorted(end, at + budget, right=True) - 1  # the last counted row of the run from each on
    best = torch.argmax(hits[last] - hits + counts)
    first, final = rows[best], rows[last[best]]
    in_hit = ((judged >= first) & (judged <= final)).sum() / judged.numel()
    return [in_hit.double(), first.double(), final.double() + 1, at[best], end[last[best]] - at[best]]


@dataclass
class Resident:
    """What the check's rewrite reads: `hot` (the copy), `words`, and `info` (F, 3): per feature its
    table's first global row, its rows (ids outside [0, rows) are left as they are, for the
    check's verdict) and `rel` (new id of slot 0: module docstring); `int32`: whether every new
    id fits in int32; `window`: bytes of `hot` to mark persisting. Read in place: `hot` is the
    run's first row in the weights, and `words` and `info` are None (nothing to rewrite)."""

    hot: Tensor
    words: Optional[Tensor]
    info: Optional[Tensor]
    int32: bool
    window: int = 0

    @property
    def remap(self) -> Optional["Resident"]:
        """What the check rewrites the ids by (validate's `remap=`): None when read in place."""
        return None if self.words is None else self


def remap_values_reference(values: Tensor, feature: Tensor, resident: Resident) -> Tensor:
    """Pure torch: each value's new id (the test oracle of the check kernels' rewrite)."""
    info = resident.info[feature]
    ids = values.long()
    valid = (ids >= 0) & (ids < info[:, ROWS])
    hot, slot = remap_reference(torch.where(valid, info[:, FIRST_ROW] + ids, 0), resident.words)
    return torch.where(valid & hot, info[:, REL] + slot, ids)


@triton.jit
def hot_ids(ids, valid, first_row, rel, words):
    """The ids the lookup should read (module docstring): rel + slot for a hot id, the id itself
    otherwise, and for every lane not `valid` (masked, or outside its table: the check's verdict
    stands on it, and no remap word is read for it). Run inside the check's pass over the ids
    (ops/check_kernels.py), so the rewrite costs no launch and no second read of the ids."""
    g = first_row + tl.where(valid, ids, 0)
    word = tl.load(words + (g >> 5), mask=valid, other=0)
    bit = (g & 31).to(tl.uint32)
    bits = word.to(tl.uint32)  # the low half; 32-bit lanes from here
    is_hot = valid & (((bits >> bit) & 1) != 0)
    x = bits & ((tl.full(bit.shape, 1, tl.uint32) << bit) - 1)
    x = x - ((x >> 1) & 0x55555555)  # popcount, SWAR
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = (x * 0x01010101) >> 24
    return tl.where(is_hot, rel + (word >> 32) + x.to(tl.int64), ids)


def copy_hot(hot: Tensor, tables: list[Tensor], hot_set: HotSet, row_starts: list[int], elem_offsets: list[int]):
    """Write each table's hot rows into `hot` (tables[t]: (rows, D) views; elem_offsets[t]:
    where table t's hot run starts in `hot`). One index_select per table with hot rows."""
    for t, (first, k) in enumerate(hot_set.tables):
        if k:
            D = tables[t].shape[1]
            local = hot_set.rows[first:first + k] - row_starts[t]
            dst = hot[elem_offsets[t]:elem_offsets[t] + k * D].view(k, D)
            torch.index_select(tables[t], 0, local, out=dst)


def layout(tables: list[Tensor], hot: Tensor, hot_set: HotSet) -> tuple[list[int], list[int]]:
    """(where each table's run starts in `hot`, in elements; rel of each table): each run at a
    distance from its table that is a multiple of the table's width (`hot` has room for the
    padding: sum of widths)."""
    elem, rel, cursor = [], [], 0
    for t, (first, k) in zip(tables, hot_set.tables):
        D = t.shape[1]
        to_hot = (hot.data_ptr() - t.data_ptr()) // t.element_size()
        start = cursor + (-(to_hot + cursor)) % D
        elem.append(start)
        rel.append((to_hot + start) // D - first)
        cursor = start + k * D
    return elem, rel


@dataclass(frozen=True)
class ResidencyReport:
    """What residency does now: `active`, the share of the counted batch's lookups its rows
    serve (`hit_rate`), the window (`window_bytes`), `hot_rows`, whether they are read
    `in_place` (a run of the table) or from a copy, and why it is off (`reason`)."""

    active: bool
    hit_rate: float = 0.0
    window_bytes: int = 0
    hot_rows: int = 0
    reason: str = ""
    in_place: bool = False


class Residency:
    """One module's hot rows: counted from a batch every `refresh` lookups (the first included),
    copied again whenever the table may have changed, read under a persisting window.

    A module calls `resident(...)` per lookup that trains nothing, has its check rewrite the ids
    (ops/validate.py, `remap=`) and looks them up inside `window(resident)`. Counting reads the
    device once (on its schedule only). A lookup captured into a CUDA graph keeps only a window
    read in place; with a copy it is the plain one: its replays would have to copy the hot rows
    each time (the table may change between them), and measured so, no replay gained
    (benchmarks/NOTES.md, session 27)."""

    def __init__(self, refresh: int = 1000):
        if isinstance(refresh, bool) or not isinstance(refresh, int) or refresh < 1:
            raise ValueError(f"the hot set's refresh interval must be a positive int of lookups, got {refresh!r}")
        self.refresh = refresh
        self.calls = 0
        self.hot_set: Optional[HotSet] = None
        self.report = ResidencyReport(False, reason="no lookup yet")
        self._hot = None  # (copy, per-table run starts, per-table rel), for the table's storage
        self._copied = None  # what the copy was taken from
        self._info = {}
        self._device, self._sup = None, None
        self._dtype = None  # the weights' dtype the hot set was sized for
        self.use_window = True  # False for measurements only (bench/residency.py): the copy without a window

    def resident(self, weights: Tensor, tables, row_starts: list[int], global_rows, feature_tables: list[int],
                 step: int = 0) -> Optional[Resident]:
        """The Resident for this lookup, or None (look up plainly). `tables()`: each table's
        (rows, D) view of `weights`; `global_rows()`: the batch's global rows (both called only
        when needed); `feature_tables`: each feature's table; `step`: the module's fused step
        count (a fused step changes rows without a version bump)."""
        if torch.compiler.is_compiling():  # traced code has no data pointers to place the copy by
            return None
        sup = self._support(weights)
        if not sup.ok:
            self.report = ResidencyReport(False, reason=sup.reason)
            return None
        if torch.cuda.is_current_stream_capturing():  # (counting reads the device)
            return self._in_place(weights)
        if self.calls % self.refresh == 0 or self.hot_set is None or self._dtype != weights.dtype:
            with torch.inference_mode(False), torch.no_grad():
                self._choose(weights, global_rows(), tables(), row_starts,
                             min(sup.max_persisting_bytes, sup.max_window_bytes))
        self.calls += 1
        hs = self.hot_set
        if hs is None or hs.in_place is not None:
            return self._in_place(weights)
        if not hs.rows.numel():
            return None
        where = (weights.data_ptr(), weights.dtype)
        key = (weights._version, step)
        features = tuple(feature_tables)
        if self._hot is None or self._hot[0] != where or self._copied != key or features not in self._info:
            with torch.inference_mode(False), torch.no_grad():
                self._refresh(weights, tables, row_starts, where, key, features)
        hot = self._hot[1]
        info, fits = self._info[features]
        return Resident(hot, hs.words, info, fits, self.report.window_bytes if self.use_window else 0)

    def _in_place(self, weights: Tensor) -> Optional[Resident]:
        """The Resident of a hot set read in place (its window over the weights as they are
        now), else None."""
        hs = self.hot_set
        if hs is None or hs.in_place is None or self.report.window_bytes == 0 or self._dtype != weights.dtype:
            return None
        first = weights.reshape(-1)[hs.in_place[2] // weights.element_size():]
        return Resident(first, None, None, False, self.report.window_bytes if self.use_window else 0)

    def _support(self, weights: Tensor):
        """ops/l2.py's support for the weights' device (cached: it is asked every lookup)."""
        from embfuse.ops import l2

        if self._device != weights.device:
            sup = l2.support(weights.device)
            if sup.ok and not use_kernels(weights):
                sup = l2.Support(False, "the lookup kernels need Triton")
            self._device, self._sup = weights.device, sup
        return self._sup

    def _refresh(self, weights, tables, row_starts, where, key, features) -> None:
        """A copy placed for the table's storage, taken again if the table may have changed, and
        the features' Resident.info."""
        hs = self.hot_set
        if self._hot is None or self._hot[0] != where:
            views = tables()
            hot = torch.empty(hs.nbytes // weights.element_size() + sum(v.shape[1] for v in views),
                              dtype=weights.dtype, device=weights.device)
            self._hot, self._info, self._copied = (where, hot, *layout(views, hot, hs)), {}, None
        _, hot, elem, rel = self._hot
        if self._copied != key:
            copy_hot(hot, tables(), hs, row_starts, elem)
            self._copied = key
        if features not in self._info:
            rows = [row_starts[t + 1] - row_starts[t] for t in range(len(rel))]
            info = [[row_starts[t], rows[t], rel[t]] for t in features]
            fits = all(abs(r) + hs.rows.numel() < 2**31 for r in rel) and max(rows) < 2**31
            self._info[features] = (torch.tensor(info, dtype=torch.int64, device=weights.device), fits)

    def _choose(self, weights: Tensor, global_rows: Tensor, tables: list[Tensor], row_starts: list[int],
                budget: int) -> None:
        from embfuse.ops import l2

        row_bytes = [t.shape[1] * t.element_size() for t in tables]
        row_at = [t.data_ptr() - weights.data_ptr() for t in tables]
        ends = [at + (row_starts[t + 1] - row_starts[t]) * b for t, (at, b) in enumerate(zip(row_at, row_bytes))]
        packed = (weights.is_contiguous() and all(t.stride() == (t.shape[1], 1) for t in tables)
                  and all(end <= at for end, at in zip(ends, row_at[1:])))  # tables in order, none overlapping
        hs = choose(global_rows, row_starts, row_bytes, budget, row_at if packed else None)
        self.hot_set, self._hot, self._info, self._copied, self._dtype = hs, None, {}, None, weights.dtype
        if hs.in_place is not None:
            self.report = ResidencyReport(True, hs.hit_rate, min(hs.nbytes, l2.reserve(hs.nbytes)),
                                          hs.in_place[1] - hs.in_place[0], in_place=True)
            return
        if not hs.rows.numel():
            self.report = ResidencyReport(False, hs.hit_rate, reason=hs.reason)
            return
        span = hs.nbytes + sum(row_bytes)  # with the runs' padding
        window = min(span, l2.reserve(span))
        self.report = ResidencyReport(True, hs.hit_rate, window, int(hs.rows.numel()))


def window(resident: Optional[Resident]):
    """The persisting window over `resident`'s rows (its copy, or the run read in place) on the
    current stream (a no-op for None)."""
    if resident is None or not resident.window:
        return contextlib.nullcontext()
    from embfuse.ops import l2

    return l2.persisting(resident.hot, resident.window)
