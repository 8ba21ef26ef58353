"""Input checks shared by every lookup op: one pass per batch, before any kernel writes.

Dtype and shape checks are host-only. The value checks (ids in [0, num_embeddings), offsets
that start at 0, never decrease and stay inside the input) run as one fused pass that leaves
one int of flags, read back once: a Triton kernel on CUDA, a few torch ops on the CPU. Only
when a flag is set do we spend more ops to find the first offending position for the message,
so the cost of a valid batch is one small launch and one device-to-host read.

That read is a synchronisation, which torch.compile graphs and CUDA-graph capture cannot hold;
inside them `bounds_check="raise"` checks nothing (as "off"): validate the batch first with
`embfuse.validate_bags` outside the captured region. Kernels never check bounds themselves.
"""

from __future__ import annotations

import warnings

import torch

from embfuse._triton import HAS_TRITON, cdiv, launch, tl, triton, use_kernels

BOUNDS_CHECK_MODES = ("raise", "skip", "off")
INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

BAD_ID = 1
BAD_OFFSETS = 2


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
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight must be float32, float16, bfloat16 or float64, got {weight.dtype}")


def padding_index(padding_idx: int | None, num_embeddings: int) -> int:
    """torch's padding_idx rules (negative counts from the end); -1 stands for none."""
    if padding_idx is None:
        return -1
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def can_sync(t: torch.Tensor) -> bool:
    """False inside torch.compile tracing or CUDA-graph capture, where a host read is illegal."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@triton.jit
def _check_bags_kernel(indices, n, offsets, n_offsets, num_embeddings, flags, BLOCK: tl.constexpr):
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
    flag = tl.max(bad_id.to(tl.int32)) * 1 + tl.max(bad_off.to(tl.int32)) * 2  # BAD_ID | BAD_OFFSETS
    tl.atomic_or(flags, flag, mask=flag != 0)


def bag_flags(indices: torch.Tensor, offsets: torch.Tensor, num_embeddings: int, kernel: bool | None = None) -> int:
    """BAD_ID | BAD_OFFSETS bits for 1-D `indices` split by full (B+1) `offsets`; one host read."""
    if kernel is None:
        kernel = use_kernels(indices)
    n, n_off = indices.numel(), offsets.numel()
    if kernel and HAS_TRITON:
        flags = torch.zeros(1, dtype=torch.int32, device=indices.device)
        work = max(n, n_off, 1)
        block = 1024
        launch(_check_bags_kernel)[(cdiv(work, block),)](
            indices, n, offsets, n_off, num_embeddings, flags, BLOCK=block
        )
        return int(flags.item())
    bad_id = ((indices < 0) | (indices >= num_embeddings)).any()
    bad_off = (offsets[1:] < offsets[:-1]).any() | (offsets[0] != 0) | (offsets[-1] > n)
    return int(bad_id) * BAD_ID + int(bad_off) * BAD_OFFSETS


def _position(flat: int, shape: torch.Size) -> str:
    if len(shape) <= 1:
        return f"[{flat}]"
    return "[" + ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(flat), shape)) + "]"


def raise_bad_offsets(offsets: torch.Tensor, n: int, name: str) -> None:
    """Find the first offending offset (slow path: only runs once a flag said there is one)."""
    off = offsets.cpu()
    if off[0] != 0:
        raise ValueError(f"{name}: offsets[0] must be 0, got {int(off[0])}")
    dec = (off[1:] < off[:-1]).nonzero()
    if dec.numel():
        i = int(dec[0])
        raise ValueError(
            f"{name}: offsets must be non-decreasing, but offsets[{i}] = {int(off[i])} > offsets[{i + 1}] = {int(off[i + 1])}"
        )
    raise ValueError(f"{name}: offsets[-1] = {int(off[-1])} runs past the end of the input ({n} ids)")


def _bad_id_message(indices: torch.Tensor, shape: torch.Size, num_embeddings: int, name: str) -> tuple[str, int]:
    bad = ((indices < 0) | (indices >= num_embeddings)).nonzero()
    p = int(bad[0])
    v = int(indices[p])
    msg = (
        f"{name}{_position(p, shape)} = {v} is out of range for a table of {num_embeddings} rows "
        f"(valid ids are 0..{num_embeddings - 1})"
    )
    return msg, bad.numel()


def validate_bags(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_embeddings: int,
    per_sample_weights: torch.Tensor | None = None,
    *,
    shape: torch.Size | None = None,
    name: str = "input",
    bounds_check: str = "raise",
):
    """Check a canonical bag batch; returns (indices, offsets, per_sample_weights) to use.

    With bounds_check="skip", out-of-range ids are dropped from their bags (a warning says how
    many); the returned tensors are then compacted copies. Bad offsets always raise.
    """
    if bounds_check == "off" or not can_sync(indices):
        return indices, offsets, per_sample_weights
    flags = bag_flags(indices, offsets, num_embeddings)
    if flags == 0:
        return indices, offsets, per_sample_weights
    if flags & BAD_OFFSETS:
        raise_bad_offsets(offsets, indices.numel(), name)
    msg, count = _bad_id_message(indices, shape if shape is not None else indices.shape, num_embeddings, name)
    if bounds_check == "raise":
        raise IndexError(msg)
    warnings.warn(f"skipped {count} out-of-range id(s); first: {msg}", stacklevel=3)
    keep = (indices >= 0) & (indices < num_embeddings)
    kept_before = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.cumsum(0)])
    offsets = kept_before[offsets.long()].to(offsets.dtype)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights[keep]
    return indices[keep], offsets, per_sample_weights


def validate_ids(indices: torch.Tensor, num_embeddings: int, *, name: str = "input", bounds_check: str = "raise"):
    """Check plain ids (no bags); returns None when all are valid, else the keep-mask ("skip")."""
    if bounds_check == "off" or not can_sync(indices) or indices.numel() == 0:
        return None
    flat = indices.reshape(-1)
    empty = torch.zeros(1, dtype=flat.dtype, device=flat.device)
    if bag_flags(flat, empty, num_embeddings) == 0:
        return None
    msg, count = _bad_id_message(flat, indices.shape, num_embeddings, name)
    if bounds_check == "raise":
        raise IndexError(msg)
    warnings.warn(f"skipped {count} out-of-range id(s); first: {msg}", stacklevel=3)
    return (indices >= 0) & (indices < num_embeddings)
