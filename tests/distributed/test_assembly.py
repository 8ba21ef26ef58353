"""SideBySide's column moves (the kernel, interpreted on the CPU in CI) against torch's slices."""

import pytest
import torch

from embfuse.distributed.assembly import SideBySide, gather_reference, move_columns, move_table, scatter_reference
from tests.conftest import KERNEL_DEVICE, requires_kernels

WIDTHS = [5, 0, 130, 3]  # a rank with nothing, one wider than a column block
# runs in output order: rank 2's columns split around rank 0's and rank 3's
MOVES = [(2, 100, 30, 0), (0, 0, 5, 30), (3, 0, 3, 35), (2, 0, 100, 38)]


@requires_kernels
@pytest.mark.parametrize("B", [1, 33])
def test_the_moves_kernel_matches_torch_both_ways(B):
    side = torch.randn(B * sum(WIDTHS), device=KERNEL_DEVICE)
    table = move_table(MOVES, WIDTHS, KERNEL_DEVICE)
    out = torch.empty(B, 138, device=KERNEL_DEVICE)
    move_columns(side, out, table, B, 100, to_out=True)
    assert torch.equal(out, gather_reference(side, B, WIDTHS, MOVES))
    grad = torch.randn(B, 138, device=KERNEL_DEVICE)
    back = torch.full_like(side, float("nan"))  # every element is written
    move_columns(back, grad, table, B, 100, to_out=False)
    assert torch.equal(back, scatter_reference(grad, B, WIDTHS, MOVES))


@requires_kernels
def test_the_moves_kernel_casts_as_it_stores():
    """Rows that crossed ranks in bf16 into an fp32 output, and the fp32 gradient back in bf16."""
    B = 9
    side = torch.randn(B * sum(WIDTHS), device=KERNEL_DEVICE).to(torch.bfloat16)
    table = move_table(MOVES, WIDTHS, KERNEL_DEVICE)
    out = torch.empty(B, 138, device=KERNEL_DEVICE)
    move_columns(side, out, table, B, 100, to_out=True)
    assert torch.equal(out, gather_reference(side, B, WIDTHS, MOVES).float())
    grad = torch.randn(B, 138, device=KERNEL_DEVICE)
    back = torch.empty_like(side)
    move_columns(back, grad, table, B, 100, to_out=False)
    # within one bf16 step of torch's rounding (the interpreter truncates; the GPU rounds to nearest)
    torch.testing.assert_close(back.float(), scatter_reference(grad.to(torch.bfloat16), B, WIDTHS, MOVES).float(),
                               rtol=2**-7, atol=0)


def test_side_by_side_is_the_gather_and_its_gradient_the_scatter():
    B = 4
    side = torch.randn(B * sum(WIDTHS), dtype=torch.float64, requires_grad=True)
    out = SideBySide.apply(side, B, WIDTHS, MOVES, move_table(MOVES, WIDTHS, "cpu"), side.dtype)
    blocks = torch.split(side.detach(), [B * w for w in WIDTHS])
    assert torch.equal(out[:, 30:35], blocks[0].view(B, 5))
    assert torch.equal(out[:, :30], blocks[2].view(B, 130)[:, 100:])
    torch.autograd.gradcheck(lambda s: SideBySide.apply(s, B, WIDTHS, MOVES, None, s.dtype), (side,))
