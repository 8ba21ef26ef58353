"""Plain lookups: out[i, :] = weight[ids[i], :] for every id, in the ids' shape.

The gradient of a row sums the output gradients of every position holding its id (none for
padding_idx; divided by the id's count under scale_grad_by_freq), reduced deterministically.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from embfuse._triton import (backward_needs_op, cdiv, eager_autograd, kernel_op, launch, needs_op, tl, tracing,
                              triton, use_kernels)
from embfuse.ops.bags import SUM, index_sum
from embfuse.ops.segments import rowwise_sparse_grad, segment_grad, segment_grad_reference
from embfuse.ops import tuning
from embfuse.ops.check_kernels import check_ids_program, next_pair, wait_for_check
from embfuse.ops.deferred import folded_checks, take_fold
from embfuse.ops.validate import (COO, DEFAULT_BOUNDS_CHECK, ROWWISE, check_bounds_mode, check_device,
                                  check_index_dtype, check_weight, guard, padding_index, row_major, sparse_layout,
                                  torch_records, validate_ids)


def embedding_reference(weight: Tensor, indices: Tensor) -> Tensor:
    """Pure torch on any device; `indices` 1-D, output (n, D)."""
    return weight.index_select(0, indices.long())


@triton.jit
def _gather_tile(tile, col_block, weight, indices, ok, out, n, D, stride_w, stride_o, STATUS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of ids [tile * BLOCK_N, + BLOCK_N) over column block `col_block`; `ok` (with STATUS):
    whether the batch's check passed (a batch it found bad reads no row: zeros, ops/validate.py)."""
    pos = tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    nmask = pos < n
    m2 = nmask[:, None] & (cols < D)[None, :]
    ids = tl.load(indices + pos, mask=nmask, other=0).to(tl.int64)
    read = m2
    if STATUS:
        read = (pos < tl.where(ok, n, 0))[:, None] & (cols < D)[None, :]
    rows = tl.load(weight + ids[:, None] * stride_w + cols[None, :], mask=read, other=0.0)
    tl.store(out + pos[:, None] * stride_o + cols[None, :], rows, mask=m2)


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["n"])
def _embedding_fwd_kernel(weight, indices, status, out, n, D, stride_w, stride_o, STATUS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    ok = True
    if STATUS:
        ok = tl.load(status) == 0
    _gather_tile(tl.program_id(0), tl.program_id(1), weight, indices, ok, out, n, D, stride_w, stride_o, STATUS,
                 BLOCK_N, BLOCK_D)


@triton.jit(do_not_specialize=["slot", "seq", "n", "checks"])
def _embedding_fwd_checked_kernel(weight, indices, out, n, D, stride_w, stride_o, num_embeddings, status, statuses,
                                  ring, slot, seq, checks, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                  CHECK_BLOCK: tl.constexpr):
    """_embedding_fwd_kernel with the batch's deferred check folded in, as the pooled lookup's
    (ops/embedding_bag.py _embedding_bag_fwd_checked_kernel)."""
    pid = tl.program_id(0)
    if pid < checks:
        if tl.program_id(1) == 0:
            check_ids_program(pid, checks, indices, n, indices, 0, num_embeddings, status, next_pair(statuses, slot),
                              ring, slot, seq, None, None, None, CHECK_BLOCK, True, False)
    else:
        ok = wait_for_check(status, checks) == 0
        _gather_tile(pid - checks, tl.program_id(1), weight, indices, ok, out, n, D, stride_w, stride_o, True,
                     BLOCK_N, BLOCK_D)


def embedding_forward(weight: Tensor, indices: Tensor, status: Optional[Tensor] = None, check=None) -> Tensor:
    """Triton launcher: same result as `embedding_reference`. `check`: the batch's deferred
    Check in place of `status`; if its launch is still pending (validate_ids `fold`), its
    programs run first in this launch."""
    n, D = indices.numel(), weight.shape[1]
    out = torch.empty(n, D, dtype=weight.dtype, device=weight.device)
    folded = None
    if check is not None:
        folded = take_fold(check) if n and D else None
        status = check.status if folded is None else None
    if n == 0 or D == 0:
        return out
    block_n, block_d = tuning.gather_shape(D, tracing())
    grid_d = cdiv(D, block_d)
    if folded is not None:
        checks = folded_checks(n, 0)
        # (the status pair is a row of the log's statuses, which it also gets: an eager call's fold)
        launch(_embedding_fwd_checked_kernel, overlapping=True)[(checks + cdiv(n, block_n), grid_d)](
            weight, indices, out, n, D, weight.stride(0), out.stride(0), weight.shape[0], *folded, checks,
            BLOCK_N=block_n, BLOCK_D=block_d, CHECK_BLOCK=tuning.FOLD_BLOCK)
        return out
    launch(_embedding_fwd_kernel)[(cdiv(n, block_n), grid_d)](
        weight, indices, status, out, n, D, weight.stride(0), out.stride(0),
        STATUS=status is not None, BLOCK_N=block_n, BLOCK_D=block_d
    )
    return out


def gather(weight, indices, status=None, check=None):
    """The forward without the op's dispatch: kernel or reference by device and dtype. `check`:
    the batch's deferred Check in place of `status` (the kernel may fold it in)."""
    if use_kernels(weight) and weight.is_floating_point() and row_major(weight):  # (else torch's gather)
        return embedding_forward(weight, indices, status, check)
    if check is not None:
        status = check.status
    if status is not None:  # torch's gather would fault on a bad id: a bad batch gives zeros
        return embedding_reference(weight, guard(indices, status, 0)) * (status[0] == 0)
    return embedding_reference(weight, indices)


def guarded_ids(indices, status):
    """The ids as the backward takes them: int64, every one -1 when the batch is bad."""
    return indices.long() if status is None else guard(indices.long(), status, -1)


def _embedding_body(weight: Tensor, indices: Tensor, status: Optional[Tensor], padding_idx: int,
                    scale_grad_by_freq: bool, sparse: int) -> Tensor:
    return gather(weight, indices, status)


_embedding_op = kernel_op("embfuse::embedding")(_embedding_body)


@_embedding_op.register_fake
def _(weight, indices, status, padding_idx, scale_grad_by_freq, sparse):
    return weight.new_empty(indices.shape[0], weight.shape[1])


def _embedding_backward_body(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> Tensor:
    ids = indices.long()  # (-1: no row)
    if use_kernels(grad) and grad.dtype != torch.float64:
        return segment_grad(ids, grad.contiguous(), None, None, num_weights, padding_idx, scale_grad_by_freq,
                            grad.dtype)
    return segment_grad_reference(ids, grad, None, None, num_weights, padding_idx, scale_grad_by_freq, grad.dtype)


_embedding_backward_op = kernel_op("embfuse::embedding_backward")(_embedding_backward_body)


@_embedding_backward_op.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[1])


def _backward_setup(ctx, inputs, output):
    _grad, indices, num_weights, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.args = (num_weights, padding_idx, scale_grad_by_freq)


def _double_backward(ctx, grad_grad):
    """The backward's own derivative (double backward, as torch's embedding has): position p
    receives grad_grad at its row, over the row's count under scale_grad_by_freq; nothing at
    padding or at a row of -1. Torch ops, themselves differentiable."""
    (indices,) = ctx.saved_tensors
    num_weights, padding_idx, scale_grad_by_freq = ctx.args
    ids = indices.long()
    keep = ids >= 0
    if padding_idx >= 0:
        keep = keep & (ids != padding_idx)
    at = torch.where(keep, ids, 0)
    rows = torch.where(keep[:, None], grad_grad[at], 0)
    if scale_grad_by_freq:
        counts = index_sum(num_weights, at, keep.to(grad_grad.dtype))
        rows = rows / counts[at].clamp(min=1)[:, None]
    return rows, None, None, None, None


_embedding_backward_op.register_autograd(_double_backward, setup_context=_backward_setup)


def _sparse_grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """torch's sparse=True gradient: one COO entry per position (positions of id -1, a bad
    batch's, row 0 with zeros); padding positions are left out, as torch does (a host read on a
    GPU, as torch's)."""
    ids = indices.long()
    keep = ids >= 0
    if padding_idx >= 0:
        keep = keep & (ids != padding_idx)
    values = torch.where(keep[:, None], grad, 0)
    ids = torch.where(ids >= 0, ids, 0)
    if padding_idx >= 0:
        ids, values = ids[keep], values[keep]
    if scale_grad_by_freq:
        counts = index_sum(num_weights, ids, torch.ones_like(ids, dtype=torch.float32))
        values = values / counts[ids][:, None].to(grad.dtype)
    return torch.sparse_coo_tensor(ids[None], values, (num_weights, grad.shape[1]), check_invariants=False)


def _setup_context(ctx, inputs, output):
    weight, indices, status, padding_idx, scale_grad_by_freq, sparse = inputs
    ctx.save_for_backward(indices, status)
    ctx.args = (weight.shape[0], padding_idx, scale_grad_by_freq, sparse)


def _autograd_backward(ctx, grad):
    indices, status = ctx.saved_tensors
    num_weights, padding_idx, scale_grad_by_freq, sparse = ctx.args
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    indices = guarded_ids(indices, status)
    if sparse == ROWWISE:
        g = rowwise_sparse_grad(indices.long(), grad, None, None, num_weights, padding_idx, scale_grad_by_freq,
                                use_kernels(grad) and grad.dtype != torch.float64)
    elif sparse == COO:
        g = _sparse_grad(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    else:  # (the op where its own backward may be taken: double backward under create_graph)
        dense = _embedding_backward_op if backward_needs_op(grad) else _embedding_backward_body
        g = dense(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    return g, None, None, None, None, None


_embedding_op.register_autograd(_autograd_backward, setup_context=_setup_context)
_eager_embedding = eager_autograd(_embedding_body, _setup_context, _autograd_backward)


def prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name, fresh=True, fold=False):
    """Check torch-style arguments (and apply max_norm): returns (1-D ids, keep-mask or None,
    padding_idx, check); under bounds_check="skip" out-of-range ids become 0 and keep marks the
    rest; `check` is the deferred Check (ops/validate.py) or None; `fold`: validate_ids'."""
    check_weight(weight)
    check_index_dtype(name, input)
    check_bounds_mode(bounds_check)
    check_device(name, input, weight)
    num_embeddings = weight.shape[0]
    padding_idx = padding_index(padding_idx, num_embeddings)
    if (max_norm is not None or dual(weight)) and bounds_check == "deferred":
        # the renorm below writes rows named by the ids, and torch's own lookup (forward-mode AD)
        # reads them: they must be known good first
        bounds_check = "sync"
    keep, check = validate_ids(input, num_embeddings, name=name, bounds_check=bounds_check, fresh=fresh, fold=fold)
    flat = input.reshape(-1).contiguous()
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, 0)
    if max_norm is not None:
        with torch.no_grad():  # the detached weight, as torch renorms it (a dual tensor's too)
            torch.embedding_renorm_(weight.detach(), flat, max_norm, norm_type)
    return flat, keep, padding_idx, check


def dual(weight) -> bool:
    """Whether `weight` carries a forward-mode AD tangent (one int compared when no forward-AD
    level is open)."""
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(weight).tangent is not None


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool | str = False,
    *,
    bounds_check: str = DEFAULT_BOUNDS_CHECK,
    name: str = "input",
) -> Tensor:
    """Drop-in for `torch.nn.functional.embedding`.

    sparse: False, True (torch's sparse COO gradient, one entry per id) or "rowwise" (one
    entry per distinct row: a coalesced sparse COO tensor, as in `embfuse.embedding_bag`).
    bounds_check: as in `embfuse.embedding_bag` ("deferred", "sync", "skip" or "off"); "skip"
    gives a zero row (and no gradient) for each out-of-range id, with a warning.
    """
    sparse = sparse_layout(sparse)
    grad = needs_op(weight)
    flat, keep, padding_idx, check = prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check,
                                                 name, fresh=grad, fold=not grad)
    if dual(weight):  # forward-mode AD: torch's own lookup has the forward derivative (checked above)
        out = torch.embedding(weight, flat, padding_idx, scale_grad_by_freq, bool(sparse))
        return out.view(*input.shape, weight.shape[1])
    out = lookup_rows(weight, flat, None, padding_idx, scale_grad_by_freq, sparse, check)
    if keep is not None:  # (a where, not a product: skipped rows are +0.0, not -0.0 times a row)
        out = torch.where(keep.reshape(-1, 1), out, 0)
    return out.view(*input.shape, weight.shape[1])


def lookup_rows(weight, flat, status=None, padding_idx=-1, scale_grad_by_freq=False, sparse=0, check=None):
    """The lookup of checked 1-D ids (status: their deferred check's, or None; or `check`, the
    Check): through the registered op under tracing, its eager autograd twin when autograd
    records the call, else straight to the kernel."""
    if needs_op(weight):
        if check is not None:
            status = check.status
        if status is None and torch_records(weight, SUM, sparse, scale_grad_by_freq):
            return torch.embedding(weight, flat, padding_idx, scale_grad_by_freq, sparse == COO)
        run = _embedding_op if tracing() else _eager_embedding
        return run(weight, flat, status, padding_idx, scale_grad_by_freq, sparse)
    return gather(weight, flat, status, check)
