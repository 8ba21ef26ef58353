"""Input checks shared by every lookup op: one pass per batch, before any kernel reads a row.

Dtype, shape and device checks are host-only and raise at the call. The value checks (ids inside
their table, offsets that start at 0, never decrease and end inside the input) run as one pass
over the batch: a Triton kernel on CUDA, a few torch ops on the CPU. What happens when they fail
is the `bounds_check` mode:

- "deferred" (the default): on a GPU the check's result never travels to the host during the
  call. It lands in a small `status` tensor that every later kernel of the call reads first: a
  forward of a bad batch pools no row (its output is zeros), a backward writes no gradient row
  and a fused optimizer updates nothing, so weights and optimizer state stay bitwise unchanged.
  The check also writes its verdict into pinned host memory, which the host reads without
  waiting: the error is raised by the first embfuse call that starts after the GPU has checked
  the batch (usually the next one), and at the latest by `embfuse.check_errors()`, which waits
  for the GPU. On the CPU there is nothing to wait for: the error comes at the call.
- "sync": the same check, read back at once (a host synchronisation): the error comes at the
  call itself. For debugging.
- "skip": out-of-range ids are dropped from their bags with a warning (FBGEMM's WARNING mode);
  reads back once a call, like "sync". Bad offsets still raise.
- "off": nothing is checked (ids must be valid).

Kernels never check bounds themselves: they read `status` once per program, outside their loops.
Inside torch.compile graphs and CUDA-graph captures the deferred check runs as well (its status
is then a fresh tensor of the graph); a bad replay is reported by the next eager check point.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import Callable, Optional

import torch

from embfuse._triton import HAS_TRITON, cdiv, launch, tl, tracing, triton, use_kernels

BOUNDS_CHECK_MODES = ("deferred", "sync", "skip", "off")
DEFAULT_BOUNDS_CHECK = "deferred"
INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

BAD_ID = 1
BAD_OFFSETS = 2


class BadIdError(IndexError, RuntimeError):
    """An id outside its table. An IndexError, and a RuntimeError as torch raises for it."""


class BadBatchError(ValueError, RuntimeError):
    """Offsets or lengths that do not describe the input. A ValueError, and a RuntimeError as
    torch raises for it."""


class BadDtypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype. A TypeError, and a RuntimeError as torch raises for it."""


class BadArgumentError(ValueError, RuntimeError):
    """An argument torch refuses with a RuntimeError (a shape, a padding_idx out of range): a
    ValueError here, and a RuntimeError too."""


class UnsupportedError(ValueError, NotImplementedError):
    """An option torch refuses with NotImplementedError: a ValueError here, and that too."""


DENSE, COO, ROWWISE = 0, 1, 2  # gradient layouts: dense, torch's COO, one entry per row
SPARSE_LAYOUTS = {False: DENSE, True: COO, "coo": COO, "rowwise": ROWWISE}


def sparse_layout(sparse) -> int:
    """The gradient layout `sparse` asks for: False (dense), True or "coo" (torch's: one entry
    per position, uncoalesced) or "rowwise" (one entry per distinct row, coalesced)."""
    try:
        return SPARSE_LAYOUTS[sparse]
    except (KeyError, TypeError):
        raise ValueError(f"sparse must be False, True, 'coo' or 'rowwise', got {sparse!r}") from None


def check_bounds_mode(bounds_check: str) -> None:
    if bounds_check not in BOUNDS_CHECK_MODES:
        raise ValueError(f"bounds_check must be one of {BOUNDS_CHECK_MODES}, got {bounds_check!r}")


def check_index_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise BadDtypeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_device(name: str, t: Optional[torch.Tensor], weight: torch.Tensor, weight_name: str = "weight") -> None:
    """Every tensor argument on the weight's device, named in the message."""
    if t is not None and t.device != weight.device:
        raise ValueError(f"{name} is on {t.device} but {weight_name} is on {weight.device}")


def check_weight(weight: torch.Tensor, op: str = "embedding") -> None:
    """A 2-D float table; the wording of torch's message for each op (code written for torch
    matches on it)."""
    if weight.dim() != 2:
        what = "weight has to be a 2D Tensor" if op == "embedding_bag" else "'weight' must be 2-D"
        raise BadArgumentError(f"{what} (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}")
    if weight.dtype not in WEIGHT_DTYPES and not (op == "embedding" and not weight.is_floating_point()
                                                  and not weight.is_complex() and weight.dtype != torch.bool):
        raise BadDtypeError(f"weight must be float32, float16, bfloat16 or float64, got {weight.dtype}"
                            + (" (embedding also looks up integer tables)" if op == "embedding" else ""))


def padding_index(padding_idx: int | None, num_embeddings: int) -> int:
    """torch's padding_idx rules (negative counts from the end); -1 stands for none."""
    if padding_idx is None:
        return -1
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise BadArgumentError(f"padding_idx must be within the number of embeddings, [-{num_embeddings}, "
                               f"{num_embeddings}), got {padding_idx}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# ---- the kernels: one pass over the batch, a verdict in `status` and in the host's ring ----

@triton.jit
def _report(status, ring, slot, seq, flags):
    """Every program ORs its flags into status[0] and takes a ticket from status[1]; the last
    one writes seq * 16 + (all flags) into ring[slot], the host's pinned memory, where the
    host reads it without waiting. Program 0 also clears `status_next`, the status of the next
    call (see DeviceLog)."""
    tl.atomic_or(status, flags, mask=flags != 0)
    ticket = tl.atomic_add(status + 1, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        total = tl.atomic_or(status, 0, sem="acquire")
        tl.store(ring + slot, seq.to(tl.int64) * 16 + total)


@triton.jit(do_not_specialize=["slot", "seq"])
def _check_ids_kernel(indices, n, offsets, n_offsets, num_embeddings, status, status_next, ring, slot, seq,
                      BLOCK: tl.constexpr):
    """Ids in [0, num_embeddings); offsets (if any) start at 0, never decrease, end at most n."""
    pid = tl.program_id(0)
    pos = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_ids = pos < n
    ids = tl.load(indices + pos, mask=in_ids, other=0)
    bad_id = in_ids & ((ids < 0) | (ids >= num_embeddings))
    cur = tl.load(offsets + pos, mask=pos < n_offsets, other=0)
    has_next = pos < n_offsets - 1
    nxt = tl.load(offsets + pos + 1, mask=has_next, other=0)
    # offsets[0] == 0 and offsets[-1] <= n are checked by the lanes that hold those entries
    bad_off = (has_next & (nxt < cur)) | ((pos == 0) & (cur != 0)) | ((pos == n_offsets - 1) & (cur > n))
    flags = tl.max(bad_id.to(tl.int32)) * 1 + tl.max(bad_off.to(tl.int32)) * 2  # BAD_ID | BAD_OFFSETS
    if pid == 0:
        tl.store(status_next + tl.arange(0, 2), tl.zeros([2], tl.int32))
    _report(status, ring, slot, seq, flags)


@triton.jit(do_not_specialize=["slot", "seq"])
def _check_bags_kernel(values, offsets, limits, n, FB, B, status, status_next, ring, slot, seq,
                       BAGS: tl.constexpr, BLOCK: tl.constexpr):
    """A keyed batch (F * B bags, feature-major): offsets from 0 to n, never decreasing; each
    bag's ids inside its feature's table (limits[f] rows). BAGS bags a program, side by side.
    (A flat pass over the values that found each value's feature by binary search over the
    feature starts was slower on the H100: its dependent gathers; benchmarks/NOTES.md.)"""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * BAGS + tl.arange(0, BAGS)
    real = g < FB
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    bad_off = real & ((end < start) | ((g == 0) & (start != 0)) | ((g == FB - 1) & (end != n)))
    limit = tl.load(limits + g // B, mask=real, other=0)
    # reads stay inside the values whatever the offsets say
    lo = tl.minimum(tl.maximum(start, 0), n)
    hi = tl.minimum(tl.maximum(end, lo), n)
    bad_id = tl.zeros([BAGS], dtype=tl.int32)
    for i in range(0, tl.max(hi - lo), BLOCK):
        p = lo[:, None] + i + tl.arange(0, BLOCK)[None, :]
        m = p < hi[:, None]
        v = tl.load(values + p, mask=m, other=0)
        bad_id = tl.maximum(bad_id, tl.max((m & ((v < 0) | (v >= limit[:, None]))).to(tl.int32), axis=1))
    flags = tl.max(bad_id) * 1 + tl.max(bad_off.to(tl.int32)) * 2
    if pid == 0:
        tl.store(status_next + tl.arange(0, 2), tl.zeros([2], tl.int32))
    _report(status, ring, slot, seq, flags)


# ---- the host side of the deferred check ----

class Check:
    """One call's check: its status tensor (int32 [flags, ticket]) for the call's kernels, and
    what the host needs to report it: the call's number, its ring slot, a function that finds
    the first bad entry and raises, and hooks to undo host state (a fused step count) if the
    batch turns out bad."""

    __slots__ = ("status", "seq", "slot", "raise_error", "undo", "what", "bad")

    def __init__(self, status, seq, slot, raise_error, what):
        self.status, self.seq, self.slot, self.raise_error, self.what = status, seq, slot, raise_error, what
        self.undo = []
        self.bad = None  # None: not known yet; True / False once the host has read the verdict


class DeviceLog:
    """The deferred checks of one CUDA device (or, for the interpreter tests, of the CPU).

    ring: pinned host memory, one int64 a call slot: seq * 16 + flags once the GPU has checked
    call `seq`. status: device int32 pairs, one a slot, reused round the ring; the check of
    call k clears the pair of call k + 1, so no call spends a launch on zeroing. A call whose
    status must outlive the next RING calls (an autograd backward reads it later) gets a fresh
    zeroed pair instead, as do calls inside a CUDA-graph capture or torch.compile graph, which
    take their ring slots from a second half that eager calls never use."""

    RING = 4096

    def __init__(self, device):
        self.device = device
        self.ring = torch.zeros(2 * self.RING, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = self.ring.numpy()
        self.status = torch.zeros(self.RING, 2, dtype=torch.int32, device=device)
        self.rows = list(self.status.unbind(0))
        self.scratch = torch.zeros(2, dtype=torch.int32, device=device)  # what graph checks "clear"
        self.seq = 0
        self.pending = collections.deque()
        self.graph_checks = []  # checks captured into CUDA graphs: reported at every poll
        self.next_graph_slot = self.RING

    def start(self, raise_error, what, fresh: bool, track: bool = True) -> Check:
        """A new call's Check (after reporting what earlier calls left); `track`: the host
        reads its verdict later (else the caller reads status itself)."""
        self.poll()
        self.seq += 1
        seq = self.seq
        if capturing(self.status) or tracing():
            slot = self.next_graph_slot
            self.next_graph_slot = self.RING + (slot + 1 - self.RING) % self.RING
            self.host[slot] = 0
            check = Check(torch.zeros(2, dtype=torch.int32, device=self.device), seq, slot, raise_error, what)
            self.graph_checks.append(check)
            return check
        slot = seq % self.RING
        status = torch.zeros(2, dtype=torch.int32, device=self.device) if fresh else self.rows[slot]
        check = Check(status, seq, slot, raise_error, what)
        if track:
            self.pending.append(check)
        return check

    def next_status(self, check: Check) -> torch.Tensor:
        """The status pair the check of `check` clears for the call after it."""
        if check.slot >= self.RING:
            return self.scratch  # graphs: their pairs are zeroed inside the graph
        return self.rows[(check.slot + 1) % self.RING]

    def poll(self) -> None:
        """Report the calls the GPU has checked since the last poll; never waits."""
        while self.pending:
            check = self.pending[0]
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
        for check in self.graph_checks:
            word = int(self.host[check.slot])
            if word & 15:
                self.host[check.slot] = 0
                self._fail(check, word & 15)

    def wait(self) -> None:
        """Wait for the GPU, then report every call it has checked."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.poll()

    def _fail(self, check: Check, flags) -> None:
        """Raise the error of a call the GPU found bad (flags None: the verdict was lost to a
        ring that went round; the inputs are asked again)."""
        note = (f" [deferred: the batch of {check.what} call #{check.seq} on {self.device}; nothing was "
                f"pooled or updated from it]")
        try:
            check.raise_error()
        except (BadIdError, BadBatchError) as e:
            self._mark_bad(check)
            raise type(e)(str(e) + note) from None
        if flags is None:  # lost, and the inputs are good
            check.bad = False
            check.undo.clear()
            return
        self._mark_bad(check)  # the inputs changed since: say what the GPU saw
        if flags & BAD_OFFSETS:
            raise BadBatchError(f"{check.what} call #{check.seq} had bad offsets or lengths{note}")
        raise BadIdError(f"{check.what} call #{check.seq} had an out-of-range id{note}")

    @staticmethod
    def _mark_bad(check: Check) -> None:
        check.bad = True
        for undo in check.undo:
            undo()
        check.undo.clear()


def caller_stacklevel() -> int:
    """The stacklevel of the first frame outside embfuse and torch's module plumbing (for
    warnings.warn called from this function's caller): the user's line, even when a module's
    forward made the call."""
    import os
    import sys

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plumbing = os.path.join(os.path.dirname(torch.__file__), "nn", "modules")
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((ours, plumbing)):
        frame, level = frame.f_back, level + 1
    return level


_LOGS: dict = {}


def device_log(device) -> DeviceLog:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    log = _LOGS.get(device)
    if log is None:
        log = _LOGS[device] = DeviceLog(device)
    return log


def check_errors() -> None:
    """Raise the error of any earlier call whose batch was bad (see bounds_check="deferred").
    Waits for each GPU that has run embfuse's checks: a synchronisation."""
    for log in list(_LOGS.values()):
        log.wait()


# ---- messages: the slow path, run only once a check has failed ----

def _position(flat: int, shape) -> str:
    if len(shape) <= 1:
        return f"[{flat}]"
    return "[" + ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(flat), tuple(shape))) + "]"


def raise_bad_offsets(offsets: torch.Tensor, n: int, name: str, given: int | None = None) -> None:
    """Find the first offending offset. `given`: how many offsets the caller passed (the
    canonical form may carry one more, the end), so that messages name only their positions."""
    off = offsets.cpu()
    given = off.numel() if given is None else given
    if off[0] != 0:
        raise BadBatchError(f"{name}: offsets[0] must be 0, got {int(off[0])}")
    dec = (off[1:] < off[:-1]).nonzero()
    if dec.numel():
        i = int(dec[0])
        if i + 1 < given:
            raise BadBatchError(f"{name}: offsets must be non-decreasing, but offsets[{i}] = {int(off[i])} > "
                                f"offsets[{i + 1}] = {int(off[i + 1])}")
        raise BadBatchError(f"{name}: offsets[{i}] = {int(off[i])} runs past the end of the input ({n} ids)")
    raise BadBatchError(f"{name}: offsets[{given - 1}] = {int(off[given - 1])} runs past the end of the input "
                        f"({n} ids)")


def _bad_id_message(indices: torch.Tensor, shape, num_embeddings: int, name: str) -> tuple[str, int]:
    bad = ((indices < 0) | (indices >= num_embeddings)).nonzero()
    p = int(bad[0])
    v = int(indices[p])
    msg = (
        f"{name}{_position(p, shape)} = {v} is out of range for a table of {num_embeddings} rows "
        f"(valid ids are 0..{num_embeddings - 1}). Expected idx >= 0 && idx < num_embeddings (torch's words)"
    )
    return msg, bad.numel()


def _offsets_bad(offsets, n) -> bool:
    return offsets is not None and offsets.numel() > 0 and bool(
        (offsets[1:] < offsets[:-1]).any() | (offsets[0] != 0) | (offsets[-1] > n))


def _ids_flags_reference(indices, offsets, num_embeddings) -> int:
    bad_id = bool(((indices < 0) | (indices >= num_embeddings)).any())
    return BAD_ID * bad_id + BAD_OFFSETS * _offsets_bad(offsets, indices.numel())


def _raise_ids(indices, offsets, num_embeddings, shape, name, given, skip_ids=False):
    """The exact error of a single-table batch, if it has one (host reads: the slow path);
    `skip_ids`: only bad offsets raise (bounds_check="skip" drops bad ids)."""
    n = indices.numel()
    if _offsets_bad(offsets, n):
        raise_bad_offsets(offsets, n, name, given)
    if not skip_ids and n and bool(((indices < 0) | (indices >= num_embeddings)).any()):
        raise BadIdError(_bad_id_message(indices, shape, num_embeddings, name)[0])


def _launch_ids_check(log, check, indices, offsets, num_embeddings):
    n, n_off = indices.numel(), 0 if offsets is None else offsets.numel()
    block = 1024
    launch(_check_ids_kernel)[(max(1, cdiv(max(n, n_off), block)),)](
        indices, n, offsets if offsets is not None else indices, n_off, num_embeddings, check.status,
        log.next_status(check), log.ring, check.slot, check.seq, BLOCK=block)


def launch_bags_check(log, check, values, offsets, limits, B):
    FB = offsets.numel() - 1
    bags = 8
    launch(_check_bags_kernel)[(max(1, cdiv(FB, bags)),)](
        values, offsets, limits, values.numel(), FB, max(B, 1), check.status, log.next_status(check), log.ring,
        check.slot, check.seq, BAGS=bags, BLOCK=32)


def run_check(device, kernel: bool, bounds_check: str, launch_check: Callable, flags_reference: Callable,
              raise_error: Callable, what: str, fresh: bool):
    """The mode logic shared by every check: returns (status tensor or None, flags or None).

    Without kernels (CPU) the torch-op flags are computed at once and errors raised at once.
    With kernels the check is launched; "deferred" returns its status without reading it,
    "sync" and "skip" read the flags (a synchronisation) and raise on anything "skip" cannot
    drop. `launch_check(log, check)` launches the kernel; `flags_reference()` gives the flags
    with torch ops; `raise_error()` raises the exact error (slow path)."""
    if not kernel:
        flags = flags_reference()
    else:
        log = device_log(device)
        deferred = bounds_check == "deferred"
        check = log.start(raise_error, what, fresh=fresh or not deferred, track=deferred)
        launch_check(log, check)
        if deferred:
            return check, None
        flags = int(check.status[0].item())
    if flags:
        raise_error()  # under "skip", only what it cannot drop
    return None, flags


class TracedCheck:
    """The check of a call inside a torch.compile graph: only its status (the custom op's
    output); the op's body, run by the compiled code at every call, is the eager check."""

    __slots__ = ("status",)
    bad = None

    def __init__(self, status):
        self.status = status


def traced_mode(bounds_check: str) -> str:
    return "sync" if bounds_check == "skip" else bounds_check  # skip changes shapes: a graph cannot


@torch.library.custom_op("embfuse::check_ids", mutates_args=())
def _check_ids_op(indices: torch.Tensor, offsets: Optional[torch.Tensor], num_embeddings: int, shape: list[int],
                  name: str, given: int, bounds_check: str) -> torch.Tensor:
    """validate_bags / validate_ids as one opaque op for torch.compile graphs: the status."""
    if offsets is None:
        _, check = validate_ids(indices.view(shape), num_embeddings, name=name, bounds_check=bounds_check)
    else:
        *_, check = validate_bags(indices, offsets, num_embeddings, shape=torch.Size(shape), name=name,
                                  bounds_check=bounds_check, given_offsets=given if given >= 0 else None)
    return check.status.clone() if check is not None else torch.zeros(2, dtype=torch.int32, device=indices.device)


@_check_ids_op.register_fake
def _(indices, offsets, num_embeddings, shape, name, given, bounds_check):
    return indices.new_empty(2, dtype=torch.int32)


def validate_bags(indices, offsets, num_embeddings, per_sample_weights=None, *, shape=None, name="input",
                  bounds_check=DEFAULT_BOUNDS_CHECK, given_offsets=None, fresh=True, kernel=None):
    """Check a canonical single-table bag batch (1-D ids, B+1 offsets).

    Returns (indices, offsets, per_sample_weights, check): the tensors to use (compacted copies
    when "skip" drops bad ids) and the deferred Check whose status the kernels read (None when
    nothing is deferred). `fresh`: the status must outlive later calls (autograd will read it).
    """
    if bounds_check == "off":
        return indices, offsets, per_sample_weights, None
    shape = indices.shape if shape is None else shape
    if tracing():
        status = _check_ids_op(indices, offsets, num_embeddings, list(shape), name,
                               -1 if given_offsets is None else given_offsets, traced_mode(bounds_check))
        return indices, offsets, per_sample_weights, TracedCheck(status)
    if kernel is None:
        kernel = use_kernels(indices)
    raise_error = functools.partial(_raise_ids, indices, offsets, num_embeddings, shape, name, given_offsets,
                                    bounds_check == "skip")
    check, flags = run_check(
        indices.device, kernel, bounds_check,
        lambda log, c: _launch_ids_check(log, c, indices, offsets, num_embeddings),
        lambda: _ids_flags_reference(indices, offsets, num_embeddings), raise_error, "embedding_bag", fresh)
    if not flags:
        return indices, offsets, per_sample_weights, check
    msg, count = _bad_id_message(indices, shape, num_embeddings, name)
    warnings.warn(f"skipped {count} out-of-range id(s); first: {msg}", stacklevel=caller_stacklevel())
    keep = (indices >= 0) & (indices < num_embeddings)
    kept_before = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.cumsum(0)])
    offsets = kept_before[offsets.long()].to(offsets.dtype)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights[keep]
    return indices[keep], offsets, per_sample_weights, None


def validate_ids(indices, num_embeddings, *, name="input", bounds_check=DEFAULT_BOUNDS_CHECK, fresh=True,
                 kernel=None):
    """Check plain ids (no bags). Returns (keep-mask or None, check or None): under "skip" the
    mask marks the ids to keep; under "deferred" the Check the kernels read."""
    if bounds_check == "off" or indices.numel() == 0:
        return None, None
    flat = indices.reshape(-1)
    if tracing():
        status = _check_ids_op(flat, None, num_embeddings, list(indices.shape), name, -1, traced_mode(bounds_check))
        return None, TracedCheck(status)
    if kernel is None:
        kernel = use_kernels(flat)
    raise_error = functools.partial(_raise_ids, flat, None, num_embeddings, indices.shape, name, None,
                                    bounds_check == "skip")
    check, flags = run_check(
        flat.device, kernel, bounds_check, lambda log, c: _launch_ids_check(log, c, flat, None, num_embeddings),
        lambda: _ids_flags_reference(flat, None, num_embeddings), raise_error, "embedding", fresh)
    if not flags:
        return None, check
    msg, count = _bad_id_message(flat, indices.shape, num_embeddings, name)
    warnings.warn(f"skipped {count} out-of-range id(s); first: {msg}", stacklevel=caller_stacklevel())
    return (indices >= 0) & (indices < num_embeddings), None


def guard(t: torch.Tensor, status: torch.Tensor, fill: int) -> torch.Tensor:
    """`t` for torch-op paths, which would fault on a bad id or offset: `fill` everywhere when
    `status` (a deferred check's) says the batch is bad, else `t`. One elementwise op, no host
    read."""
    return torch.where(status[0] == 0, t, fill)


def known_good(status: Optional[torch.Tensor]) -> bool:
    """Whether a deferred check passed, read back (a synchronisation): for the torch-op paths
    that still run on a GPU (float64 tables), which would fault on a bad id."""
    return status is None or int(status[0]) == 0
