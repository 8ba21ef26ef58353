"""Deterministic gradient reduction by row, shared by the backward of every lookup op.

    grad_weight[r, :] = c_r * sum over positions p with ids[p] == r (in input order) of
                        scale[p] * grad_out[src_row[p], :]

with c_r = 1 / count_r under scale_grad_by_freq, else 1, and no gradient for padding_idx.
The ids are sorted stably once; one program owns one run of equal ids (it starts at the run's
first position) and sums it in chunks, in a fixed order: bitwise the same result every call,
no atomics. Rows no id touches keep what the output held (zeros for a dense gradient).
"""

from __future__ import annotations

import torch

from embfuse._triton import next_pow2, tl, triton, launch


def segment_grad_reference(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Pure-torch version (CPU path and test oracle); float64 in, float64 out."""
    acc_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    rows = src.to(acc_dtype)
    if src_row is not None:
        rows = rows[src_row]
    if scale is not None:
        rows = rows * scale.to(acc_dtype)[:, None]
    keep = ids >= 0
    if padding_idx >= 0:
        keep = keep & (ids != padding_idx)
    ids_k = torch.where(keep, ids, 0).long()
    rows = rows * keep[:, None]
    grad = torch.zeros(num_rows, src.shape[1], dtype=acc_dtype, device=src.device).index_add_(0, ids_k, rows)
    if scale_by_freq:
        counts = torch.zeros(num_rows, dtype=acc_dtype, device=src.device).index_add_(
            0, ids_k, keep.to(acc_dtype)
        )
        grad = grad / counts.clamp(min=1)[:, None]
    return grad.to(out_dtype)


@triton.jit
def run_sum(sorted_ids, perm, src, src_row, scale, n, j, row, cols, cmask, stride_src,
            HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum of the (scaled) source rows of the run of `row` that starts at sorted position j, in
    chunks of BLOCK_K positions in a fixed order; returns (fp32 sum, run length)."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.int32)
    k = j
    more = True
    while more:
        p = k + tl.arange(0, BLOCK_K)
        m = p < n
        m = m & (tl.load(sorted_ids + p, mask=m, other=-1) == row)
        orig = tl.load(perm + p, mask=m, other=0)
        if HAS_SRC_ROW:
            srow = tl.load(src_row + orig, mask=m, other=0).to(tl.int64)
        else:
            srow = orig
        g = tl.load(src + srow[:, None] * stride_src + cols[None, :], mask=m[:, None] & cmask[None, :], other=0.0)
        g = g.to(tl.float32)
        if HAS_SCALE:
            g = g * tl.load(scale + orig, mask=m, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(g, axis=0)
        c = tl.sum(m.to(tl.int32))
        count += c
        k += BLOCK_K
        more = c == BLOCK_K
    return acc, count


@triton.jit
def run_head(sorted_ids, j, padding_idx):
    """(row, whether program j owns it): the first position of a run of a real, non-padding
    row. Negative ids mark "no row" (e.g. empty max bags, positions outside every bag)."""
    row = tl.load(sorted_ids + j)
    prev = tl.load(sorted_ids + j - 1, mask=j > 0, other=-1)
    return row, (prev != row) & (row >= 0) & (row != padding_idx)


@triton.jit
def _segment_grad_kernel(
    sorted_ids, perm, src, src_row, scale, grad, n, D, stride_src, stride_grad, padding_idx,
    HAS_SRC_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BY_FREQ: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    row, owner = run_head(sorted_ids, j, padding_idx)
    if owner:
        acc, count = run_sum(sorted_ids, perm, src, src_row, scale, n, j, row, cols, cmask, stride_src,
                             HAS_SRC_ROW, HAS_SCALE, BLOCK_K, BLOCK_D)
        if SCALE_BY_FREQ:
            acc = acc / count.to(tl.float32)
        tl.store(grad + row * stride_grad + cols, acc.to(grad.dtype.element_ty), mask=cmask)


def chunk_rows(block_d: int) -> int:
    """Positions summed per step of a run: about 4096 elements a step, at most 64 rows."""
    return max(1, min(64, 4096 // block_d))


def segment_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Triton version of `segment_grad_reference` (same arguments); returns a dense gradient."""
    n, D = ids.numel(), src.shape[1]
    grad = torch.zeros(num_rows, D, dtype=out_dtype, device=src.device)
    if n == 0 or D == 0:
        return grad
    sorted_ids, perm = torch.sort(ids.long(), stable=True)
    block_d = min(next_pow2(D), 256)
    block_k = chunk_rows(block_d)
    src = src.contiguous()
    launch(_segment_grad_kernel)[(n, triton.cdiv(D, block_d))](
        sorted_ids, perm, src,
        src_row if src_row is not None else perm,
        scale if scale is not None else src,
        grad, n, D, src.stride(0), grad.stride(0), padding_idx,
        HAS_SRC_ROW=src_row is not None, HAS_SCALE=scale is not None, SCALE_BY_FREQ=scale_by_freq,
        BLOCK_K=block_k, BLOCK_D=block_d,
    )
    return grad
