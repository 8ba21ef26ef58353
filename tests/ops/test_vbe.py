"""ops/vbe.py: a variable batch per feature padded to one stride, kernel against reference."""

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embfuse.ops.vbe import pad_kernels, pad_reference
from tests.conftest import KERNEL_DEVICE, requires_kernels


def test_the_reference_pads_each_feature_and_keeps_rows_inside_its_samples():
    lengths = torch.tensor([3, 1, 2, 5, 0, 4])  # feature 0: 2 samples, feature 1: 0, feature 2: 4
    meta = torch.tensor([2, 0, 4, 0, 2, 2, 1, 2, 0])  # strides, first entries, inverse rows
    inverse = torch.tensor([[0, 3, 1], [1, 0, 9], [5, -1, 0]])  # rows: f0 <- row 1, f1 <- row 2, f2 <- row 0
    padded, rows = pad_reference(lengths, inverse, meta, 3, 4)
    assert padded.tolist() == [3, 1, 0, 0, 0, 0, 0, 0, 2, 5, 0, 4]
    assert rows.tolist() == [[1, 0, 0], [0, 0, 3], [1, 0, 1]]  # (B, F): 9 -> 1, 5 and -1 -> 0, 3 kept


@requires_kernels
@settings(max_examples=30, deadline=None)
@given(data=st.data(), F=st.integers(1, 5), Bo=st.integers(1, 6), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_kernel_agrees_with_reference(data, F, Bo, dtype):
    strides = data.draw(st.lists(st.integers(0, 7), min_size=F, max_size=F))
    Bp = max(strides)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=sum(strides), max_size=sum(strides))),
                           dtype=dtype, device=KERNEL_DEVICE)
    order = data.draw(st.permutations(range(F)))
    firsts = list(itertools.accumulate(strides, initial=0))[:-1]
    meta = torch.tensor(strides + firsts + list(order), device=KERNEL_DEVICE)
    inverse = torch.tensor(data.draw(st.lists(st.integers(-2, 9), min_size=F * Bo, max_size=F * Bo)),
                           dtype=dtype, device=KERNEL_DEVICE).reshape(F, Bo)
    if data.draw(st.booleans()):  # (EmbeddingCollection and statistics pad without expanding)
        inverse = None
    got, want = pad_kernels(lengths, inverse, meta, F, Bp), pad_reference(lengths, inverse, meta, F, Bp)
    assert torch.equal(got[0], want[0]) and got[0].dtype == lengths.dtype
    assert got[1] is want[1] is None if inverse is None else torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows", [True, False])
def test_the_padding_is_an_op(rows):
    """What a traced lookup calls (dynamo traces no launch outside an op): schema, fake kernel."""
    lengths = torch.tensor([3, 1, 2, 5, 0, 4], device=KERNEL_DEVICE)
    meta = torch.tensor([2, 0, 4, 0, 2, 2, 1, 2, 0], device=KERNEL_DEVICE)
    inverse = torch.tensor([[0, 3, 1], [1, 0, 9], [5, -1, 0]], device=KERNEL_DEVICE) if rows else None
    torch.library.opcheck(torch.ops.embfuse.pad_variable_batch, (lengths, inverse, meta, 3, 4))
