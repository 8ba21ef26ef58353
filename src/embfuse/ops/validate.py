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

Kernels never check bounds themselves: they read `status` once per program, outside their loops
(the mechanism: ops/deferred.py). One core serves single tables and keyed collections: the same
modes, one skip compaction, one message format (argument, feature, position, sample, value).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch

from embfuse._triton import tracing, use_kernels
from embfuse.ops.bags import bag_of_value, torch_cpu
from embfuse._handles import join_names, split_names
from embfuse.ops.check_kernels import BAD_ID, BAD_OFFSETS, launch_bags_check, launch_ids_check
from embfuse.ops.deferred import TracedCheck, device_log, graph_check_op, prepare_log, status_copy
from embfuse.ops.errors import BadArgumentError, BadBatchError, BadDtypeError, BadIdError, caller_stacklevel
from embfuse.ops import tuning

BOUNDS_CHECK_MODES = ("deferred", "sync", "skip", "off")
DEFAULT_BOUNDS_CHECK = "deferred"
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = torch.iinfo(torch.int32).max
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

DENSE, COO, ROWWISE = 0, 1, 2  # gradient layouts: dense, torch's COO, one entry per row
SPARSE_LAYOUTS = {False: DENSE, True: COO, "coo": COO, "rowwise": ROWWISE}


def sparse_layout(sparse) -> int:
    """The gradient layout `sparse` asks for: False (dense), True or "coo" (torch's: one entry
    per position, uncoalesced) or "rowwise" (one entry per distinct row, coalesced)."""
    try:
        return SPARSE_LAYOUTS[sparse]
    except (KeyError, TypeError):
        raise ValueError(f"sparse must be False, True, 'coo' or 'rowwise', got {sparse!r}") from None


def torch_records(weight: torch.Tensor, mode: int, sparse: int, scale_grad_by_freq: bool) -> bool:
    """Whether an eager call that autograd records runs torch's own lookup, forward and backward:
    on the CPU where torch's kernels are embfuse's rules (bags.torch_cpu), for torch's gradient
    layouts, without scale_grad_by_freq (where embfuse differs from torch on purpose: README). The
    reference backward was 2-6x slower there (benchmarks/NOTES.md, session 31); it stays the test
    oracle and the path of traced calls, of those options and of fp16 / bf16 tables."""
    return torch_cpu(weight, mode) and sparse != ROWWISE and not scale_grad_by_freq and not tracing()


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


def row_major(weight: torch.Tensor) -> bool:
    """Whether a table's rows are contiguous (stride 1 along a row), as the kernels read them.
    Other tables (a transposed one) take the torch-op path (a fused optimizer refuses them:
    check_fused_table)."""
    return weight.shape[1] <= 1 or weight.stride(1) == 1


def check_fused_table(weight: torch.Tensor) -> None:
    """A fused optimizer's table: contiguous, as its kernels write rows in place (at the call,
    not later in the backward)."""
    if not weight.is_contiguous():
        raise BadArgumentError(f"a fused optimizer updates rows in place and needs a contiguous table, got strides "
                               f"{tuple(weight.stride())} for shape {tuple(weight.shape)}; pass weight.contiguous()")


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


# ---- messages: the slow path, run only once a check has failed ----

def _position(flat: int, shape) -> str:
    if len(shape) <= 1:
        return f"[{flat}]"
    return "[" + ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(flat), tuple(shape))) + "]"


def out_of_range(what: str, value: int, rows: int, table: str | None = None, feature: str | None = None,
                 sample: int | None = None) -> str:
    """The one message of an id outside its table: `what` names the argument and its position."""
    where = f"feature {feature!r}: " if feature is not None else ""
    of = f" (sample {sample})" if sample is not None else ""
    tbl = f"table {table!r} of {rows} rows" if table is not None else f"a table of {rows} rows"
    return (f"{where}{what} = {value}{of} is out of range for {tbl} (valid ids are 0..{rows - 1}). "
            f"Expected idx >= 0 && idx < num_embeddings (torch's words)")


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
    return out_of_range(f"{name}{_position(p, shape)}", int(indices[p]), num_embeddings), bad.numel()


def in_range(values, limits, B, offsets) -> torch.Tensor:
    """Which values of a keyed batch lie inside their feature's table: 0 <= id < limits[f], or,
    where limits[f] = -rows (a feature whose ids < 0 are dropped before the lookup: TensorFlow's
    safe lookups, ops/safe.py), id < rows. The offsets are known good (every caller has checked
    them), so feature f's values are the run values[offsets[f * B] : offsets[(f + 1) * B]]."""
    if B == 0:  # (no bags: good offsets leave no values)
        return torch.ones_like(values, dtype=torch.bool)
    limit = limits.repeat_interleave(offsets[::B].diff(), output_size=values.numel())
    return ((values >= 0) | (limit < 0)) & (values < limit.abs())


def _bad_value_message(values, offsets, limits, B, keys, tables, positions=None) -> tuple[str, int]:
    """The first out-of-range value of a keyed batch, by feature, table, position and sample;
    and how many there are. `positions`: each value's position in the caller's own order (a
    batch the caller's entries were sorted into), or None."""
    bag = bag_of_value(offsets, values.numel())
    bad = (~in_range(values, limits, B, offsets)).nonzero()
    p = int(bad[0])
    g = int(bag[p])
    f = g // B
    at = p if positions is None else int(positions[p])
    return (out_of_range(f"values[{at}]", int(values[p]), abs(int(limits[f])), tables[f], keys[f], g % B),
            bad.numel())


def clamp_last_offset(offsets, n):
    """torch's include_last_offset rule: the last bag runs to the end of the input whatever the
    last offset says (its test from pytorch issue 89677); one past the end is still an error. A
    lone offset holds no bag, so it stays as given."""
    if offsets.numel() < 2:
        return offsets
    return torch.cat([offsets[:-1], offsets[-1:].clamp(min=n)])


# (the checks without kernels read Python ints from one reduction each: on the CPU, masks over
# every id and offset reduced with any() cost a small call several times more; benchmarks/NOTES.md,
# session 65)
def _offsets_bad(offsets, n, whole=False) -> bool:
    """Offsets that do not start at 0, decrease, or end past the n ids (`whole`: anywhere but at
    n, as a keyed batch's, whose values all belong to its bags)."""
    if offsets is None or offsets.numel() == 0:
        return False
    last = int(offsets[-1])
    if int(offsets[0]) != 0 or last > n or (whole and last != n):
        return True
    return offsets.numel() > 1 and int(offsets.diff().min()) < 0


def _ids_flags_reference(indices, offsets, num_embeddings, clamp_last=False) -> int:
    if clamp_last:
        offsets = clamp_last_offset(offsets, indices.numel())
    bad_id = False
    if indices.numel():
        low, high = torch.aminmax(indices)
        bad_id = int(low) < 0 or int(high) >= num_embeddings
    return BAD_ID * bad_id + BAD_OFFSETS * _offsets_bad(offsets, indices.numel())


def _raise_ids(indices, offsets, num_embeddings, shape, name, given, skip_ids=False, clamp_last=False):
    """The exact error of a single-table batch, if it has one (host reads: the slow path);
    `skip_ids`: only bad offsets raise (bounds_check="skip" drops bad ids); `clamp_last`:
    validate_bags'."""
    n = indices.numel()
    if clamp_last:
        offsets = clamp_last_offset(offsets, n)
    if _offsets_bad(offsets, n):
        raise_bad_offsets(offsets, n, name, given)
    if not skip_ids and n and bool(((indices < 0) | (indices >= num_embeddings)).any()):
        raise BadIdError(_bad_id_message(indices, shape, num_embeddings, name)[0])


def _raise_collection(values, offsets, limits, B, keys, tables, skip_ids, positions=None):
    """The exact error of a keyed batch, if it has one (host reads: the slow path)."""
    n = values.numel()
    lengths = offsets[1:] - offsets[:-1]
    neg = (lengths < 0).nonzero()
    if neg.numel():
        g = int(neg[0])
        raise BadBatchError(f"feature {keys[g // B]!r}: lengths[{g}] (sample {g % B}) = {int(lengths[g])} is "
                            f"negative")
    if int(offsets[0]) != 0 or int(offsets[-1]) != n:
        raise BadBatchError(f"lengths add up to {int(offsets[-1]) - int(offsets[0])} but there are {n} values")
    if not skip_ids and n and _collection_flags_reference(values, offsets, limits, B):
        raise BadIdError(_bad_value_message(values, offsets, limits, B, keys, tables, positions)[0])


# ids a feature from which a keyed batch's reference check reads each feature's smallest and
# largest id (one aminmax a feature, as Python ints) rather than in_range's five passes over every
# value (benchmarks/NOTES.md, sessions 64 and 65)
RUN_CHECK_IDS = 1024


def _collection_flags_reference(values, offsets, limits, B) -> int:
    """Bad offsets, else in_range's verdict: for long runs (RUN_CHECK_IDS) from each feature's
    smallest and largest id."""
    n = values.numel()
    if _offsets_bad(offsets, n, whole=True):
        return BAD_OFFSETS
    if B == 0:  # (no bags: good offsets leave no values)
        return 0
    if n < RUN_CHECK_IDS * limits.numel():
        return BAD_ID if not bool(in_range(values, limits, B, offsets).all()) else 0
    starts = offsets[::B].tolist()
    for limit, a, b in zip(limits.tolist(), starts, starts[1:]):
        if b > a:
            low, high = torch.aminmax(values[a:b])
            if (int(low) < 0 and limit >= 0) or int(high) >= abs(limit):
                return BAD_ID
    return 0


# ---- the one core: modes, the deferred check, skip compaction ----

def run_check(device, kernel: bool, bounds_check: str, launch_check: Callable, flags_reference: Callable,
              raise_error: Callable, what: str, fresh: bool, fold: bool = False):
    """The mode logic shared by every check: returns (status tensor or None, flags or None).

    Without kernels (CPU) the torch-op flags are computed at once and errors raised at once.
    With kernels the check is launched; "deferred" returns its status without reading it,
    "sync" and "skip" read the flags (a synchronisation) and raise on anything "skip" cannot
    drop. `launch_check(log, check)` launches the kernel; `flags_reference()` gives the flags
    with torch ops; `raise_error()` raises the exact error (slow path). `fold` ("deferred",
    eager): leave the launch pending in the Check (a lookup kernel may run it, take_fold)."""
    if device.type == "meta":  # shapes without data (TorchRec builds models there): nothing to check
        return None, 0
    if not kernel:
        flags = flags_reference()
    else:
        log = device_log(device)
        deferred = bounds_check == "deferred"
        check = log.start(raise_error, what, fresh=fresh or not deferred, track=deferred)
        if deferred and fold and not check.in_graph:  # (not in a graph: its launches cost no host time)
            check.pending = functools.partial(launch_check, log, check)
            return check, None
        launch_check(log, check)
        if deferred:
            return check, None
        flags = int(check.status[0].item())
    if flags:
        raise_error()  # under "skip", only what it cannot drop
    return None, flags


def traced_mode(bounds_check: str) -> str:
    return "sync" if bounds_check == "skip" else bounds_check  # skip changes shapes: a graph cannot


def _validate(values, bounds_check, fresh, kernel, what, launch_check, flags_reference, raise_error, keep, message,
              fold=False):
    """What every validation does once its arguments are checked: run the check in its mode
    (run_check) and, when "skip" found bad ids, warn once, naming the first.
    Returns (the deferred Check or None, the mask of ids to keep when some are to be dropped,
    else None). keep(): that mask; message(): (the first bad id's message, how many)."""
    if kernel is None:
        kernel = use_kernels(values)
    check, flags = run_check(values.device, kernel, bounds_check, launch_check, flags_reference, raise_error, what,
                             fresh, fold)
    if not flags:
        return check, None
    first, count = message()
    warnings.warn(f"skipped {count} out-of-range id(s); first: {first}", stacklevel=caller_stacklevel())
    return None, keep()


def skip_ids(values, offsets, psw, keep):
    """The batch without the ids `keep` drops: each bag keeps its own kept ids."""
    kept_before = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.cumsum(0)])
    offsets = kept_before[offsets.long()].to(offsets.dtype)
    return values[keep], offsets, None if psw is None else psw[keep], None


@torch.library.custom_op("embfuse::check_ids", mutates_args=())
def _check_ids_op(indices: torch.Tensor, offsets: Optional[torch.Tensor], num_embeddings: int, shape: list[int],
                  name: str, given: int, bounds_check: str) -> torch.Tensor:
    """validate_bags / validate_ids as one opaque op for torch.compile graphs: the status."""
    with graph_check_op():
        if offsets is None:
            _, check = validate_ids(indices.view(shape), num_embeddings, name=name, bounds_check=bounds_check,
                                    fresh=False)
        else:  # (ring pairs, as in _check_bags_op)
            given_offsets = given if given >= 0 else None
            *_, check = validate_bags(indices, offsets, num_embeddings, shape=torch.Size(shape), name=name,
                                      bounds_check=bounds_check, given_offsets=given_offsets, fresh=False)
    return status_copy(check, indices)


@_check_ids_op.register_fake
def _(indices, offsets, num_embeddings, shape, name, given, bounds_check):
    return indices.new_empty(2, dtype=torch.int32)


def validate_bags(indices, offsets, num_embeddings, per_sample_weights=None, *, shape=None, name="input",
                  bounds_check=DEFAULT_BOUNDS_CHECK, given_offsets=None, fresh=True, kernel=None, remap=None,
                  fold=False, clamp_last=False, narrow=False):
    """Check a canonical single-table bag batch (1-D ids, B+1 offsets; or torch's B bag starts,
    or with `clamp_last` B+1 offsets whose last reads as at least the id count: clamp_last_offset).

    Returns (indices, offsets, per_sample_weights, check): the tensors to use (compacted copies
    when "skip" drops bad ids) and the deferred Check whose status the kernels read (None when
    nothing is deferred). `fresh`: the status must outlive later calls (autograd will read it).
    `remap` (a GPU lookup's ops/residency.py Resident): the ids returned are those to read, hot
    rows from their resident copy, written by the same pass. `fold`: the caller's lookup can run
    the check in its own launch (embedding_bag_forward `check`): a small deferred batch's check
    is then left pending (ops/deferred.py take_fold). `narrow` (the caller's lookup reads int32
    ids faster: tuning.narrows): int64 ids come back as the int32 the check wrote.
    """
    out = _remap_out(indices, remap)
    if bounds_check == "off":
        return remap_ids(indices, None, None, 1, remap, num_embeddings, out), offsets, per_sample_weights, None
    shape = indices.shape if shape is None else shape
    if tracing():
        prepare_log(str(indices.device))
        # (the registered check takes canonical offsets; a traced call's host time is free)
        ends = clamp_last_offset(offsets, indices.numel()) if clamp_last else offsets
        status = _check_ids_op(indices, ends, num_embeddings, list(shape), name,
                               -1 if given_offsets is None else given_offsets, traced_mode(bounds_check))
        return indices, offsets, per_sample_weights, TracedCheck(status)
    if narrow and remap is None:
        out = _narrow_out(indices, num_embeddings, kernel)
    check, keep = _validate(
        indices, bounds_check, fresh, kernel, "embedding_bag",
        lambda log, c: launch_ids_check(log, c, indices, offsets, num_embeddings, remap, out, clamp_last),
        lambda: _ids_flags_reference(indices, offsets, num_embeddings, clamp_last),
        functools.partial(_raise_ids, indices, offsets, num_embeddings, shape, name, given_offsets,
                          bounds_check == "skip", clamp_last),
        lambda: (indices >= 0) & (indices < num_embeddings),
        lambda: _bad_id_message(indices, shape, num_embeddings, name),
        fold and out is None and indices.numel() <= tuning.FOLD_IDS)
    if keep is None:
        return _remapped(indices, None, None, 1, remap, num_embeddings, out, kernel), offsets, per_sample_weights, check
    indices, offsets, per_sample_weights, _ = skip_ids(indices, offsets, per_sample_weights, keep)
    return remap_ids(indices, None, None, 1, remap, num_embeddings), offsets, per_sample_weights, None


def validate_ids(indices, num_embeddings, *, name="input", bounds_check=DEFAULT_BOUNDS_CHECK, fresh=True,
                 kernel=None, fold=False):
    """Check plain ids (no bags). Returns (keep-mask or None, check or None): under "skip" the
    mask marks the ids to keep; under "deferred" the Check the kernels read. `fold`: as
    validate_bags' (ops/embedding.py embedding_forward runs a pending check)."""
    if bounds_check == "off" or indices.numel() == 0:
        return None, None
    flat = indices.reshape(-1).contiguous()  # (the kernel reads memory in order: a strided view is copied)
    if tracing():
        prepare_log(str(flat.device))
        status = _check_ids_op(flat, None, num_embeddings, list(indices.shape), name, -1, traced_mode(bounds_check))
        return None, TracedCheck(status)
    check, keep = _validate(
        flat, bounds_check, fresh, kernel, "embedding",
        lambda log, c: launch_ids_check(log, c, flat, None, num_embeddings),
        lambda: _ids_flags_reference(flat, None, num_embeddings),
        functools.partial(_raise_ids, flat, None, num_embeddings, indices.shape, name, None, bounds_check == "skip"),
        lambda: (indices >= 0) & (indices < num_embeddings),  # plain ids are masked, not dropped (shapes stay)
        lambda: _bad_id_message(flat, indices.shape, num_embeddings, name),
        fold and flat.numel() <= tuning.FOLD_GATHER_IDS)
    return keep, check


def validate_collection(values: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor],
                        limits: torch.Tensor, B: int, keys: list[str], tables: list[str],
                        bounds_check: str = DEFAULT_BOUNDS_CHECK, fresh: bool = True, kernel: Optional[bool] = None,
                        remap=None, tail: bool = False, positions: Optional[torch.Tensor] = None,
                        narrow: bool = False):
    """Check a keyed batch (F * B bags) against its features' tables (limits[f]: rows of feature
    f's table, negated where ids < 0 are allowed: see in_range) in one pass: lengths that are
    non-negative and add up to the values, every id inside its feature's table. Returns (values,
    offsets, per_sample_weights, check) as validate_bags does (`remap` too). Errors name the
    feature, its table, the position and the sample. `tail`: a padded batch (sparse/padded.py),
    whose lengths add up to at most the values and whose values past them are not checked.
    `positions`: each value's position in the caller's order, for the messages (_bad_value_message).
    `narrow`: as validate_bags' (the caller knows every table's ids fit in int32)."""
    check_bounds_mode(bounds_check)
    check_index_dtype("values", values)
    check_index_dtype("lengths", offsets)
    if psw is not None:
        if not psw.is_floating_point():
            raise BadDtypeError(f"weights must be floating point, got {psw.dtype}")
        if psw.shape != values.shape:
            raise ValueError(f"weights has shape {tuple(psw.shape)}; values has {tuple(values.shape)}")
    # the kernels read memory in order: a strided view (a column of a user's tensor) is copied
    values, offsets = values.contiguous(), offsets.contiguous()
    psw = None if psw is None else psw.contiguous()
    n, FB = values.numel(), offsets.numel() - 1
    if FB == 0 and n:
        raise BadBatchError(f"the batch has no bags but {n} values")
    if FB == 0:
        return values, offsets, psw, None
    B = max(B, 1)
    out = _remap_out(values, remap)
    if bounds_check == "off":
        return remap_ids(values, offsets, limits, B, remap, out=out), offsets, psw, None
    if tracing():
        prepare_log(str(values.device))
        return values, offsets, psw, TracedCheck(_check_bags_op(values, offsets, limits, B, join_names(keys),
                                                                join_names(tables), traced_mode(bounds_check), tail))
    if narrow and remap is None:
        out = _narrow_out(values, 0, kernel)
    check, keep = _check_collection(values, offsets, limits, B, keys, tables, bounds_check, fresh, kernel, remap,
                                    out, tail, positions)
    if keep is None:
        return _remapped(values, offsets, limits, B, remap, None, out, kernel), offsets, psw, check
    values, offsets, psw, _ = skip_ids(values, offsets, psw, keep)
    return remap_ids(values, offsets, limits, B, remap), offsets, psw, None


def _remap_out(values, remap):
    """Where the check writes the ids to read, when there is a Resident (ops/residency.py)."""
    if remap is None:
        return None
    return torch.empty_like(values, dtype=torch.int32 if remap.int32 else torch.int64,
                            memory_format=torch.contiguous_format)


def _narrow_out(indices, num_embeddings, kernel):
    """Where the check of int64 ids (kernels only) also writes them as int32, for the pooling to
    read (benchmarks/NOTES.md, session 34), or None."""
    if (indices.dtype != torch.int64 or max(indices.numel(), num_embeddings) > INT32_MAX
            or not (use_kernels(indices) if kernel is None else kernel)):
        return None
    # (empty_like: 4.7 us of host time on the H100 against 8.5-9.5 for torch.empty(shape, device=))
    return torch.empty_like(indices, dtype=torch.int32, memory_format=torch.contiguous_format)


def _remapped(values, offsets, limits, B, remap, num_embeddings, out, kernel):
    """The ids to read after a check: `out` where the check ran as a kernel and wrote them there
    (hot rows from their copy with a `remap`, else narrowed: _narrow_out, kernels only), the
    values themselves where it wrote none."""
    if out is None:
        return values
    if kernel or (kernel is None and use_kernels(values)):
        return out
    return remap_ids(values, offsets, limits, B, remap, num_embeddings, out)


def remap_ids(values, offsets, limits, B, remap, num_embeddings=None, out=None):
    """The ids to read, hot rows from their resident copy (`remap`: a Resident, or None: the ids
    themselves), by the check kernels run without checking: for a batch that is not checked
    ("off") or was compacted ("skip"). One table: `num_embeddings`, no offsets needed."""
    if remap is None:
        return values
    out = _remap_out(values, remap) if out is None else out
    if values.numel():
        if limits is None:
            launch_ids_check(None, None, values, None, num_embeddings, remap, out)
        else:
            launch_bags_check(None, None, values, offsets, limits, B, remap, out)
    return out


def _check_collection(values, offsets, limits, B, keys, tables, bounds_check, fresh, kernel, remap=None, out=None,
                      tail=False, positions=None):
    def keep():
        mask = in_range(_bagged(values, offsets, tail), limits, B, offsets)
        return torch.cat([mask, mask.new_zeros(values.numel() - mask.numel())]) if tail else mask  # (padding goes)

    return _validate(
        values, bounds_check, fresh, kernel, "EmbeddingBagCollection",
        lambda log, c: launch_bags_check(log, c, values, offsets, limits, B, remap, out, tail),
        lambda: _collection_flags_reference(_bagged(values, offsets, tail), offsets, limits, B),
        functools.partial(_raise_bagged, values, offsets, limits, B, keys, tables, bounds_check == "skip", tail,
                          positions),
        keep, lambda: _bad_value_message(_bagged(values, offsets, tail), offsets, limits, B, keys, tables, positions))


def _raise_bagged(values, offsets, limits, B, keys, tables, skip_ids, tail, positions=None):
    _raise_collection(_bagged(values, offsets, tail), offsets, limits, B, keys, tables, skip_ids, positions)


def _bagged(values, offsets, tail):
    """What the host paths read: a padded batch's (`tail`) values that bags hold,
    values[:offsets[-1]] (one host read), or all the values when the offsets end past them (the
    check then reports that); every value of a plain batch."""
    if not tail:
        return values
    end = int(offsets[-1])
    return values[:end] if 0 <= end <= values.numel() else values


@torch.library.custom_op("embfuse::check_bags", mutates_args=())
def _check_bags_op(values: torch.Tensor, offsets: torch.Tensor, limits: torch.Tensor, B: int, keys: str, tables: str,
                   bounds_check: str, tail: bool) -> torch.Tensor:
    """validate_collection as one opaque op for torch.compile graphs: the check's status (keys
    and table names joined by _handles.join_names: an op takes no list of strings)."""
    # (a ring pair, not a fresh one: the op returns a copy, and a pair made here would outlive the
    # call in the host's list, which Inductor's CUDA graphs refuse in their memory pool)
    with graph_check_op():
        check = _check_collection(values, offsets, limits, B, split_names(keys), split_names(tables), bounds_check,
                                  False, None, tail=tail)[0]
    return status_copy(check, values)


@_check_bags_op.register_fake
def _(values, offsets, limits, B, keys, tables, bounds_check, tail):
    return values.new_empty(2, dtype=torch.int32)


def collection_status(values: torch.Tensor, offsets: torch.Tensor, limits: torch.Tensor, B: int) -> torch.Tensor:
    """The flags of a keyed batch (0 when good) as a 0-d int64 tensor, for a caller that reads
    them itself: on the GPU the check kernel's status, not read here and not reported later; on
    the CPU computed at once."""
    if B == 0:  # no bags (a rank's share of a small batch): good unless there are values
        return values.new_full((), BAD_OFFSETS if values.numel() else 0, dtype=torch.int64)
    if not use_kernels(values):
        return torch.tensor(_collection_flags_reference(values, offsets, limits, B))
    log = device_log(values.device)
    check = log.start(None, "a sharded collection's batch", fresh=True, track=False)
    launch_bags_check(log, check, values, offsets, limits, B)
    return check.status[0].long()


def guard(t: torch.Tensor, status: torch.Tensor, fill: int) -> torch.Tensor:
    """`t` for torch-op paths, which would fault on a bad id or offset: `fill` everywhere when
    `status` (a deferred check's) says the batch is bad, else `t`. One elementwise op, no host
    read."""
    return torch.where(status[0] == 0, t, fill)
