"""The deferred check: validation on the GPU without a host synchronisation per call.

One pass over a batch (a Triton kernel in ops/check_kernels.py: `_check_ids_kernel` for one
table's flat ids and offsets, `_check_bags_kernel` for a keyed batch's bags) ORs its findings
into the call's `status` tensor, int32 [flags, ticket]. A small single-table eager lookup runs
that pass as the first programs of its own pooling launch instead (take_fold): one launch
fewer, tens of microseconds of host time. Every later kernel of the call reads status once per
program, outside its loops: a forward of a bad batch pools no row (zeros), a backward writes no
gradient row and a fused optimizer updates nothing, so weights and optimizer state stay bitwise
unchanged.
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

from embfuse._triton import cdiv, tracing
from embfuse.ops.check_kernels import BAD_OFFSETS, PAIR_STRIDE, RING
from embfuse.ops.errors import BadBatchError, BadIdError
from embfuse.ops import tuning


def capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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
