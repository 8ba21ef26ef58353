"""Plain lookups: out[i, :] = weight[ids[i], :] for every id, in the ids' shape.

The gradient of a row sums the output gradients of every position holding its id (none for
padding_idx; divided by the id's count under scale_grad_by_freq), reduced deterministically.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import cdiv, kernel_op, launch, needs_op, next_pow2, tl, triton, use_kernels
from embfuse.ops._segment import rowwise_sparse_grad, segment_grad, segment_grad_reference
from embfuse.ops._validate import (COO, ROWWISE, check_bounds_mode, check_index_dtype, check_weight, padding_index,
                                   sparse_layout, validate_ids)


def embedding_reference(weight: Tensor, indices: Tensor) -> Tensor:
    """Pure torch on any device; `indices` 1-D, output (n, D)."""
    return weight.index_select(0, indices.long())


@triton.jit
def _embedding_fwd_kernel(weight, indices, out, n, D, stride_w, stride_o, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    nmask = pos < n
    m2 = nmask[:, None] & (cols < D)[None, :]
    ids = tl.load(indices + pos, mask=nmask, other=0).to(tl.int64)
    rows = tl.load(weight + ids[:, None] * stride_w + cols[None, :], mask=m2)
    tl.store(out + pos[:, None] * stride_o + cols[None, :], rows, mask=m2)


def embedding_forward(weight: Tensor, indices: Tensor) -> Tensor:
    """Triton launcher: same result as `embedding_reference`."""
    n, D = indices.numel(), weight.shape[1]
    out = torch.empty(n, D, dtype=weight.dtype, device=weight.device)
    if n == 0 or D == 0:
        return out
    block_d = min(next_pow2(D), 256)
    block_n = max(1, min(64, 2048 // block_d))
    launch(_embedding_fwd_kernel)[(cdiv(n, block_n), cdiv(D, block_d))](
        weight, indices, out, n, D, weight.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_D=block_d
    )
    return out


def _forward_impl(weight, indices):
    if use_kernels(weight):
        return embedding_forward(weight, indices)
    return embedding_reference(weight, indices)


@kernel_op("embfuse::embedding", mutates_args=())
def _embedding_op(weight: Tensor, indices: Tensor, padding_idx: int, scale_grad_by_freq: bool,
                  sparse: int) -> Tensor:
    return _forward_impl(weight, indices)


@_embedding_op.register_fake
def _(weight, indices, padding_idx, scale_grad_by_freq, sparse):
    return weight.new_empty(indices.shape[0], weight.shape[1])


@kernel_op("embfuse::embedding_backward", mutates_args=())
def _embedding_backward_op(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                           scale_grad_by_freq: bool) -> Tensor:
    ids = indices.long()
    if use_kernels(grad) and grad.dtype != torch.float64:
        return segment_grad(ids, grad.contiguous(), None, None, num_weights, padding_idx, scale_grad_by_freq,
                            grad.dtype)
    return segment_grad_reference(ids, grad, None, None, num_weights, padding_idx, scale_grad_by_freq, grad.dtype)


@_embedding_backward_op.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[1])


def _sparse_grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """torch's sparse=True gradient: one COO entry per position (padding rows get zeros)."""
    ids = indices.long()
    values = grad
    if padding_idx >= 0:
        values = values * (ids != padding_idx)[:, None]
    if scale_grad_by_freq:
        counts = torch.zeros(num_weights, dtype=torch.float32, device=grad.device).index_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float32)
        )
        values = values / counts[ids][:, None].to(grad.dtype)
    return torch.sparse_coo_tensor(ids[None], values, (num_weights, grad.shape[1]), check_invariants=False)


def _setup_context(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq, sparse = inputs
    ctx.save_for_backward(indices)
    ctx.args = (weight.shape[0], padding_idx, scale_grad_by_freq, sparse)


def _autograd_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    num_weights, padding_idx, scale_grad_by_freq, sparse = ctx.args
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    if sparse == ROWWISE:
        g = rowwise_sparse_grad(indices.long(), grad, None, None, num_weights, padding_idx, scale_grad_by_freq,
                                use_kernels(grad) and grad.dtype != torch.float64)
    elif sparse == COO:
        g = _sparse_grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    else:
        g = _embedding_backward_op(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    return g, None, None, None, None


_embedding_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name):
    """Check torch-style arguments (and apply max_norm): returns (1-D ids, keep-mask or None,
    padding_idx); under bounds_check="skip" out-of-range ids become 0 and keep marks the rest."""
    check_weight(weight)
    check_index_dtype(name, input)
    check_bounds_mode(bounds_check)
    if input.device != weight.device:
        raise ValueError(f"{name} is on {input.device} but weight is on {weight.device}")
    num_embeddings = weight.shape[0]
    padding_idx = padding_index(padding_idx, num_embeddings)
    keep = validate_ids(input, num_embeddings, name=name, bounds_check=bounds_check)
    flat = input.reshape(-1).contiguous()
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, 0)
    if max_norm is not None:
        with torch.no_grad():
            torch.embedding_renorm_(weight, flat, max_norm, norm_type)
    return flat, keep, padding_idx


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool | str = False,
    *,
    bounds_check: str = "raise",
    name: str = "input",
) -> Tensor:
    """Drop-in for `torch.nn.functional.embedding`.

    sparse: False, True (torch's sparse COO gradient, one entry per id) or "rowwise" (one
    entry per distinct row: a coalesced sparse COO tensor, as in `embfuse.embedding_bag`).
    bounds_check: "raise" (default) raises IndexError naming the first bad id; "skip" gives a
    zero row (and no gradient) for each out-of-range id, with a warning; "off" checks nothing.
    """
    sparse = sparse_layout(sparse)
    flat, keep, padding_idx = prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name)
    if needs_op(weight):
        out = _embedding_op(weight, flat, padding_idx, scale_grad_by_freq, sparse)
    else:
        out = _forward_impl(weight, flat)
    if keep is not None:
        out = out * keep.reshape(-1, 1)
    return out.view(*input.shape, weight.shape[1])
