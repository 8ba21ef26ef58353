"""The direct launcher (embfuse._triton): calls that Triton would compile differently (a
pointer off 16-byte alignment, an int equal to 1 or a multiple of 16) get their own kernel."""

import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse._triton import _direct
from embfuse.ops.embedding_bag import _embedding_bag_fwd_kernel
from .tolerances import assert_close


@pytest.mark.gpu
def test_direct_launches_respecialise_on_alignment_and_int_values():
    flat = torch.randn(20 * 1000 + 1, device="cuda")
    aligned, off_by_one = flat[:-1].view(1000, 20), flat[1:].view(1000, 20)
    ids = torch.randint(0, 1000, (37, 5), device="cuda")
    # a kernel reused for the wrong specialisation would pool the wrong rows (padding 1 is a
    # constexpr to Triton) or read misaligned vectors: each case comes after another one
    for weight, padding_idx in [(aligned, 17), (off_by_one, 17), (aligned, 1), (aligned, 16), (off_by_one, 1),
                                (aligned, 17)]:
        for _ in range(2):  # the second call takes the kept kernel
            out = embfuse.embedding_bag(ids, weight, mode="sum", padding_idx=padding_idx)
            ref = F.embedding_bag(ids.cpu(), weight.cpu().double(), mode="sum", padding_idx=padding_idx)
            assert_close(out, ref, torch.float32, reduction=5)
    assert _direct(_embedding_bag_fwd_kernel).compiled  # the calls took the direct path
