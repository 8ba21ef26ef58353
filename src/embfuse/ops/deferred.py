"""The deferred check: validation on the GPU without a host synchronisation per call.

One pass over a batch (a Triton kernel: `_check_ids_kernel` for one table's flat ids and
offsets, `_check_bags_kernel` for a keyed batch's bags) ORs its findings into the call's `status`
tensor, int32 [flags, ticket]. A small single-table eager lookup runs that pass as the first
programs of its own pooling launch instead (take_fold): one launch fewer, tens of microseconds of
host time. Every later kernel of the call reads status once per program, outside its loops: a
forward of a bad batch pools no row (zeros), a backward writes no gradient row and a fused
optimizer updates nothing, so weights and optimizer state stay bitwise unchanged.
The last program of the check also writes its verdict into pinned host memory (`DeviceLog`),
which the host reads without waiting: the error is raised by the first embfuse call that starts
after the GPU has checked the batch, and at the latest by `embfuse.check_errors()`, which waits.
Inside torch.compile graphs and CUDA-graph captures the check runs as well (its status is then a
fresh tensor of the graph); a bad replay is reported by the next eager check point.

The mode logic every validation shares is ops/validate.py's `run_check`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from embfuse._triton import cdiv, constexprs, launch, next_pow2, tl, tracing, triton
from embfuse.ops.errors import BadBatchError, BadIdError
from embfuse.ops import tuning
from embfuse.ops.residency import hot_ids

# the check's flags
BAD_ID, BAD_OFFSETS = 1, 2
K_BAD_ID, K_BAD_OFFSETS = constexprs(BAD_ID, BAD_OFFSETS)
RING = 4096  # eager calls a device log tells apart (DeviceLog)
# int32 words from one status pair to the next: each pair starts 16 bytes apart, so that every
# pair a kernel gets has the same alignment (Triton compiles a variant per pointer alignment)
PAIR_STRIDE = 4
K_RING, K_PAIR_STRIDE = constexprs(RING, PAIR_STRIDE)


def capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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
    start = pid.to(tl.int64) * BLOCK
    lanes = tl.arange(0, BLOCK)
    in_ids = lanes < tl.maximum(tl.minimum(n - start, BLOCK), 0).to(tl.int32)
    ids = tl.load(indices + start + lanes, mask=in_ids, other=0)
    if REMAP:
        new = ids
        if HOT:
            ok = in_ids & (ids >= 0) & (ids < num_embeddings)
            new = hot_ids(ids.to(tl.int64), ok, 0, tl.load(info + 2), words)
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


@triton.jit(do_not_specialize=["slot", "seq", "n"])
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
@triton.jit(do_not_specialize=["slot", "seq", "F", "n"])
def _check_bags_kernel(values, offsets, limits, n, FB, B, F, status, status_next, ring, slot, seq, out, info, words,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr, FBLOCK: tl.constexpr, CHECK: tl.constexpr,
                       REMAP: tl.constexpr, MAX_ID: tl.constexpr, TAIL: tl.constexpr, HOT: tl.constexpr):
    """A keyed batch (F * B bags, feature-major): offsets from 0 to n, never decreasing; each
    value inside its feature's table (limits[f] rows; -rows: ids < 0 allowed too). One flat pass: program i reads CHUNKS
    blocks of BLOCK values (and offsets) from i * CHUNKS * BLOCK on, and reports once. The
    features at the blocks' first values come from one count of the feature starts, all blocks
    at once (_features_at), each value's from the few feature starts inside its block:
    almost every block lies in one feature. The per-bag pass it replaces (8 bags a program) left
    lanes idle on short bags (~1.3 TB/s); a binary search per value was latency-bound
    (benchmarks/NOTES.md, sessions 10 and 14). REMAP, HOT, CHECK: as check_ids_program (info:
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
        in_values = lane < tl.minimum(real - first, BLOCK).to(tl.int32)
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


# ---- the host side of the deferred check ----

_IN_CHECK_OP = threading.local()


@contextlib.contextmanager
def graph_check_op():
    """The body of a compiled graph's check op (ops/validate.py) runs in this: only there may a
    check be made inside Inductor's CUDA graphs, recording or warming up (see _inductor_graph)."""
    _IN_CHECK_OP.on = True
    try:
        yield
    finally:
        _IN_CHECK_OP.on = False


def _inductor_graph() -> bool:
    """Whether this check is made by a check op inside Inductor's CUDA graphs (torch.compile(mode=
    "reduce-overhead")), recording or in their warm-up run (eager, in the graph's pool): they
    refuse a tensor of their pool kept alive outside the graph. Told by the stack, and only asked
    inside a check op (eager calls pay nothing): the graph manager's state did not show from
    inside the graph's ops on the H100."""
    if not getattr(_IN_CHECK_OP, "on", False):
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("cudagraph_trees.py"):
            return True
        frame = frame.f_back
    return False


def _weakly(raise_error):
    """`raise_error` (a functools.partial) holding its tensors weakly, for a check made inside
    Inductor's CUDA graphs (_inductor_graph: its inputs may be their pool's memory). A view is
    kept as a weak reference to its base (a graph's reshape of the user's ids dies with the graph;
    the ids do not). When a tensor is gone by the report, this raises nothing and
    DeviceLog._fail says what the GPU saw (the flags, without a position)."""
    if not isinstance(raise_error, functools.partial):
        return raise_error
    func, keywords = raise_error.func, raise_error.keywords
    args = [_WeakTensor(a) if isinstance(a, torch.Tensor) else a for a in raise_error.args]

    def call():
        now = [a.get() if isinstance(a, _WeakTensor) else a for a in args]
        if all(n is not None for n, a in zip(now, args) if isinstance(a, _WeakTensor)):
            func(*now, **keywords)
    return call


class _WeakTensor:
    def __init__(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        self.base, self.view = weakref.ref(base), None if base is t else (t.size(), t.stride(), t.storage_offset())

    def get(self) -> Optional[torch.Tensor]:
        base = self.base()
        if base is None or self.view is None:
            return base
        return base.as_strided(*self.view)


class Check:
    """One call's check: its status tensor (int32 [flags, ticket]) for the call's kernels, and
    what the host needs to report it: the call's number, its ring slot, a function that finds
    the first bad entry and raises, and hooks to undo host state (a fused step count) if the
    batch turns out bad. `pending`: the check's own launch while it is not made yet (run_check
    `fold`): a kernel that folds the check in takes it (take_fold); reading `status` makes it.
    A check captured into a CUDA graph (`in_graph`) reports each bad replay: `reported` counts
    those the host has raised, and its undo hooks run once a bad replay when `replays_counted`
    (embfuse.fx.capture counts the graph's replays in the host's step counts; a raw replay
    advances none, so there is nothing to take back)."""

    __slots__ = ("_status", "seq", "slot", "raise_error", "undo", "what", "bad", "pending", "log", "reported",
                 "replays_counted")

    def __init__(self, status, seq, slot, raise_error, what, log):
        self._status, self.seq, self.slot, self.raise_error, self.what = status, seq, slot, raise_error, what
        # bad: None while the verdict is not known, True / False once the host has read it
        self.undo, self.bad, self.pending, self.log = [], None, None, log
        self.reported, self.replays_counted = 0, False

    @property
    def in_graph(self) -> bool:
        return self.slot >= RING

    @property
    def status(self) -> torch.Tensor:
        if self.pending is not None:
            self.launch()
        return self._status

    def launch(self) -> None:
        """Make the check's launch if it is still pending."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()


def take_fold(check: Optional[Check]):
    """(status, statuses, ring, slot, seq) for a kernel that runs `check` as its first programs
    (check_ids_program, wait_for_check; next_pair finds the pair it clears in `statuses`), when
    its launch is still pending (an eager call's: run_check). The check is then the caller's to
    run. None otherwise."""
    if check is None or check.pending is None:
        return None
    check.pending = None
    return check._status, check.log.status, check.log.ring, check.slot, check.seq


def folded_checks(n: int, n_offsets: int) -> int:
    """Programs of a check folded into a lookup's launch: each covers tuning.FOLD_BLOCK ids."""
    return max(1, cdiv(max(n, n_offsets), tuning.FOLD_BLOCK))


def _pairs(block: torch.Tensor) -> list:
    """The status pairs of a zeroed block of rows PAIR_STRIDE wide."""
    return list(block[:, :2].unbind(0))


class DeviceLog:
    """The deferred checks of one CUDA device (or, for the interpreter tests, of the CPU).

    ring: pinned host memory, one int64 a call slot: seq * 16 + flags once the GPU has checked
    call `seq`. status: device int32 pairs (PAIR_STRIDE apart), one a slot, reused round the
    ring; the check of call k clears the pair of call k + 1, so no call spends a launch on
    zeroing. A call whose status must outlive the next RING calls (an autograd backward reads it
    later) gets a pair of its own, never handed out again: a row of a block of FRESH pairs zeroed
    at once on the current stream (one block a stream: a pair is read on the stream its zeros
    were written on). Calls inside a CUDA-graph capture or torch.compile graph take their ring
    slots, and pairs zeroed at each replay, from a second half that eager calls never use."""

    RING = RING  # (the module's: the folded kernels read it as K_RING)
    FRESH = 1024

    def __init__(self, device):
        self.device = device
        self.ring = torch.zeros(2 * self.RING, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = self.ring.numpy()
        self.status = torch.zeros(self.RING, PAIR_STRIDE, dtype=torch.int32, device=device)
        self.rows = _pairs(self.status)
        self.scratch = torch.zeros(2, dtype=torch.int32, device=device)  # what graph checks "clear"
        # graph checks' pairs, made here: a pair made inside a capture would live in the graph's
        # memory pool, which Inductor's CUDA graphs (mode="reduce-overhead") refuse to leave held
        self.graph_rows = _pairs(torch.zeros(self.RING, PAIR_STRIDE, dtype=torch.int32, device=device))
        self.fresh = {}  # stream -> its block's unused pairs
        self.seq = 0
        self.pending = collections.deque()
        # checks captured into CUDA graphs, by slot: reported at every poll. A slot taken again (after
        # RING more graph checks) reports the new check's replays: the old graph's can no longer be told apart
        self.graph_checks = {}
        self.next_graph_slot = self.RING

    def start(self, raise_error, what, fresh: bool, track: bool = True) -> Check:
        """A new call's Check (after reporting what earlier calls left); `track`: the host
        reads its verdict later (else the caller reads status itself)."""
        self.poll()
        self.seq += 1
        seq = self.seq
        if _inductor_graph():
            raise_error = _weakly(raise_error)
        if capturing(self.status) or tracing():
            slot = self.next_graph_slot
            self.next_graph_slot = self.RING + (slot + 1 - self.RING) % self.RING
            self.host[slot] = 0
            status = self.graph_rows[slot - self.RING]
            status.zero_()  # (inside a capture: at every replay)
            check = self.graph_checks[slot] = Check(status, seq, slot, raise_error, what, self)
            return check
        slot = seq % self.RING
        status = self._fresh_pair() if fresh else self.rows[slot]
        check = Check(status, seq, slot, raise_error, what, self)
        if track:
            self.pending.append(check)
        return check

    def _fresh_pair(self) -> torch.Tensor:
        """A zeroed pair no other call gets (a torch.zeros per call costs a launch of host
        time, benchmarks/NOTES.md session 21)."""
        stream = torch._C._cuda_getCurrentStream(self.device.index)[0] if self.device.type == "cuda" else None
        pairs = self.fresh.get(stream)
        if not pairs:
            pairs = self.fresh[stream] = _pairs(torch.zeros(self.FRESH, PAIR_STRIDE, dtype=torch.int32,
                                                            device=self.device))
        return pairs.pop()

    def next_status(self, check: Check) -> torch.Tensor:
        """The status pair the check of `check` clears for the call after it."""
        if check.slot >= self.RING:
            return self.scratch  # graphs: their pairs are zeroed inside the graph
        return self.rows[(check.slot + 1) % self.RING]

    def poll(self) -> None:
        """Report the calls the GPU has checked since the last poll; never waits."""
        while self.pending:
            check = self.pending[0]
            check.launch()  # (a check no kernel ran: made now, reported later)
            word = int(self.host[check.slot])
            if word >> 4 < check.seq:
                break  # not checked yet (calls on one stream finish in order)
            self.pending.popleft()
            if word >> 4 > check.seq:  # the ring went round before we looked: ask the inputs
                self._fail(check, None)
            elif word & 15:
                self._fail(check, word & 15)
            else:
                check.bad = False
                check.undo.clear()
        for check in self.graph_checks.values():
            bad = int(self.host[check.slot])  # (bad replays so far) * 16 + the last one's flags (_report)
            if bad >> 4 > check.reported:
                replays, check.reported = (bad >> 4) - check.reported, bad >> 4
                self._fail(check, bad & 15, replays)

    def wait(self) -> None:
        """Wait for the GPU, then report every call it has checked."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.poll()

    def _fail(self, check: Check, flags, replays: int = 0) -> None:
        """Raise the error of a call the GPU found bad (flags None: the verdict was lost to a
        ring that went round; the inputs are asked again), or of `replays` new bad replays of a
        CUDA graph's check (flags: the last one's)."""
        if replays:
            call = f"{replays} replay(s) of the CUDA graph that captured {check.what} call #{check.seq}"
            note = f" [deferred: {call} on {self.device}; nothing was pooled or updated from them]"
        else:
            call = f"{check.what} call #{check.seq}"
            note = f" [deferred: the batch of {call} on {self.device}; nothing was pooled or updated from it]"
        try:
            check.raise_error()  # (a graph's: its inputs as they are now, the last replay's if nothing changed them)
        except (BadIdError, BadBatchError) as e:
            self._mark_bad(check, replays)
            raise type(e)(str(e) + note) from None
        if flags is None:  # lost, and the inputs are good
            check.bad = False
            check.undo.clear()
            return
        self._mark_bad(check, replays)  # the inputs changed since: say what the GPU saw
        if flags & BAD_OFFSETS:
            raise BadBatchError(f"{call} had bad offsets or lengths{note}")
        raise BadIdError(f"{call} had an out-of-range id{note}")

    @staticmethod
    def _mark_bad(check: Check, replays: int) -> None:
        if check.in_graph:  # (stays: every later replay is checked too)
            for _ in range(replays if check.replays_counted else 0):
                for undo in check.undo:
                    undo()
            return
        check.bad = True
        for undo in check.undo:
            undo()
        check.undo.clear()


_LOGS: dict = {}


def device_log(device) -> DeviceLog:
    log = _LOGS.get(device)  # (a tensor's own device: no new torch.device on every call)
    if log is not None:
        return log
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    log = _LOGS.get(device)
    if log is None:
        with _disable_current_modes():  # (real tensors if a trace makes it, as torch.export's: it outlives the trace)
            log = _LOGS[device] = DeviceLog(device)
    return log


@torch.compiler.assume_constant_result
def prepare_log(device: str) -> bool:
    """Make a GPU's log while a graph is traced (plain Python then), not when the graph first
    runs: Inductor's CUDA graphs (mode="reduce-overhead") run a graph's first call inside their
    memory pool, where the log's tensors must not be made."""
    if device.startswith("cuda"):
        device_log(device)
    return True


def check_errors() -> None:
    """Raise the error of any earlier call whose batch was bad (see bounds_check="deferred").
    Waits for each GPU that has run embfuse's checks: a synchronisation."""
    for log in list(_LOGS.values()):
        log.wait()


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
        num_warps=tuning.CHECK_WARPS)


class TracedCheck:
    """The check of a call inside a torch.compile graph: only its status (the custom op's
    output); the op's body, run by the compiled code at every call, is the eager check."""

    __slots__ = ("status",)
    bad = pending = None

    def __init__(self, status):
        self.status = status


# the status copies that compiled graphs' check ops return (ops/validate.py), each to its eager Check,
# held weakly by the copy: a fused update inside a compiled backward finds its batch's Check by it
_COPIES = WeakIdKeyDictionary()


def status_copy(check: Optional[Check], like: torch.Tensor) -> torch.Tensor:
    """What a compiled graph's check op returns: a copy of its status (zeros with no check). The
    copy of an eager-path check (torch.compile's default mode runs the op's body eagerly) leads
    back to its Check (check_of), so a fused update in the compiled backward counts its step as an
    eager one does: not at all when the batch is known bad, taken back when it is found bad later.
    Checks captured into CUDA graphs are not linked: a replay does not advance the step count."""
    if check is None:
        return torch.zeros(2, dtype=torch.int32, device=like.device)
    copy = check.status.clone()
    if check.slot < DeviceLog.RING:
        _COPIES[copy] = check
    return copy


def check_of(status: Optional[torch.Tensor]) -> Optional[Check]:
    """The eager Check whose status_copy `status` is, or None."""
    return None if status is None else _COPIES.get(status)


def known_good(status: Optional[torch.Tensor]) -> bool:
    """Whether a deferred check passed, read back (a synchronisation): for the torch-op paths
    that still run on a GPU (float64 tables), which would fault on a bad id."""
    return status is None or int(status[0]) == 0
