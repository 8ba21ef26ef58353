"""A rank's output assembled from the owners' pooled rows when each output column has one source
(no row-wise partial sums): a permutation of column runs, done as one copy each way.

The owners' rows arrive one rank after another in one buffer, `side`: rank r's (B, widths[r])
block starts at element B * (widths[0] + ... + widths[r - 1]). A move is a run of columns:
(rank, its first column in that rank's rows, its width, its first output column); on the device
(move_table), (that sum, the first column, widths[r], the output column, the width). The moves
cover every column of every rank once, so neither direction needs a zero fill."""

from __future__ import annotations

import torch
from torch import Tensor

from embfuse._triton import cdiv, launch, next_pow2, tl, triton, use_kernels

BLOCK_B = 32  # rows a program


# (a batch's size is not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["B"])
def _move_columns_kernel(side, out, moves, B, total, TO_OUT: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    m = tl.program_id(1)
    before = tl.load(moves + m * 5).to(tl.int64)
    first = tl.load(moves + m * 5 + 1)
    stride = tl.load(moves + m * 5 + 2)
    col = tl.load(moves + m * 5 + 3)
    width = tl.load(moves + m * 5 + 4)
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None]
    side_at = side + before * B + first + rows * stride
    out_at = out + col + rows * total
    for d in range(0, width, BLOCK_D):
        c = d + tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < B) & (c < width)
        if TO_OUT:
            tl.store(out_at + c, tl.load(side_at + c, mask=mask).to(out.dtype.element_ty), mask=mask)
        else:
            tl.store(side_at + c, tl.load(out_at + c, mask=mask).to(side.dtype.element_ty), mask=mask)


def move_columns(side: Tensor, out: Tensor, moves: Tensor, B: int, widest: int, to_out: bool) -> None:
    """One launch: `side`'s runs into `out` (B, total), contiguous, or back (`to_out` False),
    cast to the destination's dtype. `moves`: (M, 5) int64 on the device (module docstring);
    `widest`: the widest run."""
    M = moves.shape[0]
    if B == 0 or M == 0:
        return
    launch(_move_columns_kernel)[(cdiv(B, BLOCK_B), M)](
        side, out, moves, B, out.shape[1], TO_OUT=to_out, BLOCK_B=BLOCK_B, BLOCK_D=min(128, next_pow2(widest)))


def move_table(moves: list[tuple], widths: list[int], device) -> Tensor:
    """The device form of `moves` [(rank, first column in its rows, width, output column)]."""
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    return torch.tensor([(starts[r], a, widths[r], o, w) for r, a, w, o in moves], dtype=torch.int64,
                        device=device)


def _blocks(side: Tensor, B: int, widths: list[int]) -> list[Tensor]:
    return [b.view(B, w) for b, w in zip(torch.split(side, [B * w for w in widths]), widths)]


def gather_reference(side: Tensor, B: int, widths: list[int], moves: list[tuple]) -> Tensor:
    blocks = _blocks(side, B, widths)
    return torch.cat([blocks[r][:, a:a + w] for r, a, w, _ in moves], dim=1)


def scatter_reference(grad: Tensor, B: int, widths: list[int], moves: list[tuple]) -> Tensor:
    side = grad.new_empty(B * sum(widths))
    for r, block in enumerate(_blocks(side, B, widths)):
        mine = sorted((a, w, o) for rank, a, w, o in moves if rank == r)
        if mine:
            torch.cat([grad[:, o:o + w] for _, w, o in mine], dim=1, out=block)
    return side


class SideBySide(torch.autograd.Function):
    """`side` (the owners' rows, module docstring) -> the (B, total) output in `dtype`; backward
    the same moves the other way, the gradient in side's dtype (the kernel casts as it stores).
    `moves`: [(rank, first column in its rows, width, output column)] in output order;
    `moves_t`: move_table's device form of them."""

    @staticmethod
    def forward(ctx, side, B, widths, moves, moves_t, dtype):
        ctx.B, ctx.widths, ctx.moves, ctx.moves_t, ctx.side_dtype = B, widths, moves, moves_t, side.dtype
        if not use_kernels(side):
            return gather_reference(side, B, widths, moves).to(dtype)
        out = side.new_empty(B, sum(w for _, _, w, _ in moves), dtype=dtype)
        move_columns(side, out, moves_t, B, max(w for _, _, w, _ in moves), to_out=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        B, widths, moves = ctx.B, ctx.widths, ctx.moves
        if not use_kernels(grad):
            return scatter_reference(grad.to(ctx.side_dtype), B, widths, moves), None, None, None, None, None
        grad = grad.contiguous()
        side = grad.new_empty(B * sum(widths), dtype=ctx.side_dtype)
        move_columns(side, grad, ctx.moves_t, B, max(w for _, _, w, _ in moves), to_out=False)
        return side, None, None, None, None, None
