"""A variable batch per feature (TorchRec's VBE) made ready for the collection kernels: each
feature's lengths padded to one stride, and the pooled row each output sample takes.

`meta` (int64, 3F, on the device): each feature's stride (its samples), the first entry of its
lengths, and its row of the inverse indices. One launch for the lengths and one for the rows
replace about twelve torch ops, each a host-bound launch of its own (benchmarks/NOTES.md,
session 16).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import cdiv, kernel_op, launch, tl, tracing, triton, use_kernels
from embfuse.ops import tuning


def pad_reference(lengths: Tensor, inverse: Optional[Tensor], meta: Tensor, F: int,
                  Bp: int) -> tuple[Tensor, Optional[Tensor]]:
    """Pure torch (CPU path and test oracle): (lengths padded to F * Bp, feature f's bag b at
    f * Bp + b and empty bags after its stride; rows (Bo, F): inverse[row of f, b] kept inside
    feature f's samples, or None without inverse indices)."""
    strides, firsts, inverse_rows = meta[:F], meta[F:2 * F], meta[2 * F:3 * F]
    b = torch.arange(Bp, device=lengths.device)
    keep = b[None, :] < strides[:, None]
    at = torch.where(keep, firsts[:, None] + b[None, :], 0)
    padded = torch.where(keep, lengths[at] if lengths.numel() else 0, 0).to(lengths.dtype).reshape(-1)
    if inverse is None:
        return padded, None
    rows = inverse[inverse_rows].long()
    rows = torch.minimum(rows.clamp_min(0), (strides - 1).clamp_min(0)[:, None])
    return padded, rows.T.contiguous()


# (a batch's sizes are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["Bp", "Bo", "inverse_stride"])
def _pad_kernel(lengths, inverse, meta, out, F, Bp, Bo, inverse_stride, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ROWS False: out[f * Bp + b] = lengths[first of f + b] for b < stride of f, else 0. ROWS
    True: out[b * F + f] = inverse[row of f, b] clamped into [0, stride of f - 1]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if ROWS:
        inside = i < F * Bo
        b = i // F
        f = i - b * F
        stride = tl.load(meta + f, mask=inside, other=1)
        row = tl.load(meta + 2 * F + f, mask=inside, other=0)
        v = tl.load(inverse + row * inverse_stride + b, mask=inside, other=0).to(tl.int64)
        tl.store(out + i, tl.minimum(tl.maximum(v, 0), tl.maximum(stride - 1, 0)), mask=inside)
    else:
        inside = i < F * Bp
        f = i // Bp
        b = i - f * Bp
        stride = tl.load(meta + f, mask=inside, other=0)
        first = tl.load(meta + F + f, mask=inside, other=0)
        v = tl.load(lengths + first + b, mask=inside & (b < stride), other=0)
        tl.store(out + i, v.to(out.dtype.element_ty), mask=inside)


def pad_variable_batch(lengths: Tensor, inverse: Optional[Tensor], meta: Tensor, F: int,
                       Bp: int) -> tuple[Tensor, Optional[Tensor]]:
    """As pad_reference, by a launch for the lengths and one for the rows where kernels run (one
    opaque op in a traced graph: dynamo does not trace a launch itself)."""
    if not use_kernels(lengths):
        return pad_reference(lengths, inverse, meta, F, Bp)
    if tracing():  # (its rows are empty without inverse indices: an op returns tensors)
        padded, rows = _pad_op(lengths, inverse, meta, F, Bp)
        return padded, None if inverse is None else rows
    return pad_kernels(lengths, inverse, meta, F, Bp)


def pad_kernels(lengths, inverse, meta, F, Bp):
    """The launches (interpreted in CPU tests)."""
    padded = torch.empty(F * Bp, dtype=lengths.dtype, device=lengths.device)
    parts = [(padded, F * Bp, False)]
    rows, Bo = None, 0
    if inverse is not None:
        Bo = inverse.shape[-1]
        rows = torch.empty((Bo, F), dtype=torch.int64, device=lengths.device)
        parts.append((rows, F * Bo, True))
    block = tuning.PAD_BLOCK
    for out, n, is_rows in parts:
        if n:
            launch(_pad_kernel)[(cdiv(n, block),)](lengths, inverse, meta, out, F, Bp, Bo,
                                                   0 if inverse is None else inverse.stride(0),
                                                   BLOCK=block, ROWS=is_rows)
    return padded, rows


@kernel_op("embfuse::pad_variable_batch", mutates_args=())
def _pad_op(lengths: Tensor, inverse: Optional[Tensor], meta: Tensor, F: int, Bp: int) -> tuple[Tensor, Tensor]:
    padded, rows = (pad_kernels if use_kernels(lengths) else pad_reference)(lengths, inverse, meta, F, Bp)
    return padded, rows if rows is not None else meta.new_empty(0)


@_pad_op.register_fake
def _(lengths, inverse, meta, F, Bp):
    rows = (0,) if inverse is None else (inverse.shape[-1], F)
    return lengths.new_empty(F * Bp), meta.new_empty(rows)
