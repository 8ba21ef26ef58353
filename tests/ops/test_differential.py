"""Differential trials against torch: random calls of embfuse.embedding_bag and embfuse.embedding
with every mode and option, in float32 and float64, outputs and gradients against torch's on the
CPU (float64 to the tolerance table's 1e-12: a float32 step anywhere, such as a float32 mean
scale, fails it)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import embfuse
from tests.conftest import DEVICES
from tests.tolerances import assert_close


@st.composite
def bag_calls(draw):
    rows, D = draw(st.integers(1, 9)), draw(st.sampled_from([1, 3, 8]))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    ids = draw(st.lists(st.integers(0, rows - 1), min_size=sum(lengths), max_size=sum(lengths)))
    # 2-D input: every bag the same length (torch takes no 2-D input of zero columns)
    fixed = draw(st.booleans()) and len(set(lengths)) == 1 and lengths[0] > 0
    kw = dict(mode=mode, padding_idx=draw(st.one_of(st.none(), st.integers(-rows, rows - 1))),
              include_last_offset=not fixed and draw(st.booleans()))
    if mode != "max":
        kw["scale_grad_by_freq"] = draw(st.booleans())
        kw["sparse"] = draw(st.booleans())
        if mode == "sum" and draw(st.booleans()):
            kw["per_sample_weights"] = draw(st.lists(st.floats(-2, 2, allow_nan=False, width=32),
                                                     min_size=len(ids), max_size=len(ids)))
    return rows, D, lengths, ids, fixed, kw


def _pool_by_frequency(x, w, starts, psw, mode, padding_idx):
    """The oracle for scale_grad_by_freq: torch's documented scaling (each row's gradient over
    its count in the batch) as F.embedding applies it, then pooling. F.embedding_bag divides by
    the count of another id on the CPU (torch 2.13: ids [0, 0, 1] give row 1 half its gradient),
    and torch refuses it with sparse gradients; embfuse gives the documented one in every layout."""
    flat = x.reshape(-1)
    pad = -1 if padding_idx is None else padding_idx % w.shape[0]
    rows = F.embedding(flat, w, None if padding_idx is None else pad, scale_grad_by_freq=True)
    if psw is not None:
        rows = rows * psw.reshape(-1)[:, None]
    keep = (flat != pad)[:, None]
    lengths = torch.tensor(starts).diff()
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    out = torch.zeros(lengths.numel(), w.shape[1], dtype=w.dtype).index_add(0, bag, torch.where(keep, rows, 0))
    if mode == "mean":
        counts = torch.zeros(lengths.numel(), dtype=w.dtype).index_add(0, bag, keep[:, 0].to(w.dtype))
        out = out / counts.clamp(min=1)[:, None]
    return out


def _grad(w):
    return w.grad.to_dense() if w.grad.is_sparse else w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=60, deadline=None)
@given(call=bag_calls())
def test_embedding_bag_agrees_with_torch(device, dtype, call):
    rows, D, lengths, ids, fixed, kw = call
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    w0 = torch.randn(rows, D, dtype=dtype)
    ours_w, theirs_w = w0.to(device).clone().requires_grad_(), w0.clone().requires_grad_()
    x = torch.tensor(ids, dtype=torch.long)
    offsets = None if fixed else torch.tensor(starts if kw["include_last_offset"] else starts[:-1])
    if fixed:
        x = x.view(len(lengths), lengths[0])
    psw = kw.pop("per_sample_weights", None)
    theirs_psw = None if psw is None else torch.tensor(psw, dtype=dtype).view(x.shape).requires_grad_()
    ours_psw = None if psw is None else theirs_psw.detach().to(device).requires_grad_()
    if kw.get("scale_grad_by_freq"):
        theirs = _pool_by_frequency(x, theirs_w, starts, theirs_psw, kw["mode"], kw["padding_idx"])
    else:
        theirs = F.embedding_bag(x, theirs_w, offsets, per_sample_weights=theirs_psw, **kw)
    ours = embfuse.embedding_bag(x.to(device), ours_w, None if offsets is None else offsets.to(device),
                                 per_sample_weights=ours_psw, **kw)
    L = max(lengths)
    assert_close(ours, theirs, dtype, reduction=L)
    g = torch.randn_like(theirs)
    theirs.backward(g)
    ours.backward(g.to(device))
    assert_close(_grad(ours_w), _grad(theirs_w), dtype, reduction=len(ids) + 1)
    if psw is not None:
        assert_close(ours_psw.grad, theirs_psw.grad, dtype, reduction=D)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), D=st.sampled_from([1, 4]), shape=st.sampled_from([(5,), (2, 3), (0,)]),
       padding=st.one_of(st.none(), st.integers(-1, 0)), freq=st.booleans(), sparse=st.booleans(),
       data=st.data())
def test_embedding_agrees_with_torch(device, dtype, rows, D, shape, padding, freq, sparse, data):
    n = 1
    for s in shape:
        n *= s
    ids = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n)),
                       dtype=torch.long).view(shape)
    w0 = torch.randn(rows, D, dtype=dtype)
    ours_w, theirs_w = w0.to(device).clone().requires_grad_(), w0.clone().requires_grad_()
    theirs = F.embedding(ids, theirs_w, padding, scale_grad_by_freq=freq, sparse=sparse and not freq)
    ours = embfuse.embedding(ids.to(device), ours_w, padding, scale_grad_by_freq=freq, sparse=sparse)
    assert torch.equal(ours.cpu(), theirs)
    g = torch.randn_like(theirs)
    theirs.backward(g)
    ours.backward(g.to(device))
    assert_close(_grad(ours_w), _grad(theirs_w), dtype, reduction=n + 1)
