"""Deterministic gradient reduction by row, shared by the backward of every lookup op.

    grad_weight[r, :] = c_r * sum over positions p with ids[p] == r (in input order) of
                        scale[p] * grad_out[src_row[p], :]

with c_r = 1 / count_r under scale_grad_by_freq, else 1, and no gradient for padding_idx.
The ids are sorted stably once. A run of equal ids is cut into pieces of at most PIECE
positions; phase 1 gives each piece to one program, which sums it in a fixed order. A run of
one piece is finished there; a longer run (a hot row of a power-law batch) leaves its pieces'
sums in a small buffer, and in phase 2 the program at the run's head adds them in order. There
is a program per sorted position (most return at once), so nothing is read back to the host. So hot
rows spread over many programs, and the result is bitwise the same every call, without atomics.
Rows no id touches keep what the output held (zeros for a dense gradient).
"""

from __future__ import annotations

import torch

from embfuse._triton import launch, next_pow2, tl, triton


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


class Runs:
    """The sorted batch, cut into runs and pieces (device tensors, made without a host read).

    src_row and scale come permuted into sorted order, so a program reads them contiguously.
    slot[j]: where the piece starting at sorted position j keeps its partial sum, if its run is
    long; n_slots bounds how many such pieces there can be."""

    def __init__(self, ids, src_row, scale, block_d: int):
        n = ids.numel()
        self.block_d = block_d
        self.block_k = chunk_rows(block_d)
        self.piece = piece = PIECE_CHUNKS * self.block_k
        self.sorted_ids, perm = torch.sort(ids.long(), stable=True)
        self.src_row = perm if src_row is None else src_row[perm].long()
        self.scale = None if scale is None else scale[perm].contiguous()
        pos = torch.arange(n, device=ids.device)
        head = torch.ones(n, dtype=torch.bool, device=ids.device)
        head[1:] = self.sorted_ids[1:] != self.sorted_ids[:-1]
        # Run bounds without a host read (so the backward also runs in CUDA graphs): number the
        # runs by a cumsum of the heads, scatter each head's position to its run's slot, read the
        # next slot for the end. (torch's cummax/cummin did this in 2.9 ms each for 1M ids on an
        # H100, 80% of that backward; listing only the busy programs, with host reads, gained
        # nothing measurable over a program per position.)
        run = head.long().cumsum(0) - 1
        first = torch.full((n + 1,), n, dtype=torch.long, device=ids.device)
        first.scatter_(0, torch.where(head, run, n), pos)  # non-heads all land in the spare slot n
        first[n] = n
        self.run_start, self.run_end = first[run], first[run + 1]
        long_piece = ((pos - self.run_start) % piece == 0) & (self.run_end - self.run_start > piece)
        self.slot = long_piece.long().cumsum(0) - 1
        self.n_slots = 2 * (n // piece) + 2  # a run longer than a piece has at most 2 x length / piece
        self.n = n


@triton.jit
def run_gradient(PHASE: tl.constexpr, sorted_ids, src_row, scale, run_start, run_end, slot, partial, src,
                 j, cols, cmask, stride_src, padding_idx, D,
                 HAS_SCALE: tl.constexpr, PIECE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """For program j: (row, fp32 gradient sum, run length, whether this program finishes the row).

    Phase 1: a piece head sums its piece; a one-piece run is finished, a longer one stores the
    piece sum at partial[slot[j]]. Phase 2: the head of a long run adds its pieces in order."""
    row = tl.load(sorted_ids + j)
    start = tl.load(run_start + j)
    end = tl.load(run_end + j)
    length = end - start
    real = (row >= 0) & (row != padding_idx)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    done = tl.zeros([], dtype=tl.int32)
    if PHASE == 1:
        if real & ((j - start) % PIECE == 0):
            stop = tl.minimum(j + PIECE, end)
            for k in range(j, stop, BLOCK_K):
                p = k + tl.arange(0, BLOCK_K)
                m = p < stop
                srow = tl.load(src_row + p, mask=m, other=0)
                g = tl.load(src + srow[:, None] * stride_src + cols[None, :], mask=m[:, None] & cmask[None, :],
                            other=0.0).to(tl.float32)
                if HAS_SCALE:
                    g = g * tl.load(scale + p, mask=m, other=0.0).to(tl.float32)[:, None]
                acc += tl.sum(g, axis=0)
            if length > PIECE:
                tl.store(partial + tl.load(slot + j) * D + cols, acc, mask=cmask)
            else:
                done = 1
    else:
        if real & (j == start) & (length > PIECE):
            first = tl.load(slot + j)
            for q in range(0, (length + PIECE - 1) // PIECE):
                acc += tl.load(partial + (first + q) * D + cols, mask=cmask, other=0.0)
            done = 1
    return row, acc, length, done


@triton.jit
def _segment_grad_kernel(
    sorted_ids, src_row, scale, run_start, run_end, slot, partial, src, grad, D, stride_src, stride_grad,
    padding_idx, PHASE: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_BY_FREQ: tl.constexpr,
    PIECE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    row, acc, length, done = run_gradient(PHASE, sorted_ids, src_row, scale, run_start, run_end, slot, partial,
                                          src, j, cols, cmask, stride_src, padding_idx, D,
                                          HAS_SCALE, PIECE, BLOCK_K, BLOCK_D)
    if done != 0:
        if SCALE_BY_FREQ:
            acc = acc / length.to(tl.float32)
        tl.store(grad + row * stride_grad + cols, acc.to(grad.dtype.element_ty), mask=cmask)


def launch_runs(kernel, runs: Runs, D: int, *args, **constexprs):
    """Both phases of a run reduction; `args` follow the kernel's shared leading arguments."""
    partial = torch.empty(runs.n_slots, D, dtype=torch.float32, device=runs.sorted_ids.device)
    for phase in (1, 2):
        launch(kernel)[(runs.n, triton.cdiv(D, runs.block_d))](
            runs.sorted_ids, runs.src_row, runs.scale if runs.scale is not None else partial, runs.run_start,
            runs.run_end, runs.slot, partial, *args, PHASE=phase, HAS_SCALE=runs.scale is not None,
            PIECE=runs.piece, BLOCK_K=runs.block_k, BLOCK_D=runs.block_d, **constexprs,
        )


PIECE_CHUNKS = 8  # a piece is 8 chunk-steps of one program


def chunk_rows(block_d: int) -> int:
    """Positions summed per step of a run: about 4096 elements a step, at most 64 rows."""
    return max(1, min(64, 4096 // block_d))


def segment_grad(ids, src, src_row, scale, num_rows, padding_idx, scale_by_freq, out_dtype):
    """Triton version of `segment_grad_reference` (same arguments); returns a dense gradient."""
    n, D = ids.numel(), src.shape[1]
    grad = torch.zeros(num_rows, D, dtype=out_dtype, device=src.device)
    if n == 0 or D == 0:
        return grad
    runs = Runs(ids, src_row, scale, block_d=min(next_pow2(D), 128))
    src = src.contiguous()
    launch_runs(_segment_grad_kernel, runs, D, src, grad, D, src.stride(0), grad.stride(0), padding_idx,
                SCALE_BY_FREQ=scale_by_freq)
    return grad
