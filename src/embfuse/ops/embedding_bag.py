"""Pooled lookups: embedding_bag with sum, mean and max pooling, optionally weighted.

    out[b, :] = pool over p in [offsets[b], offsets[b+1]) with ids[p] != padding_idx of
                w[p] * weight[ids[p], :]

pool = sum (w = per_sample_weights or 1), mean (sum / number of pooled ids), sqrtn (sum / sqrt
of the sum of squared weights: TensorFlow's combiner, an extension), wmean (sum / sum of the
weights: TensorFlow's mean, an extension) or max (per column; w = 1); an empty bag gives zeros.
The pooling rules are ops/bags.py's (a single table is its F = 1).
Inputs are brought to one canonical form first: 1-D ids and B+1 offsets (the last is where the
last bag ends), whatever torch form the caller used.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import (backward_needs_op, cdiv, eager_autograd, kernel_op, launch, needs_op, tl, tracing,
                              triton, use_kernels)
from embfuse.ops.bags import (K_MAX, K_NO_PADDING, K_PADDING_ID, K_SQRTN, K_SUM, K_WMEAN, MAX, POOLINGS, SCALED, SQRTN,
                              SUM, TORCH_MODES, WEIGHT_SUMS, accumulation, backward_inputs, bag_norms_reference, divide,
                              divide_reference, pool_bag, held_offsets, index_sum, pool_norm, pooled_values,
                              single_meta, torch_cpu)
from embfuse.ops.errors import BadArgumentError, BadDtypeError, UnsupportedError
from embfuse.ops.segments import rowwise_sparse_grad, segment_grad, segment_grad_reference
from embfuse.ops import tuning
from embfuse.ops.check_kernels import check_ids_program, next_pair, wait_for_check
from embfuse.ops.deferred import folded_checks, take_fold
from embfuse.ops.residency import window
from embfuse.ops.validate import (COO, DEFAULT_BOUNDS_CHECK, ROWWISE, check_bounds_mode, check_device,
                                  check_index_dtype, check_weight, clamp_last_offset, guard, padding_index, row_major,
                                  sparse_layout, torch_records, validate_bags)


def _max_reference(rows, keep, bag, indices, B, D, acc_dtype, out_dtype):
    """Max pooling as torch does it, per column: the bag's first pooled value, replaced by each
    later value strictly greater (so a NaN first value stays, a later NaN is passed over, and
    -inf is a value like any other); ties keep the earliest. (output, the id that gave it or -1)."""
    n, dev = indices.numel(), rows.device
    ids = torch.cat([indices.long(), indices.new_full((1,), -1).long()])
    if n == 0:
        return torch.zeros(B, D, dtype=out_dtype, device=dev), ids.new_full((B, D), -1)
    number = keep[:, None] & ~torch.isnan(rows)
    top = torch.full((B, D), float("-inf"), dtype=acc_dtype, device=dev).scatter_reduce_(
        0, bag[:, None].expand(-1, D), torch.where(number, rows, float("-inf")), "amax")
    pos = torch.arange(n, device=dev)
    at = torch.full((B, D), n, dtype=torch.long, device=dev).scatter_reduce_(
        0, bag[:, None].expand(-1, D), torch.where(number & (rows == top[bag]), pos[:, None], n), "amin")
    # the bag's first pooled position: a NaN there is the result
    first = torch.full((B,), n, dtype=torch.long, device=dev).scatter_reduce_(
        0, bag, torch.where(keep, pos, n), "amin")
    nan_first = (first < n)[:, None] & torch.isnan(rows[first.clamp(max=n - 1)])
    at = torch.where(nan_first, first[:, None], at)
    out = torch.where(nan_first, float("nan"), torch.where(at == n, 0, top))
    return out.to(out_dtype), ids[at]


def embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode, padding_idx):
    """Pure torch on any device: (output, max_ids). max_ids[b, d] is the id whose row gave the
    max (first one on ties, -1 for an empty bag) in max mode, else an empty tensor."""
    B, D = offsets.numel() - 1, weight.shape[1]
    acc_dtype = accumulation(weight)
    keep, bag = pooled_values(indices, offsets, padding_idx)
    rows = weight[indices.long()].to(acc_dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(acc_dtype)[:, None]
    if mode == MAX:
        return _max_reference(rows, keep, bag, indices, B, D, acc_dtype, weight.dtype)
    out = index_sum(B, bag, torch.where(keep[:, None], rows, 0))  # (not a product: 0 * NaN is NaN)
    if mode in SCALED:
        meta = single_meta(weight.shape[0], D, mode, weight.device)
        out = divide_reference(out, bag_norms_reference(indices, offsets, per_sample_weights, meta, B, padding_idx,
                                                        acc_dtype)[2])
    return out.to(weight.dtype), indices.new_empty(0, dtype=torch.int64)


@triton.jit
def _pool_program(bag, col_block, weight, indices, offsets, psw, ok, out, max_ids, D, stride_w, stride_o, padding_idx,
                  n, B, MODE: tl.constexpr, HAS_PSW: tl.constexpr, HAS_PADDING: tl.constexpr, STATUS: tl.constexpr,
                  OPEN_END: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """Pool bag `bag` of B over column block `col_block`; `ok` (with STATUS): whether the batch's
    check passed (a batch it found bad pools nothing, ops/validate.py). OPEN_END: the last bag ends
    at the n-th id and offsets[B] is never read (else bag b ends at offsets[b + 1])."""
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    start = tl.load(offsets + bag).to(tl.int64)
    if OPEN_END:
        inner = bag + 1 < B
        end = tl.where(inner, tl.load(offsets + bag + 1, mask=inner, other=0).to(tl.int64), n)
    else:
        end = tl.load(offsets + bag + 1).to(tl.int64)
    if STATUS:
        end = tl.where(ok, end, start)
    result, best, count, wsum = pool_bag(weight, indices, psw, start, end, cols, cmask, stride_w, padding_idx,
                                         MODE == K_SQRTN, MODE != K_SUM and MODE != K_MAX, MODE, HAS_PSW,
                                         K_PADDING_ID if HAS_PADDING else K_NO_PADDING,
                                         (MODE == K_SQRTN) or (MODE == K_WMEAN), BLOCK_L, BLOCK_D, EVICT)
    if MODE != K_SUM and MODE != K_MAX:
        result = divide(result, pool_norm(MODE, count, wsum))
    if MODE == K_MAX:
        tl.store(max_ids + bag * D + cols, best, mask=cmask)
    tl.store(out + bag * stride_o + cols, result.to(out.dtype.element_ty), mask=cmask)


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["n", "B"])
def _embedding_bag_fwd_kernel(
    weight, indices, offsets, psw, status, out, max_ids, D, stride_w, stride_o, padding_idx, n, B,
    MODE: tl.constexpr, HAS_PSW: tl.constexpr, HAS_PADDING: tl.constexpr, STATUS: tl.constexpr,
    OPEN_END: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr,
):
    ok = True
    if STATUS:
        ok = tl.load(status) == 0
    _pool_program(tl.program_id(0).to(tl.int64), tl.program_id(1), weight, indices, offsets, psw, ok, out, max_ids, D,
                  stride_w, stride_o, padding_idx, n, B, MODE, HAS_PSW, HAS_PADDING, STATUS, OPEN_END, BLOCK_L,
                  BLOCK_D, EVICT)


@triton.jit(do_not_specialize=["slot", "seq", "n", "B", "n_offsets", "checks"])
def _embedding_bag_fwd_checked_kernel(
    weight, indices, offsets, psw, out, max_ids, D, stride_w, stride_o, padding_idx,
    n, B, n_offsets, num_embeddings, status, statuses, ring, slot, seq, checks,
    MODE: tl.constexpr, HAS_PSW: tl.constexpr, HAS_PADDING: tl.constexpr, OPEN_END: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr, CHECK_BLOCK: tl.constexpr,
    CLAMP_LAST: tl.constexpr,
):
    """_embedding_bag_fwd_kernel with the batch's deferred check folded in (a small batch, whose
    time is the host's: one launch instead of two). The first `checks` programs of column block
    0 check the ids and offsets (check_kernels.check_ids_program); the rest pool bag pid - checks
    once the check has reported (check_kernels.wait_for_check). `statuses`, `slot`: the device log's
    (deferred.take_fold)."""
    pid = tl.program_id(0)
    if pid < checks:
        if tl.program_id(1) == 0:
            check_ids_program(pid, checks, indices, n, offsets, n_offsets, num_embeddings, status,
                              next_pair(statuses, slot), ring, slot, seq, None, None, None, CHECK_BLOCK, True, False,
                              CLAMP_LAST)
    else:
        ok = wait_for_check(status, checks) == 0
        _pool_program((pid - checks).to(tl.int64), tl.program_id(1), weight, indices, offsets, psw, ok, out, max_ids,
                      D, stride_w, stride_o, padding_idx, n, B, MODE, HAS_PSW, HAS_PADDING, True, OPEN_END, BLOCK_L,
                      BLOCK_D, EVICT)


def embedding_bag_forward(weight, indices, offsets, per_sample_weights, mode, padding_idx, config=None,
                          with_max_ids=True, status=None, out=None, check=None, open_end=None):
    """Triton launcher for the canonical form; same results as `embedding_bag_reference`.
    `open_end`: the offsets are torch's as given and the last bag ends at the last id: "starts",
    B bag starts (include_last_offset=False); "last", B + 1 offsets whose last the pooling never
    reads and a folded check reads as at least the id count (include_last_offset=True).
    with_max_ids=False (eager calls that drop it): no empty max_ids tensor outside max mode
    (None instead), one allocation less on the host path of a small call. `out`: a (B, D)
    tensor of the weight's dtype to write into (tests poison it). `check`: the batch's deferred
    Check (instead of `status`); if its launch is still pending (ops/validate.py validate_bags,
    `fold`), its programs run first in this launch."""
    B, D = offsets.numel() - (0 if open_end == "starts" else 1), weight.shape[1]
    if out is None:
        out = torch.empty(B, D, dtype=weight.dtype, device=weight.device)
    max_ids = None
    if mode == MAX:
        max_ids = torch.empty(B, D, dtype=torch.int64, device=weight.device)
    elif with_max_ids:
        max_ids = torch.empty(0, dtype=torch.int64, device=weight.device)
    folded = None
    if check is not None:
        folded = take_fold(check) if B and D else None
        status = check.status if folded is None else None
    if B == 0 or D == 0:
        return out, max_ids
    cfg = tuning.pooling_shape(D, indices.numel(), B, config, tracing(), weight.element_size(), mode == MAX,
                               folded is not None)
    # (a tensor the kernel does not read goes as None, a constexpr: each tensor argument costs
    # about a microsecond of host time a launch, benchmarks/NOTES.md session 26)
    args = (weight, indices, offsets, per_sample_weights)
    flags = dict(MODE=mode, HAS_PSW=per_sample_weights is not None, HAS_PADDING=padding_idx >= 0,
                 OPEN_END=open_end is not None, **cfg)
    if folded is not None:
        checks = folded_checks(indices.numel(), offsets.numel())
        # (the status pair is a row of the log's statuses, which it also gets: an eager call's fold)
        launch(_embedding_bag_fwd_checked_kernel, overlapping=True)[(checks + B, cdiv(D, cfg["BLOCK_D"]))](
            *args, out, max_ids if mode == MAX else None, D, weight.stride(0), out.stride(0), padding_idx,
            indices.numel(), B, offsets.numel(), weight.shape[0], *folded, checks, CHECK_BLOCK=tuning.FOLD_BLOCK,
            CLAMP_LAST=open_end == "last", **flags)
        return out, max_ids
    # (n and B are read only under OPEN_END; constants otherwise, so they add no specialisations)
    launch(_embedding_bag_fwd_kernel)[(B, cdiv(D, cfg["BLOCK_D"]))](
        *args, status, out, max_ids if mode == MAX else None, D, weight.stride(0), out.stride(0), padding_idx,
        *((indices.numel(), B) if open_end is not None else (0, 0)), STATUS=status is not None, **flags)
    return out, max_ids


def table_backward_inputs(indices, offsets, per_sample_weights, mode, padding_idx, num_weights, dim, **kwargs):
    """bags.backward_inputs for one (num_weights, dim) table pooled by `mode` (F = 1)."""
    return backward_inputs(indices, offsets, per_sample_weights, single_meta(num_weights, dim, mode, indices.device),
                           offsets.numel() - 1, padding_idx=padding_idx, wide_keys=num_weights >= 2**31,
                           scaled=mode in SCALED, weight_sums=mode in WEIGHT_SUMS, **kwargs)


def _backward(grad, indices, offsets, per_sample_weights, max_ids, num_weights, mode, padding_idx,
              scale_grad_by_freq, reduce, inputs):
    D = grad.shape[1]
    if mode == MAX:  # (max_ids are -1 for every bag of a batch its check found bad)
        # each (bag, column) sends its gradient to one (row, column): reduce over the flat table
        flat = torch.where(max_ids >= 0, max_ids * D + torch.arange(D, device=grad.device), -1)
        g = reduce(flat.reshape(-1), grad.reshape(-1, 1), None, None, num_weights * D, -1, False, grad.dtype)
        return g.view(num_weights, D)
    if offsets.numel() == 1:
        return torch.zeros(num_weights, D, dtype=grad.dtype, device=grad.device)
    ids, bag, scale = inputs(indices, offsets, per_sample_weights, mode, padding_idx, num_weights, D,
                             dtype=accumulation(grad))
    return reduce(ids, grad, bag, scale, num_weights, padding_idx, scale_grad_by_freq, grad.dtype)


def embedding_bag_backward_reference(grad, indices, offsets, per_sample_weights, max_ids, num_weights, mode,
                                     padding_idx, scale_grad_by_freq, status=None):
    return _backward(grad, indices, offsets, per_sample_weights, max_ids, num_weights, mode, padding_idx,
                     scale_grad_by_freq, segment_grad_reference,
                     functools.partial(table_backward_inputs, kernel=False, status=status))


def embedding_bag_backward(grad, indices, offsets, per_sample_weights, max_ids, num_weights, mode, padding_idx,
                           scale_grad_by_freq, status=None):
    """Dense weight gradient through the deterministic Triton segment reduction."""
    return _backward(grad.contiguous(), indices, offsets, per_sample_weights, max_ids, num_weights, mode,
                     padding_idx, scale_grad_by_freq, segment_grad,
                     functools.partial(table_backward_inputs, kernel=True, status=status))


def pools_with_kernels(weight) -> bool:
    """Whether `pool` takes the Triton kernel for this table (else torch ops)."""
    return use_kernels(weight) and weight.dtype != torch.float64 and row_major(weight)


def pool(weight, indices, offsets, per_sample_weights, mode, padding_idx, with_max_ids=True, status=None, check=None):
    """The forward without the op's dispatch: (output, max ids), kernel or reference by device.
    `check`: the batch's deferred Check, in place of `status` (a kernel may fold its launch in)."""
    if pools_with_kernels(weight):
        return embedding_bag_forward(weight, indices, offsets, per_sample_weights, mode, padding_idx,
                                     with_max_ids=with_max_ids, status=status, check=check)
    if check is not None:
        status = check.status
    if status is not None:  # torch ops would fault on a bad id: a bad batch pools nothing
        indices, offsets = guard(indices, status, 0), guard(offsets, status, 0)
    if torch_cpu(weight, mode):
        return _torch_pool(weight, indices, offsets, per_sample_weights, mode, padding_idx)
    return embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode, padding_idx)


def _torch_pool(weight, indices, offsets, per_sample_weights, mode, padding_idx):
    """pool's CPU path over fp32 and fp64 tables (summed in the table's own dtype, as embfuse
    sums): torch's own CPU kernel, which gathers and pools in one pass where the reference
    materialises every gathered row (benchmarks/NOTES.md, session 29). Its max is
    `_max_reference`'s rule (NaN, inf, ties, padding), but an empty bag's max id is 0 there and
    -1 here."""
    offsets = held_offsets(offsets, indices.numel()).to(indices.dtype)
    # a sum, eager: _embedding_bag_forward_only, which skips the buffers of torch's backward
    # (embfuse has its own): the same output, faster (NOTES: session 66). Not traced: its meta
    # kernel gives B + 1 bag sizes where its CPU kernel gives B, and torch 2.11's inductor fails
    # its output check on that under compile (session 29)
    own = torch._embedding_bag_forward_only if mode == SUM and not tracing() else torch._embedding_bag
    out, _, size, max_ids = own(weight, indices, offsets, False, TORCH_MODES[mode], False, per_sample_weights, True,
                                padding_idx)
    if mode != MAX:
        return out, indices.new_empty(0, dtype=torch.int64)
    return out, torch.where(size[:, None] == 0, -1, max_ids.long())


def _embedding_bag_body(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], status: Optional[Tensor],
    mode: int, padding_idx: int, scale_grad_by_freq: bool, sparse: int,
) -> tuple[Tensor, Tensor]:
    return pool(weight, indices, offsets, per_sample_weights, mode, padding_idx, status=status)


_embedding_bag_op = kernel_op("embfuse::embedding_bag")(_embedding_bag_body)


@_embedding_bag_op.register_fake
def _(weight, indices, offsets, per_sample_weights, status, mode, padding_idx, scale_grad_by_freq, sparse):
    B, D = offsets.shape[0] - 1, weight.shape[1]
    max_ids = weight.new_empty((B, D) if mode == MAX else (0,), dtype=torch.int64)
    return weight.new_empty(B, D), max_ids


def _embedding_bag_backward_body(
    grad: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor], status: Optional[Tensor],
    max_ids: Tensor, num_weights: int, mode: int, padding_idx: int, scale_grad_by_freq: bool,
) -> Tensor:
    if use_kernels(grad) and grad.dtype != torch.float64:
        return embedding_bag_backward(grad, indices, offsets, per_sample_weights, max_ids, num_weights, mode,
                                      padding_idx, scale_grad_by_freq, status)
    return embedding_bag_backward_reference(grad, indices, offsets, per_sample_weights, max_ids, num_weights,
                                            mode, padding_idx, scale_grad_by_freq, status)


_embedding_bag_backward_op = kernel_op("embfuse::embedding_bag_backward")(_embedding_bag_backward_body)


@_embedding_bag_backward_op.register_fake
def _(grad, indices, offsets, per_sample_weights, status, max_ids, num_weights, mode, padding_idx,
      scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[1])


def _sparse_grad(grad, indices, offsets, per_sample_weights, num_weights, mode, padding_idx, scale_grad_by_freq,
                 status=None):
    """torch's sparse=True gradient: one COO entry per pooled position (uncoalesced); with a
    padding_idx its positions are left out, as torch does (a host read on a GPU, as torch's)."""
    D = grad.shape[1]
    if offsets.numel() == 1:
        return torch.sparse_coo_tensor(indices.new_empty(1, 0).long(), grad.new_empty(0, D), (num_weights, D),
                                       check_invariants=False)
    ids, bag, scale = table_backward_inputs(indices, offsets, per_sample_weights, mode, padding_idx, num_weights, D,
                                            kernel=False, status=status, dtype=accumulation(grad))
    keep = ids >= 0
    values = torch.where(keep[:, None], grad[bag], 0)
    if scale is not None:
        values = values * scale[:, None].to(grad.dtype)
    ids = torch.where(keep, ids, 0)
    if padding_idx >= 0:
        ids, values, keep = ids[keep], values[keep], keep[keep]
    if scale_grad_by_freq:
        counts = index_sum(num_weights, ids, keep.float())
        values = values / counts[ids].clamp(min=1)[:, None].to(grad.dtype)
    return torch.sparse_coo_tensor(ids[None], values, (num_weights, D), check_invariants=False)


def _rowwise_grad(grad, indices, offsets, per_sample_weights, num_weights, mode, padding_idx, scale_grad_by_freq,
                  status=None):
    """sparse="rowwise": one coalesced COO entry per distinct row, summed deterministically."""
    kernel = use_kernels(grad) and grad.dtype != torch.float64
    if offsets.numel() == 1:  # no bags: no position names a row
        return rowwise_sparse_grad(indices.new_empty(0).long(), grad[:0], None, None, num_weights, padding_idx,
                                   False, False)
    ids, bag, scale = table_backward_inputs(indices, offsets, per_sample_weights, mode, padding_idx, num_weights,
                                            grad.shape[1], kernel=kernel, status=status, dtype=accumulation(grad))
    return rowwise_sparse_grad(ids, grad, bag, scale, num_weights, padding_idx, scale_grad_by_freq, kernel)


def per_sample_weights_grad(grad, weight, indices, offsets, psw, padding_idx, status=None, mode=SUM, out=None):
    """The gradient of the per-sample weights: under sum, d out[b] / d w[p] = weight[ids[p]], one
    dot product per pooled position; where the norm n sums the weights (sqrtn: n = sqrt(sum of
    w^2), wmean: n = sum of w; out = S / n, `out` the forward's output), g . e_p / n -
    (g . out) dn/dw_p / n with dn/dw_p = w_p / n (sqrtn) or 1 (wmean), and 0 in a bag whose norm
    is 0 (its output is 0 whatever the weights are, as TensorFlow's div_no_nan)."""
    if status is not None:  # a bad batch: no position is pooled
        indices, offsets = guard(indices, status, 0), guard(offsets, status, 0)
    B = offsets.numel() - 1
    acc = torch.promote_types(grad.dtype, torch.float32)
    if not B:
        return torch.zeros_like(psw)
    keep, bag = pooled_values(indices, offsets, padding_idx)
    g = grad[bag].to(acc)
    dots = (g * weight[indices.long()].to(acc)).sum(1)
    if mode in WEIGHT_SUMS:
        meta = single_meta(weight.shape[0], weight.shape[1], mode, weight.device)
        _, _, norm, wsum = bag_norms_reference(indices, offsets, psw, meta, B, padding_idx, acc)
        zero, norm = (wsum if mode == SQRTN else norm)[bag] == 0, norm[bag]
        safe = torch.where(zero, 1, norm)
        dn = psw.to(acc) / safe if mode == SQRTN else torch.ones_like(dots)
        dots = dots / safe - (g * out[bag].to(acc)).sum(1) * dn / safe
        dots = torch.where(zero, 0, dots)  # a bag whose norm is 0 pools 0: TF's div_no_nan
    return torch.where(keep, dots, 0).to(psw.dtype)


def _setup_context(ctx, inputs, output):
    weight, indices, offsets, psw, status, mode, padding_idx, scale_grad_by_freq, sparse = inputs
    reads_out = psw is not None and mode in WEIGHT_SUMS  # its weights' gradient reads the output
    ctx.save_for_backward(weight, indices, offsets, psw, status, output[1], output[0] if reads_out else None)
    ctx.args = (weight.shape[0], mode, padding_idx, scale_grad_by_freq, sparse)


def _autograd_backward(ctx, grad, _grad_max_ids):
    weight, indices, offsets, psw, status, max_ids, out = ctx.saved_tensors
    num_weights, mode, padding_idx, scale_grad_by_freq, sparse = ctx.args
    grad_weight = grad_psw = None
    if ctx.needs_input_grad[0]:
        if sparse == ROWWISE:
            grad_weight = _rowwise_grad(grad, indices, offsets, psw, num_weights, mode, padding_idx,
                                        scale_grad_by_freq, status)
        elif sparse == COO:
            grad_weight = _sparse_grad(grad, indices, offsets, psw, num_weights, mode, padding_idx,
                                       scale_grad_by_freq, status)
        else:
            dense = _embedding_bag_backward_op if backward_needs_op(grad) else _embedding_bag_backward_body
            grad_weight = dense(grad, indices, offsets, psw, status, max_ids, num_weights, mode, padding_idx,
                                scale_grad_by_freq)
    if psw is not None and ctx.needs_input_grad[3]:
        grad_psw = per_sample_weights_grad(grad, weight, indices, offsets, psw, padding_idx, status, mode, out)
    return grad_weight, None, None, grad_psw, None, None, None, None, None


_embedding_bag_op.register_autograd(_autograd_backward, setup_context=_setup_context)
_eager_embedding_bag = eager_autograd(_embedding_bag_body, _setup_context, _autograd_backward)


def _arange_offsets(B: int, L: int, device, dtype) -> Tensor:
    if L == 0:
        return torch.zeros(B + 1, device=device, dtype=dtype)
    return torch.arange(0, B * L + 1, L, device=device, dtype=dtype)


_fixed_offsets_cached = functools.lru_cache(maxsize=64)(_arange_offsets)


def _fixed_offsets(B: int, L: int, device, dtype) -> Tensor:
    """Offsets of B bags of L ids. Eager calls reuse them (one arange launch was a quarter of
    a small lookup's host time); traced and graph-captured calls make them in the graph."""
    if tracing() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _arange_offsets(B, L, device, dtype)
    return _fixed_offsets_cached(B, L, device, dtype)


def _canonical(input, offsets, per_sample_weights, include_last_offset, open_end=False):
    """torch's input forms -> (1-D ids, B+1 offsets, 1-D weights or None). `open_end`: 1-D
    input's offsets stay as given (embedding_bag_forward's open_end), which saves the two to four
    tensor ops a call that make the last offset the id count."""
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets has to be None if input is 2-D (fixed hotness: each row is a bag)")
        B, L = input.shape
        offsets = _fixed_offsets(B, L, input.device, input.dtype)
        indices = input.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets has to be a 1-D tensor when input is 1-D (it says where each bag starts)")
        check_index_dtype("offsets", offsets)
        if offsets.dim() != 1:
            raise BadArgumentError(f"offsets has to be a 1D Tensor, got shape {tuple(offsets.shape)}")
        indices = input
        if offsets.numel() == 0:
            offsets = offsets.new_zeros(1)
        elif open_end:
            pass
        elif not include_last_offset:
            offsets = torch.cat([offsets, offsets.new_full((1,), input.numel())])
        else:
            offsets = clamp_last_offset(offsets, input.numel())
        if offsets.numel() == 1 and open_end != "starts":  # B + 1 offsets of no bag: no id is read (torch's
            indices = input[:0]  # CPU backward gave such ids garbage rows); "starts": one bag's start
            per_sample_weights = None if per_sample_weights is None else per_sample_weights[:0]
    else:
        raise BadArgumentError(f"input has to be 1D or 2D Tensor, got shape {tuple(input.shape)}")
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.reshape(-1).contiguous()
    return indices.contiguous(), offsets.contiguous(), per_sample_weights


def prepare_bags(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                 per_sample_weights, include_last_offset, padding_idx, bounds_check, name, fresh=True, remap=None,
                 fold=False, open_end=False):
    """Check and canonicalise torch-style arguments (and apply max_norm): returns the
    (indices, offsets, per_sample_weights, mode number, padding_idx, check, open_end) that the
    ops take; `check` is the batch's deferred Check (ops/validate.py) or None. `fresh`: its
    status must outlive later calls (an autograd backward will read it). `remap`, `fold`:
    validate_bags'. `open_end` (the caller pools with embedding_bag_forward): torch's offsets may
    stay as given; the last element returned is embedding_bag_forward's open_end for them (None:
    the canonical B + 1)."""
    check_weight(weight, "embedding_bag")
    check_index_dtype(name, input)
    check_bounds_mode(bounds_check)
    if mode not in POOLINGS:
        raise ValueError(f"mode has to be one of 'sum', 'mean', 'max', 'sqrtn' or 'wmean', got {mode!r}")
    check_device(name, input, weight)
    check_device("offsets", offsets, weight)
    check_device("per_sample_weights", per_sample_weights, weight)
    if per_sample_weights is not None:
        if mode not in ("sum", "sqrtn", "wmean"):
            raise UnsupportedError(f"per_sample_weights is only supported for mode='sum' (and embfuse's 'sqrtn' "
                                   f"and 'wmean'; got mode={mode!r})")
        if not per_sample_weights.is_floating_point():
            raise BadDtypeError(f"per_sample_weights must be floating point, got {per_sample_weights.dtype}")
        if per_sample_weights.dtype != weight.dtype:
            raise BadDtypeError(f"per_sample_weights must have the same type as weight ({weight.dtype}), got "
                                f"{per_sample_weights.dtype}")
        if per_sample_weights.shape != input.shape:
            raise ValueError(
                f"per_sample_weights must have the same shape as the input ({name}): expected {tuple(input.shape)}, "
                f"got {tuple(per_sample_weights.shape)}"
            )
    if scale_grad_by_freq and mode == "max":
        raise ValueError("max mode does not support scaling the gradient by the frequency")
    if sparse and mode == "max":
        raise ValueError("sparse gradients are not supported in max mode")
    num_embeddings = weight.shape[0]
    padding_idx = padding_index(padding_idx, num_embeddings)
    shape = input.shape
    given = None if offsets is None else offsets.numel()
    # (the check reads B starts as it reads B + 1 offsets, and with clamp_last torch's own B + 1:
    # the same verdicts and messages; "skip" compacts and max_norm renormalises the canonical form)
    open_end = (("last" if include_last_offset else "starts") if open_end and given and input.dim() == 1
                and max_norm is None and bounds_check in ("deferred", "off") else None)
    indices, offsets, per_sample_weights = _canonical(input, offsets, per_sample_weights, include_last_offset,
                                                      open_end)
    if max_norm is not None and bounds_check == "deferred":
        bounds_check = "sync"  # the renorm below writes rows named by the ids: they must be known good first
    indices, offsets, per_sample_weights, check = validate_bags(
        indices, offsets, num_embeddings, per_sample_weights, shape=shape, name=name, bounds_check=bounds_check,
        given_offsets=given, fresh=fresh, remap=remap, fold=fold, clamp_last=open_end == "last",
        narrow=fold and tuning.narrows(weight.shape[1], indices.numel()))
    if max_norm is not None:
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), indices, max_norm, norm_type)  # as torch: the detached weight
    return indices, offsets, per_sample_weights, POOLINGS[mode], padding_idx, check, open_end


def embedding_bag(
    input: Tensor,
    weight: Tensor,
    offsets: Optional[Tensor] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool | str = False,
    per_sample_weights: Optional[Tensor] = None,
    include_last_offset: bool = False,
    padding_idx: Optional[int] = None,
    *,
    bounds_check: str = DEFAULT_BOUNDS_CHECK,
    name: str = "input",
) -> Tensor:
    """Drop-in for `torch.nn.functional.embedding_bag`.

    mode: torch's "sum", "mean", "max", and two extensions, TensorFlow's combiners (ops/bags.py):
    "sqrtn" (the sum over the square root of the bag's sum of squared per_sample_weights, of its
    count without them) and "wmean" (the sum over the bag's sum of per_sample_weights, 0 where
    that is 0; mean without them).
    sparse: False, True (torch's sparse COO gradient, one entry per pooled id) or "rowwise"
    (one entry per distinct row, summed deterministically: a sparse COO tensor whose
    `_indices()[0]` are the touched rows, ascending, and `_values()` their gradient rows; it
    leaves the backward coalesced, but autograd drops that flag when it stores `.grad`).
    bounds_check: "deferred" (default: checked on the device without stopping the host; a bad
    batch pools nothing and its IndexError / ValueError comes from a later embfuse call or
    `embfuse.check_errors()`), "sync" (raises at this call; reads the device back), "skip"
    (drops out-of-range ids from their bags with a warning, FBGEMM's WARNING mode) or "off"
    (checks nothing: ids must be valid). See ops/validate.py. `name` is how errors call the
    input (a feature name, say).
    """
    return lookup_bags(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse_layout(sparse),
                       per_sample_weights, include_last_offset, padding_idx, bounds_check, name)


def lookup_bags(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
                include_last_offset, padding_idx, bounds_check, name, resident=None) -> Tensor:
    """embedding_bag's lookup (`sparse`: a layout number). `resident` (ops/residency.py; a lookup
    that records no gradient): the check rewrites the ids to read hot rows from their copy (unless
    they are read in place), and the pooling runs under its persisting window."""
    grad = needs_op(weight, per_sample_weights)
    remap = None if resident is None else resident.remap
    direct = not grad and remap is None and pools_with_kernels(weight)
    indices, offsets, per_sample_weights, mode, padding_idx, check, open_end = prepare_bags(
        input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx, bounds_check, name, fresh=grad, remap=remap, fold=not grad,
        open_end=direct)
    if grad:
        if check is None and torch_records(weight, mode, sparse, scale_grad_by_freq):
            offsets = held_offsets(offsets, indices.numel()).to(indices.dtype)
            return torch.embedding_bag(weight, indices, offsets, scale_grad_by_freq, TORCH_MODES[mode], sparse == COO,
                                       per_sample_weights, True, padding_idx if padding_idx >= 0 else None)[0]
        status = None if check is None else check.status
        run = _embedding_bag_op if tracing() else _eager_embedding_bag
        out, _ = run(weight, indices, offsets, per_sample_weights, status, mode, padding_idx, scale_grad_by_freq,
                     sparse)
        return out
    with window(resident):
        if direct:  # (pool's own choice, made once: a small call's time is the host's; ids read in place too)
            return embedding_bag_forward(weight, indices, offsets, per_sample_weights, mode, padding_idx,
                                         with_max_ids=False, check=check, open_end=open_end)[0]
        # (torch's offsets made canonical: open_end is None here)
        return pool(weight, indices, offsets, per_sample_weights, mode, padding_idx, with_max_ids=False,
                    check=check)[0]
