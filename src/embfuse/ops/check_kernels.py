"""The deferred check's kernels and their launchers: one pass over a batch's ids (and offsets) that
ORs its findings into the call's status pair and writes its verdict into the device log's
pinned ring (ops/deferred.py says how the check works and when it reports), and the
check_ids_program that a small lookup folds into its own launch."""

import torch

from embfuse._triton import cdiv, constexprs, launch, next_pow2, tl, tracing, triton
from embfuse.ops import tuning
from embfuse.ops.residency import hot_ids

# the check's flags
BAD_ID, BAD_OFFSETS = 1, 2
K_BAD_ID, K_BAD_OFFSETS = constexprs(BAD_ID, BAD_OFFSETS)
RING = 4096  # eager calls a device log tells apart (deferred.DeviceLog)
# int32 words from one status pair to the next: each pair starts 16 bytes apart, so that every
# pair a kernel gets has the same alignment (Triton compiles a variant per pointer alignment)
PAIR_STRIDE = 4
K_RING, K_PAIR_STRIDE = constexprs(RING, PAIR_STRIDE)


# ---- the kernels: one pass over the batch, a verdict in `status` and in the host's ring ----

@triton.jit
def _report(status, ring, slot, seq, flags, programs):
    """Every program of a check (`programs` of them) ORs its flags into status[0] and takes a
    ticket from status[1]; the last one writes the verdict into ring[slot], the host's pinned
    memory, where the host reads it without waiting: an eager call's seq * 16 + (all flags); a
    CUDA graph's check (a slot past K_RING) counts its bad replays in the word's upper bits, the
    last one's flags below, so that a good replay after a bad one hides nothing (DeviceLog.poll)."""
    tl.atomic_or(status, flags, mask=flags != 0)
    ticket = tl.atomic_add(status + 1, 1, sem="acq_rel")
    if ticket == programs - 1:
        total = tl.atomic_or(status, 0, sem="acquire")
        if slot < K_RING:
            tl.store(ring + slot, seq.to(tl.int64) * 16 + total)
        elif total != 0:  # (one replay at a time on its stream: the graph is this word's only writer)
            count = tl.load(ring + slot, volatile=True) >> 4
            tl.store(ring + slot, (count + 1) * 16 + total)


@triton.jit
def next_pair(statuses, slot):
    """The status pair that the check of the eager call in ring slot `slot` clears for the call
    after it (DeviceLog.next_status), in the device log's `statuses` (RING int32 pairs, PAIR_STRIDE
    apart). A lookup that folds the check in gets the base (take_fold)."""
    return statuses + ((slot + 1) % K_RING) * K_PAIR_STRIDE


@triton.jit
def wait_for_check(status, programs):
    """The flags of a check whose `programs` programs run in this same launch ahead of this one
    (lower program ids: the GPU starts a grid's programs in order, the interpreter runs them in
    order), once all have reported (_report). Volatile loads go to L2, where the check's atomics
    are: an L1 line of status could be stale. (One kernel instead of two: a launch costs tens of
    microseconds of host time; benchmarks/NOTES.md, session 21.)"""
    while tl.load(status + 1, volatile=True) < programs:
        pass
    return tl.load(status, volatile=True)


@triton.jit
def check_ids_program(pid, programs, indices, n, offsets, n_offsets, num_embeddings, status, status_next, ring, slot,
                      seq, out, info, words, BLOCK: tl.constexpr, CHECK: tl.constexpr, REMAP: tl.constexpr,
                      CLAMP_LAST: tl.constexpr = False, HOT: tl.constexpr = True):
    """Program `pid` of `programs` of the check of one table's ids: positions pid * BLOCK on.
    Ids in [0, num_embeddings); offsets (if any) start at 0, never decrease, end at most n.
    CLAMP_LAST: the last offset reads as at least n (torch's include_last_offset rule: the last
    bag runs to the end of the ids whatever it says; past the end is still an error).
    REMAP: also write into `out` each id as the lookup reads it: with HOT, hot rows from their
    resident copy (ops/residency.py); else the id in out's dtype (a bad lane's wrapped: the lookup
    reads status first). Without CHECK that is all. Program 0 also clears `status_next`, the
    status of the next call (see DeviceLog)."""
    # lanes count in int32 from the block's int64 start (fewer registers, as the keyed check's:
    # benchmarks/NOTES.md, session 16), and only blocks that hold offsets read them
    # (n is not specialised, so a mask from it loads one id at a time: a whole block loads and
    # stores without one, in 16-byte vectors; benchmarks/NOTES.md, session 63)
    start = pid.to(tl.int64) * BLOCK
    lanes = tl.arange(0, BLOCK)
    whole = start + BLOCK <= n
    in_ids = lanes < tl.maximum(tl.minimum(n - start, BLOCK), 0).to(tl.int32)
    if whole:
        ids = tl.load(indices + start + lanes)
    else:
        ids = tl.load(indices + start + lanes, mask=in_ids, other=0)
    if REMAP:
        new = ids
        if HOT:
            ok = in_ids & (ids >= 0) & (ids < num_embeddings)
            new = hot_ids(ids.to(tl.int64), ok, 0, tl.load(info + 2), words)
        if whole:
            tl.store(out + start + lanes, new.to(out.dtype.element_ty))
        else:
            tl.store(out + start + lanes, new.to(out.dtype.element_ty), mask=in_ids)
    if CHECK:
        flags = tl.max((in_ids & ((ids < 0) | (ids >= num_embeddings))).to(tl.int32)) * K_BAD_ID
        if start < n_offsets:
            pos = start + lanes
            cur = tl.load(offsets + pos, mask=pos < n_offsets, other=0)
            has_next = pos < n_offsets - 1
            nxt = tl.load(offsets + pos + 1, mask=has_next, other=0)
            if CLAMP_LAST:
                cur = tl.where(pos == n_offsets - 1, tl.maximum(cur, n), cur)
                nxt = tl.where(pos + 1 == n_offsets - 1, tl.maximum(nxt, n), nxt)
            # offsets[0] == 0 and offsets[-1] <= n are checked by the lanes that hold those entries
            bad_off = (has_next & (nxt < cur)) | ((pos == 0) & (cur != 0)) | ((pos == n_offsets - 1) & (cur > n))
            flags = flags | tl.max(bad_off.to(tl.int32)) * K_BAD_OFFSETS
        if pid == 0:
            tl.store(status_next + tl.arange(0, 2), tl.zeros([2], tl.int32))
        _report(status, ring, slot, seq, flags, programs)


@triton.jit(do_not_specialize=["slot", "seq", "n", "n_offsets"])
def _check_ids_kernel(indices, n, offsets, n_offsets, num_embeddings, status, status_next, ring, slot, seq, out, info,
                      words, BLOCK: tl.constexpr, CHECK: tl.constexpr, REMAP: tl.constexpr, CLAMP_LAST: tl.constexpr,
                      HOT: tl.constexpr):
    """check_ids_program, a program a block."""
    check_ids_program(tl.program_id(0), tl.num_programs(0), indices, n, offsets, n_offsets, num_embeddings, status,
                      status_next, ring, slot, seq, out, info, words, BLOCK, CHECK, REMAP, CLAMP_LAST, HOT)


@triton.jit
def _features_at(offsets, p, B, F, FBLOCK: tl.constexpr):
    """The feature whose values hold each position of `p`: the last f in [0, F) with
    offsets[f * B] <= p, clamped into [0, F) whatever the offsets say. The starts are counted,
    FBLOCK at a time, so that their loads go out together (a binary search of them waited on one
    load a step: benchmarks/NOTES.md, session 46)."""
    count = tl.zeros(p.shape, dtype=tl.int32)
    for first in range(0, F, FBLOCK):
        k = first + tl.arange(0, FBLOCK)
        start = tl.load(offsets + k.to(tl.int64) * B, mask=k < F, other=0).to(tl.int64)
        count += tl.sum(((start[None, :] <= p[:, None]) & (k < F)[None, :]).to(tl.int32), axis=1)
    return tl.maximum(count - 1, 0).to(tl.int64)


# F is never a constant: with F == 1 the feature search folds away and Triton 3.6's coalesce
# pass asserted on the one-limit branch below (an H100 run, benchmarks/NOTES.md session 16)
@triton.jit(do_not_specialize=["slot", "seq", "F", "n", "FB", "B"])
def _check_bags_kernel(values, offsets, limits, n, FB, B, F, status, status_next, ring, slot, seq, out, info, words,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr, FBLOCK: tl.constexpr, CHECK: tl.constexpr,
                       REMAP: tl.constexpr, MAX_ID: tl.constexpr, TAIL: tl.constexpr, HOT: tl.constexpr):
    """A keyed batch (F * B bags, feature-major): offsets from 0 to n, never decreasing; each
    value inside its feature's table (limits[f] rows; -rows: ids < 0 allowed too). One flat pass: program i reads CHUNKS
    blocks of BLOCK values (and offsets) from i * CHUNKS * BLOCK on, and reports once. The
    features at the blocks' first values come from one count of the feature starts, all blocks
    at once (_features_at), each value's from the few feature starts inside its block:
    almost every block lies in one feature. The per-bag pass it replaces (8 bags a program) left
    lanes idle on short bags; a binary search per value was latency-bound (benchmarks/NOTES.md,
    sessions 10 and 14). REMAP, HOT, CHECK: as check_ids_program (info:
    ops/residency.py Resident.info).
    TAIL: a padded batch (sparse/padded.py): offsets end at most at n, and the values after
    offsets[FB] belong to no bag and are neither checked nor remapped."""
    pid = tl.program_id(0)
    if TAIL:
        real = tl.minimum(tl.maximum(tl.load(offsets + FB).to(tl.int64), 0), n)
    else:
        real = n
    start = pid.to(tl.int64) * (CHUNKS * BLOCK)
    # the features at every block's first value (and the next program's), found at once
    j = tl.arange(0, 2 * CHUNKS)
    f_at = _features_at(offsets, start + j.to(tl.int64) * BLOCK, B, F, FBLOCK)
    bad_any = tl.zeros([BLOCK], dtype=tl.int32)
    bad_off_any = tl.zeros([BLOCK], dtype=tl.int32)
    lane = tl.arange(0, BLOCK)
    for c in range(CHUNKS):
        # lanes count in int32 from the block's first position (int64): the block's bounds
        # and feature starts are scalars clamped to [-1, BLOCK] first
        first = start + c * BLOCK
        whole = first + BLOCK <= real  # (no mask: 16-byte loads, as in check_ids_program)
        in_values = lane < tl.minimum(real - first, BLOCK).to(tl.int32)
        if whole:
            v = tl.load(values + first + lane)
        else:
            v = tl.load(values + first + lane, mask=in_values, other=0)
        f_first = tl.sum(tl.where(j == c, f_at, 0))
        f_next = tl.sum(tl.where(j == c + 1, f_at, 0))  # the next block's first: at least this one's last
        f = tl.zeros([BLOCK], dtype=tl.int32) + f_first.to(tl.int32)
        for k in range(f_first + 1, f_next + 1):  # the few feature starts inside this block
            at = tl.load(offsets + k * B).to(tl.int64) - first
            f += (lane >= tl.minimum(tl.maximum(at, -1), BLOCK).to(tl.int32)).to(tl.int32)
        # (a negative limit: a feature whose ids < 0 are dropped later, ops/validate.py in_range)
        if f_next == f_first:  # a block inside one feature (almost all): one limit, compared in the ids' width
            one = tl.load(limits + f_first)
            rows = tl.minimum(tl.abs(one), MAX_ID).to(v.dtype)  # (a table past MAX_ID rows holds every id)
            bad = in_values & (((v < 0) & (one > 0)) | ((v >= rows) & (tl.abs(one) <= MAX_ID)))
        else:
            limit = tl.load(limits + f, mask=in_values, other=0)
            bad = in_values & (((v < 0) & (limit > 0)) | (v >= tl.abs(limit)))
        bad_any = tl.maximum(bad_any, bad.to(tl.int32))
        if REMAP:
            new = v
            if HOT:
                first_row = tl.load(info + f * 3, mask=in_values, other=0)
                rel = tl.load(info + f * 3 + 2, mask=in_values, other=0)
                new = hot_ids(v.to(tl.int64), in_values & ~bad, first_row, rel, words)
            if whole:
                tl.store(out + first + lane, new.to(out.dtype.element_ty))
            else:
                tl.store(out + first + lane, new.to(out.dtype.element_ty), mask=in_values)
        if CHECK:
            if first <= FB:  # (offsets end at FB: most blocks lie past them)
                last = tl.minimum(FB - first, BLOCK).to(tl.int32)  # lane of offsets[FB], or BLOCK
                cur = tl.load(offsets + first + lane, mask=lane <= last, other=0).to(tl.int64)
                nxt = tl.load(offsets + first + lane + 1, mask=lane < last, other=0).to(tl.int64)
                if TAIL:
                    bad_end = cur > n
                else:
                    bad_end = cur != n
                bad_off = (((lane < last) & (nxt < cur)) | ((lane == 0) & (first == 0) & (cur != 0))
                           | ((lane == last) & bad_end))
                bad_off_any = tl.maximum(bad_off_any, bad_off.to(tl.int32))
    if CHECK:
        flags = tl.max(bad_any) * K_BAD_ID + tl.max(bad_off_any) * K_BAD_OFFSETS
        if pid == 0:
            tl.store(status_next + tl.arange(0, 2), tl.zeros([2], tl.int32))
        _report(status, ring, slot, seq, flags, tl.num_programs(0))


def _check_args(log, check) -> tuple:
    """The check kernels' (status, status_next, ring, slot, seq) for `check`; None (never read:
    CHECK is off) when there is none."""
    if check is None:
        return None, None, None, 0, 0
    return check.status, log.next_status(check), log.ring, check.slot, check.seq


def launch_ids_check(log, check, indices, offsets, num_embeddings, resident=None, out=None, clamp_last=False):
    """The check of one table's ids (and offsets); with an `out` it also writes the ids to read
    into it: hot rows from their copy with a `resident` (ops/residency.py), else the ids narrowed
    to out's dtype; with `check` None it only does that. `clamp_last`: check_ids_program's
    CLAMP_LAST (not on a lone offset: it holds no bag and stays as given, as clamp_last_offset)."""
    n, n_off = indices.numel(), 0 if offsets is None else offsets.numel()
    block = tuning.IDS_CHECK_BLOCK
    # (no offsets: an empty view, never read; never the ids again, see _triton._Distinct)
    launch(_check_ids_kernel)[(max(1, cdiv(max(n, n_off), block)),)](
        indices, n, offsets if offsets is not None else indices[:0], n_off, num_embeddings, *_check_args(log, check),
        out, None if resident is None else resident.info, None if resident is None else resident.words,
        BLOCK=block, CHECK=check is not None, REMAP=out is not None, CLAMP_LAST=clamp_last and n_off > 1,
        HOT=resident is not None, num_warps=tuning.IDS_CHECK_WARPS)


def launch_bags_check(log, check, values, offsets, limits, B, resident=None, out=None, tail=False):
    """The check of a keyed batch; `resident`, `out`, `check` None: as launch_ids_check; `tail`:
    a padded batch (values past the last offset belong to no bag)."""
    FB, n, block = offsets.numel() - 1, values.numel(), tuning.CHECK_BLOCK
    F = max(1, FB // max(B, 1))
    chunks = tuning.check_chunks(max(n, FB + 1))
    launch(_check_bags_kernel)[(max(1, cdiv(max(n, FB + 1), block * chunks)),)](
        values, offsets, limits, n, FB, max(B, 1), F, *_check_args(log, check), out,
        None if resident is None else resident.info, None if resident is None else resident.words,
        BLOCK=block, CHUNKS=chunks, FBLOCK=min(next_pow2(F), tuning.CHECK_FEATURES), CHECK=check is not None,
        REMAP=out is not None, MAX_ID=torch.iinfo(values.dtype).max, TAIL=tail, HOT=resident is not None,
        num_warps=tuning.CHECK_WARPS, **({} if chunks == 1 or tracing() else dict(maxnreg=tuning.CHECK_MAXNREG)))
