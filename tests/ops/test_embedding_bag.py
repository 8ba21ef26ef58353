import sys

import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse.ops.bags import MAX, MEAN, SQRTN, SUM, WMEAN, backward_inputs_reference, single_meta
from embfuse.ops.embedding_bag import (
    embedding_bag_backward, embedding_bag_backward_reference, embedding_bag_forward, embedding_bag_reference,
    table_backward_inputs,
)
from embfuse.ops import tuning
from embfuse.ops.validate import validate_bags

eb = sys.modules["embfuse.ops.embedding_bag"]  # (the module: embfuse.ops.embedding_bag is also a function)
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels
from tests.tolerances import assert_close, random_bags

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_LEN = 6


def _case(D, dtype, index_dtype, weighted, device=KERNEL_DEVICE, num_bags=7, N=40):
    weight = torch.randn(N, D).to(device, dtype)
    ids, offsets = random_bags(num_bags, MAX_LEN, N, device, index_dtype)
    psw = torch.rand(ids.numel(), device=device) + 0.5 if weighted else None
    return weight, ids, offsets, psw


@requires_kernels
@pytest.mark.parametrize("D", [3, 64, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,weighted", [(SUM, False), (MEAN, False), (SQRTN, True), (WMEAN, True), (MAX, False)])
def test_few_long_bags_pool_over_four_warps(D, dtype, mode, weighted, pooling_warps):
    """A launch of few bags of many ids takes the spread shape (tuning.spreads: 512 elements, four
    warps) outside max pooling on fp32 tables and on 2-byte ones of rows of 256 bytes or more, the
    one-warp shape otherwise; its results match the float64 reference as the usual shape's do."""
    lengths = torch.tensor([90, 0, 1, 130, 64, 70])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(KERNEL_DEVICE)
    n, B = int(lengths.sum()), lengths.numel()
    assert tuning.pooling_shape(D, n, 4096)["num_warps"] == 1  # many bags keep one warp
    for size, folded, most in ((4, False, 1024), (4, True, 512), (2, False, 1024), (2, True, 512)):
        assert tuning.pooling_shape(128, most * 64, most, element_size=size, folded=folded)["num_warps"] == 4
        assert tuning.pooling_shape(128, most * 128, most * 2, element_size=size, folded=folded)["num_warps"] == 1
    pooling_warps.clear()
    weight = torch.randn(300, D).to(KERNEL_DEVICE, dtype)
    ids = torch.randint(0, 300, (n,), device=KERNEL_DEVICE)
    psw = torch.rand(n, device=KERNEL_DEVICE) + 0.5 if weighted else None
    out, max_ids = embedding_bag_forward(weight, ids, offsets, psw, mode, -1)
    assert pooling_warps == [4 if mode != MAX and (dtype == torch.float32 or D * 2 >= 256) else 1]
    ref, ref_ids = embedding_bag_reference(weight.double(), ids, offsets, None if psw is None else psw.double(), mode,
                                           -1)
    assert_close(out, ref, dtype, reduction=130)
    if mode == MAX and dtype == torch.float32:
        assert torch.equal(max_ids, ref_ids)


@requires_kernels
@pytest.mark.parametrize("folded", [False, True])
def test_a_folded_check_spreads_fewer_bags(folded, pooling_warps, monkeypatch):
    """A launch spreads fewer bags when the batch's check is folded into it
    (tuning.FOLDED_BAGS). With that bound lowered below this launch's 6 bags (of a bf16
    table), the folded launch keeps one warp and the other spreads; both pool what the
    reference pools."""
    monkeypatch.setattr(tuning, "FOLDED_BAGS", 4)
    lengths = torch.tensor([90, 0, 1, 130, 64, 70])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(KERNEL_DEVICE)
    weight = torch.randn(300, 129).to(KERNEL_DEVICE, torch.bfloat16)
    ids = torch.randint(0, 300, (int(lengths.sum()),), device=KERNEL_DEVICE)
    *_, check = validate_bags(ids, offsets, 300, None, kernel=True, fresh=False, fold=folded)
    assert (check.pending is not None) == folded
    out, _ = embedding_bag_forward(weight, ids, offsets, None, SUM, -1, check=check)
    assert pooling_warps == [1 if folded else 4]
    embfuse.check_errors()
    assert_close(out, embedding_bag_reference(weight.double(), ids, offsets, None, SUM, -1)[0], torch.bfloat16,
                 reduction=130)


@requires_kernels
@pytest.mark.parametrize("D", [1, 3, 64, 129])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mode,weighted", [(SUM, False), (SUM, True), (MEAN, False), (MAX, False), (SQRTN, False),
                                           (SQRTN, True), (WMEAN, True)])
@pytest.mark.parametrize("padding_idx", [-1, 5])
def test_kernel_matches_float64_reference(D, dtype, index_dtype, mode, weighted, padding_idx):
    weight, ids, offsets, psw = _case(D, dtype, index_dtype, weighted)
    ids[::3] = 5  # padding and duplicates in most bags
    poison = torch.full((offsets.numel() - 1, D), float("nan"), dtype=dtype, device=weight.device)
    out, max_ids = embedding_bag_forward(weight, ids, offsets, psw, mode, padding_idx, out=poison)
    assert out is poison  # every element was written: none is left NaN (checked below)
    psw64 = psw.double() if psw is not None else None
    ref, ref_ids = embedding_bag_reference(weight.double(), ids, offsets, psw64, mode, padding_idx)
    assert not out.isnan().any()
    assert_close(out, ref, dtype, reduction=MAX_LEN)
    if mode == MAX:
        # where values tie (low precision) ids may differ; the chosen row must hold the max
        cols = torch.arange(D, device=weight.device)
        picked = torch.where(max_ids >= 0, weight.double()[max_ids.clamp(min=0), cols], 0)
        assert_close(picked, ref, dtype)
        assert ((max_ids < 0) == (ref_ids < 0)).all()
        if dtype == torch.float32:
            assert torch.equal(max_ids, ref_ids)


@requires_kernels
@pytest.mark.parametrize("mode", [SUM, MAX])
@pytest.mark.parametrize("wide", ["weight", "out"])
def test_rows_strided_wider_than_the_pooled_width(mode, wide):
    """A table or an output whose rows lie further apart than D (a column slice): the pooling
    addresses them by their strides, also where D is a whole column block (tuning.bag_shape)."""
    weight, ids, offsets, _ = _case(16, torch.float32, torch.int64, False)
    if wide == "weight":
        weight = torch.cat([weight, torch.randn_like(weight)], 1)[:, :16]
    buf = torch.full((offsets.numel() - 1, 24), float("nan"), device=weight.device)
    out, _ = embedding_bag_forward(weight, ids, offsets, None, mode, -1, out=buf[:, :16] if wide == "out" else None)
    assert_close(out, embedding_bag_reference(weight.double(), ids, offsets, None, mode, -1)[0], torch.float32,
                 reduction=MAX_LEN)
    if wide == "out":
        assert buf[:, 16:].isnan().all()


@requires_kernels
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_lookup_without_gradients_hands_torchs_offsets_to_the_kernel(mode, monkeypatch):
    """The public call without gradients: the kernel takes torch's offsets as given, B starts or
    B + 1 with include_last_offset (the kernel path forced onto the interpreter here; on a GPU it
    is the default path); a lookup with gradients keeps the canonical B + 1; a bad last start or
    end still raises."""
    seen, forward = [], eb.embedding_bag_forward
    monkeypatch.setattr(eb, "pools_with_kernels", lambda w: True)
    monkeypatch.setattr(eb, "embedding_bag_forward", lambda *a, **k: seen.append(k["open_end"]) or forward(*a, **k))
    w = torch.randn(40, 8, device=KERNEL_DEVICE)
    ids, offsets = random_bags(7, MAX_LEN, 40, KERNEL_DEVICE)
    short = offsets.clone()
    short[-1] = offsets[-2]  # the last bag runs to the end of the ids all the same (see the test below)
    with torch.no_grad():
        for given, last in ((offsets[:-1], False), (offsets, True)):
            out = embfuse.embedding_bag(ids, w, given, mode=mode, include_last_offset=last)
            ref = F.embedding_bag(ids, w, given, mode=mode, include_last_offset=last)
            assert_close(out, ref, torch.float32, reduction=MAX_LEN)
        assert torch.equal(embfuse.embedding_bag(ids, w, short, mode=mode, include_last_offset=True), out)
        assert seen == ["starts", "last", "last"]
        past = ids.numel() + 1
        for given, last, position in ((offsets[:-1].clone(), False, 6), (offsets.clone(), True, 7)):
            given[-1] = past
            with pytest.raises(embfuse.BadBatchError, match=f"offsets\\[{position}\\] = {past} runs past the end"):
                embfuse.embedding_bag(ids, w, given, mode=mode, include_last_offset=last)  # (CPU: here; GPU: below)
                embfuse.check_errors()


@requires_kernels
def test_one_offset_under_include_last_offset_on_the_kernel_path(monkeypatch):
    """As test_include_last_offset_with_one_offset_is_no_bag, on the path that hands torch's
    offsets to the kernel as given (forced onto the interpreter here): no bag, and the check
    finds nothing wrong, since there is no last offset to read as the id count. Without
    include_last_offset the one offset is one bag's start, handed over as given."""
    monkeypatch.setattr(eb, "pools_with_kernels", lambda w: True)
    w = torch.randn(10, 4, device=KERNEL_DEVICE)
    ids, one = torch.tensor([1, 2, 3], device=KERNEL_DEVICE), torch.tensor([0], device=KERNEL_DEVICE)
    with torch.no_grad():
        assert embfuse.embedding_bag(ids, w, one, include_last_offset=True).shape == (0, 4)
        torch.testing.assert_close(embfuse.embedding_bag(ids, w, one, mode="sum"), w[1:4].sum(0, keepdim=True))
    embfuse.check_errors()


@requires_kernels
@pytest.mark.parametrize("mode,weighted", [(SUM, True), (MEAN, False), (MAX, False)])
@pytest.mark.parametrize("form", ["starts", "last"])
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_kernel_takes_torchs_offsets_as_given(mode, weighted, form, folded, bad):
    """open_end: torch's offsets as given, the last bag running to the last id, pool as the B + 1
    canonical offsets do, with the check in its own launch or folded in: "starts", the B bag
    starts of its default form; "last", include_last_offset's B + 1 whose last may say less than
    the id count (read as the id count) but not more. A last offset past the ids pools nothing
    and is reported with the caller's position."""
    weight, ids, offsets, psw = _case(8, torch.float32, torch.int64, weighted)
    given = offsets[:-1].clone() if form == "starts" else offsets.clone()
    if form == "last":
        given[-1] = offsets[-2] - 1  # less than the last start, even: torch ends the last bag at the ids' end
    if bad:
        given[-1] = ids.numel() + 1
    *_, check = validate_bags(ids, given, weight.shape[0], psw, fresh=False, fold=folded, kernel=True,
                              clamp_last=form == "last")
    assert (check.pending is not None) == folded
    out, _ = embedding_bag_forward(weight, ids, given, psw, mode, -1, check=check, open_end=form)
    assert out.shape == (offsets.numel() - 1, 8)
    if bad:
        assert torch.equal(out, torch.zeros_like(out))
        with pytest.raises(embfuse.BadBatchError, match=f"offsets\\[{given.numel() - 1}\\] = {ids.numel() + 1} "
                                                          f"runs past the end of the input \\({ids.numel()} ids\\)"):
            embfuse.check_errors()
        return
    embfuse.check_errors()
    ref, _ = embedding_bag_reference(weight.double(), ids, offsets, psw.double() if weighted else None, mode, -1)
    assert_close(out, ref, torch.float32, reduction=MAX_LEN)


@requires_kernels
@pytest.mark.parametrize("D", [1, 3, 64, 129])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,weighted,freq", [(SUM, False, False), (SUM, True, False), (SUM, False, True),
                                                (MEAN, False, False), (MEAN, False, True), (MAX, False, False),
                                                (SQRTN, False, False), (SQRTN, True, False), (WMEAN, True, False)])
@pytest.mark.parametrize("padding_idx", [-1, 5])
def test_backward_kernel_matches_float64_reference(D, dtype, mode, weighted, freq, padding_idx):
    N = 40
    weight, ids, offsets, psw = _case(D, dtype, torch.int64, weighted, N=N)
    ids[::2] = 5  # a hot row
    _, max_ids = embedding_bag_forward(weight, ids, offsets, psw, mode, padding_idx)
    grad = torch.randn(offsets.numel() - 1, D, device=weight.device).to(dtype)
    got = embedding_bag_backward(grad, ids, offsets, psw, max_ids, N, mode, padding_idx, freq)
    psw64 = psw.double() if psw is not None else None
    ref = embedding_bag_backward_reference(grad.double(), ids, offsets, psw64, max_ids, N, mode, padding_idx, freq)
    assert got.dtype == dtype
    assert_close(got, ref, dtype, reduction=ids.numel())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", ["sqrtn", "wmean"])
def test_tensorflows_combiners(device, weighted, mode):
    """mode="sqrtn" and "wmean" against TensorFlow's definitions written out bag by bag in
    float64: the weighted sum over sqrt(sum of squared weights) / over the sum of weights (over
    sqrt(count) / count unweighted), padding left out, an empty bag, a bag whose weights sum to 0
    and a bag of one weight 0 give zeros (div_no_nan); gradients through autograd too."""
    weight = torch.randn(9, 5, dtype=torch.float64, device=device, requires_grad=True)
    ids = torch.tensor([1, 2, 3, 4, 4, 0, 8, 7, 4, 6, 5], device=device)
    offsets = torch.tensor([0, 3, 3, 7, 8, 9], device=device)  # bag 1 empty; id 4 is padding, bag 4 only that
    psw = None
    if weighted:
        psw = torch.rand(11, dtype=torch.float64, device=device) + 0.1
        psw[7] = 0.0  # bag 3 holds one id of weight 0: its sums are 0
        psw[10] = -psw[9]  # bag 5's weights sum to 0 (not their squares)
        psw.requires_grad_()
    out = embfuse.embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=psw, padding_idx=4)
    bounds = offsets.tolist() + [ids.numel()]
    want = []
    for b in range(offsets.numel()):
        rows, ws = [], []
        for p in range(bounds[b], bounds[b + 1]):
            if int(ids[p]) != 4:
                rows.append(weight[ids[p]])
                ws.append(psw[p] if weighted else torch.tensor(1.0, dtype=torch.float64, device=device))
        total = sum((w * r for w, r in zip(ws, rows)), torch.zeros(5, dtype=torch.float64, device=device))
        zero = torch.tensor(0.0, dtype=torch.float64, device=device)
        norm = (torch.sqrt(sum(w * w for w in ws)) if mode == "sqrtn" else sum(ws)) if ws else zero
        want.append(total / norm if norm != 0 else total * 0)
    want = torch.stack(want)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    inputs = (weight, psw) if weighted else (weight,)
    for got, expect in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)


@requires_kernels
def test_backward_is_bitwise_deterministic():
    N, D = 16, 64
    weight, ids, offsets, _ = _case(D, torch.float32, torch.int64, False, num_bags=64, N=N)
    grad = torch.randn(offsets.numel() - 1, D, device=weight.device)
    runs = [embedding_bag_backward(grad, ids, offsets, None, None, N, SUM, -1, False) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def _torch_and_ours(device, dtype=torch.float32, **kw):
    N, D = 30, 9
    base = torch.randn(N, D, dtype=torch.float64).to(dtype)
    w_t = base.clone().to(device).requires_grad_()
    w_e = base.clone().to(device).requires_grad_()
    return w_t, w_e


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("form", ["offsets", "last_offset", "2d"])
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_functional_matches_torch(device, mode, form, padding_idx):
    w_t, w_e = _torch_and_ours(device)
    N = w_t.shape[0]
    if form == "2d":
        x, offsets, last = torch.randint(0, N, (6, 4), device=device), None, False
    else:
        x, offsets = random_bags(6, 5, N, device)
        last = form == "last_offset"
        offsets = offsets if last else offsets[:-1]
    x.view(-1)[::3] = padding_idx % N if padding_idx is not None else 0
    kw = dict(mode=mode, padding_idx=padding_idx, include_last_offset=last)
    ref = F.embedding_bag(x, w_t, offsets, **kw)
    out = embfuse.embedding_bag(x, w_e, offsets, **kw)
    assert_close(out, ref, torch.float32, reduction=5)
    with torch.no_grad():  # (a lookup without gradients: on a GPU, torch's offsets go to the kernel as given)
        assert_close(embfuse.embedding_bag(x, w_e, offsets, **kw), ref, torch.float32, reduction=5)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert_close(w_e.grad, w_t.grad, torch.float32, reduction=x.numel())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,weighted", [("sum", True), ("mean", False), ("max", False)])
@pytest.mark.parametrize("form", ["2d", "starts", "last"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_ids_narrowed_by_the_check_pool_as_given(device, mode, weighted, form, max_norm, monkeypatch):
    """A large batch's int64 ids reach a lookup without gradient as the int32 its check wrote
    (tuning.narrows; here every batch): bitwise the output of the ids as given ("off"); a bad
    batch still pools nothing, changes nothing and raises its error."""
    monkeypatch.setattr(tuning, "NARROW_IDS", -1)
    monkeypatch.setattr(tuning, "NARROW_DIM", 0)
    w, _ = _torch_and_ours(device)
    w = w.detach()
    if form == "2d":
        x, offsets = torch.randint(0, w.shape[0], (6, 4), device=device), None
    else:
        x, offsets = random_bags(8, 6, w.shape[0], device)
        offsets = offsets[:-1] if form == "starts" else offsets
    psw = torch.rand(x.shape, device=device) + 0.5 if weighted else None
    kw = dict(mode=mode, per_sample_weights=psw, max_norm=max_norm, include_last_offset=form == "last")
    with torch.no_grad():
        want, got = (embfuse.embedding_bag(x, w.clone(), offsets, bounds_check=b, **kw) for b in ("off", "deferred"))
        embfuse.check_errors()
        assert torch.equal(got, want)
        bad = x.clone()
        bad.view(-1)[5] = w.shape[0]
        before = w.clone()
        with pytest.raises(IndexError, match=f"\\[.*\\] = {w.shape[0]} is out of range"):
            out = embfuse.embedding_bag(bad, w, offsets, **kw)
            assert torch.equal(out, torch.zeros_like(out))
            embfuse.check_errors()
        assert torch.equal(w, before)


def _pool_via_embedding(x, w, offsets, mode, freq):
    """torch oracle for scale_grad_by_freq: F.embedding's (correct) scaling, then pooling.
    F.embedding_bag itself scales every row by the count of the wrong id on the CPU (torch 2.13)."""
    rows = F.embedding(x, w, scale_grad_by_freq=freq)
    bag = torch.searchsorted(offsets, torch.arange(x.numel(), device=x.device), right=True) - 1
    out = torch.zeros(offsets.numel() - 1, w.shape[1], device=w.device).index_add(0, bag, rows)
    return out / offsets.diff().clamp(min=1)[:, None] if mode == "mean" else out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("sparse,freq", [(True, False), (False, True), (True, True)])
def test_sparse_and_freq_gradients_match_torch(device, mode, sparse, freq):
    w_t, w_e = _torch_and_ours(device)
    x, offsets = random_bags(8, 6, w_t.shape[0], device)
    x[::2] = 3
    if freq:
        ref = _pool_via_embedding(x, w_t, offsets, mode, freq)
    else:
        ref = F.embedding_bag(x, w_t, offsets[:-1], mode=mode, sparse=sparse)
    out = embfuse.embedding_bag(x, w_e, offsets[:-1], mode=mode, sparse=sparse, scale_grad_by_freq=freq)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert w_e.grad.is_sparse == sparse
    assert_close(w_e.grad.to_dense(), w_t.grad.to_dense(), torch.float32, reduction=x.numel())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,weighted,freq", [("sum", False, False), ("mean", False, False), ("sum", True, False),
                                                ("sum", False, True), ("mean", False, True)])
def test_rowwise_sparse_gradient_is_torchs_gradient_at_the_touched_rows(device, mode, weighted, freq):
    """sparse="rowwise": a coalesced COO gradient, one entry per distinct non-padding row."""
    w_t, w_e = _torch_and_ours(device)
    x, offsets = random_bags(8, 6, w_t.shape[0], device)
    x[::2] = 3
    psw = torch.rand(x.numel(), device=device) + 0.5 if weighted else None
    if freq:
        ref = _pool_via_embedding(x, w_t, offsets, mode, freq)
    else:
        ref = F.embedding_bag(x, w_t, offsets[:-1], mode=mode, per_sample_weights=psw, padding_idx=1)
    out = embfuse.embedding_bag(x, w_e, offsets[:-1], mode=mode, sparse="rowwise", scale_grad_by_freq=freq,
                                per_sample_weights=psw, padding_idx=None if freq else 1)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    grad = w_e.grad
    assert grad.is_sparse  # (autograd drops the coalesced flag when it stores .grad)
    touched = x.unique() if freq else x[x != 1].unique()
    assert torch.equal(grad._indices()[0], touched)
    assert_close(grad._values(), w_t.grad[touched], torch.float32, reduction=x.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_weights_gradient_matches_torch(device):
    w_t, w_e = _torch_and_ours(device)
    x, offsets = random_bags(8, 6, w_t.shape[0], device)
    p_t = (torch.rand(x.numel(), device=device) + 0.5).requires_grad_()
    p_e = p_t.detach().clone().requires_grad_()
    ref = F.embedding_bag(x, w_t, offsets[:-1], mode="sum", per_sample_weights=p_t, padding_idx=1)
    out = embfuse.embedding_bag(x, w_e, offsets[:-1], mode="sum", per_sample_weights=p_e, padding_idx=1)
    assert_close(out, ref, torch.float32, reduction=6)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert_close(w_e.grad, w_t.grad, torch.float32, reduction=x.numel())
    assert_close(p_e.grad, p_t.grad, torch.float32, reduction=w_t.shape[1])


@pytest.mark.parametrize("device", DEVICES)
def test_max_norm_renormalises_rows_like_torch(device):
    w_t, w_e = _torch_and_ours(device)
    x, offsets = random_bags(5, 4, w_t.shape[0], device)
    with torch.no_grad():
        w_t.mul_(3)
        w_e.mul_(3)
    ref = F.embedding_bag(x, w_t, offsets[:-1], mode="sum", max_norm=1.0)
    out = embfuse.embedding_bag(x, w_e, offsets[:-1], mode="sum", max_norm=1.0)
    assert_close(out, ref, torch.float32, reduction=4)
    assert_close(w_e.detach(), w_t.detach(), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_empty_shapes(device, mode):
    w = torch.randn(10, 4, device=device, requires_grad=True)
    ids = torch.tensor([], dtype=torch.long, device=device)
    out = embfuse.embedding_bag(ids, w, torch.tensor([], dtype=torch.long, device=device), mode=mode)
    assert out.shape == (0, 4)
    out = embfuse.embedding_bag(ids, w, torch.tensor([0, 0, 0], device=device), mode=mode)
    assert torch.equal(out, torch.zeros(3, 4, device=device))
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert embfuse.embedding_bag(torch.zeros(0, 3, dtype=torch.long, device=device), w, mode=mode).shape == (0, 4)
    assert torch.equal(embfuse.embedding_bag(torch.zeros(2, 0, dtype=torch.long, device=device), w, mode=mode),
                       torch.zeros(2, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [SUM, MEAN, MAX])
def test_opcheck(device, mode):
    w = torch.randn(20, 8, device=device, requires_grad=True)
    ids, offsets = random_bags(5, 4, 20, device)
    psw = torch.rand(ids.numel(), device=device, requires_grad=True) if mode == SUM else None
    status = torch.zeros(2, dtype=torch.int32, device=device)  # a deferred check's, passed
    torch.library.opcheck(torch.ops.embfuse.embedding_bag.default,
                          (w, ids, offsets, psw, status, mode, 2, False, False))
    g = torch.randn(5, 8, device=device)
    max_ids = embedding_bag_reference(w, ids, offsets, psw, mode, 2)[1]
    torch.library.opcheck(torch.ops.embfuse.embedding_bag_backward.default,
                          (g, ids, offsets, psw.detach() if psw is not None else None, status, max_ids.detach(), 20,
                           mode, 2, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_compile_fullgraph(device, mode):
    torch._dynamo.reset()
    w = torch.randn(30, 16, device=device, requires_grad=True)
    x = torch.randint(0, 30, (8, 5), device=device)

    def f(x, w):
        return embfuse.embedding_bag(x, w, mode=mode).tanh().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, w)
    (g,) = torch.autograd.grad(loss, w)
    w2 = w.detach().clone().requires_grad_()
    ref = F.embedding_bag(x, w2, mode=mode).tanh().sum()
    ref.backward()
    assert_close(loss, ref, torch.float32, reduction=40)
    assert_close(g, w2.grad, torch.float32, reduction=40)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,weighted,dtype", [("sum", True, torch.float32), ("sum", False, torch.bfloat16),
                                                 ("mean", False, torch.bfloat16), ("sqrtn", False, torch.float32),
                                                 ("wmean", True, torch.float32)])
def test_a_compiled_lookup_of_one_bag_from_one_element(device, mode, weighted, dtype):
    """One bag of a (1, 1) table, a loss taken in the graph: each sum over bags or rows has one
    element. Inductor's CPU code fails to compile a scatter-add into one element
    (pytorch/pytorch#160391), so the references sum into a spare row (bags.index_sum); this
    failed to compile on the CPU before that. (Caches off: a compiled graph found in Inductor's
    cache is not compiled again.)"""
    torch._dynamo.reset()
    w0, psw0 = torch.rand(1, 1, dtype=torch.float64) + 0.5, torch.rand(3, dtype=torch.float64) + 0.5
    ids, offsets = torch.zeros(3, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device)

    def f(w, psw):
        return embfuse.embedding_bag(ids, w, offsets, mode=mode, per_sample_weights=psw).sum()

    results = []
    for fn, dt in ((torch.compile(f, fullgraph=True), dtype), (f, torch.float64)):
        w = w0.to(device, dt).requires_grad_()
        psw = psw0.to(device, dt).requires_grad_() if weighted else None
        with torch._inductor.config.patch(force_disable_caches=True):
            out = fn(w, psw)
            results.append([out, *torch.autograd.grad(out, [w] + ([psw] if weighted else []))])
    for got, want in zip(*results, strict=True):
        assert_close(got, want, dtype, reduction=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_compiled_backward_of_hot_ids_at_two_batch_sizes(device, mode):
    """Thousands of ids on 3 wide rows: the gradient's segment reduction (ops/segments.py) runs
    several upper levels in one launch that reads what it wrote, which a traced launch got
    wrong while it passed one buffer as two arguments (session 42: wrong gradients, illegal
    accesses); the second batch size recompiles with dynamic shapes."""
    torch._dynamo.reset()
    w0 = torch.randn(3, 130, device=device)

    def f(x, w):
        return embfuse.embedding_bag(x, w, mode=mode).tanh()

    compiled = torch.compile(f, fullgraph=True)
    for B in (60, 37):
        x = torch.randint(0, 3, (B, 50), device=device)
        g = torch.randn(B, 130, device=device)
        grads = []
        for fn in (f, compiled):
            w = w0.clone().requires_grad_()
            grads.append(torch.autograd.grad(fn(x, w), [w], g)[0])
        ref = w0.double().requires_grad_()
        (expected,) = torch.autograd.grad(F.embedding_bag(x, ref, mode=mode).tanh(), [ref], g.double())
        assert_close(grads[0], expected, torch.float32, reduction=B * 50)
        assert_close(grads[1], expected, torch.float32, reduction=B * 50)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [True, "rowwise"])
def test_compiled_sparse_gradient_is_torchs(device, sparse):
    """The sparse gradients under torch.compile, mean bags with padding, at two batch sizes
    (the second with dynamic shapes), as torch's float64 gradient. On the GPU the row-wise
    gradient did not compile until session 44 (benchmarks/NOTES.md)."""
    torch._dynamo.reset()
    w0 = torch.randn(30, 8, device=device)
    f = torch.compile(lambda x, w: embfuse.embedding_bag(x, w, mode="mean", padding_idx=2, sparse=sparse).tanh(),
                      fullgraph=True)
    for B in (6, 9):
        x = torch.randint(0, 30, (B, 5), device=device)
        x[0] = 2  # a bag of padding only
        w = w0.clone().requires_grad_()
        out = f(x, w)
        g = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, [w], g)
        ref = w0.double().requires_grad_()
        (want,) = torch.autograd.grad(F.embedding_bag(x, ref, mode="mean", padding_idx=2).tanh(), [ref], g.double())
        assert got.is_sparse
        assert_close(got.to_dense(), want, torch.float32, reduction=5)


@pytest.mark.gpu
def test_cuda_graph_capture():
    w = torch.randn(1000, 64, device="cuda")
    x = torch.randint(0, 1000, (256, 20), device="cuda")
    embfuse.embedding_bag(x, w, mode="sum")  # warm up: compile the kernel outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embfuse.embedding_bag(x, w, mode="sum")
    x.copy_(torch.randint(0, 1000, (256, 20), device="cuda"))
    graph.replay()
    assert_close(out, F.embedding_bag(x, w, mode="sum"), torch.float32, reduction=20)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_cuda_graph_capture_of_a_recorded_forward_and_backward(mode):
    """Forward + backward into a dense `.grad`, recorded (the eager autograd path) and captured in
    one CUDA graph: nothing reads the host, and a replay on new ids gives torch's gradient."""
    w = torch.randn(1000, 64, device="cuda", requires_grad=True)
    x = torch.randint(0, 1000, (256, 20), device="cuda")
    g = torch.randn(256, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's CUDA-graph notes do
        for _ in range(2):
            w.grad = None
            embfuse.embedding_bag(x, w, mode=mode).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embfuse.embedding_bag(x, w, mode=mode)
        out.backward(g)
    x.copy_(torch.randint(0, 1000, (256, 20), device="cuda"))
    graph.replay()
    ref = w.detach().clone().requires_grad_()
    want = F.embedding_bag(x, ref, mode=mode)
    want.backward(g)
    assert_close(out, want, torch.float32, reduction=20)
    assert_close(w.grad, ref.grad, torch.float32, reduction=20)
    embfuse.check_errors()


@pytest.mark.gpu
def test_large_table_int64_addressing():
    # 2^31 + rows of 2 bf16 elements: ids past 2^30 address beyond int32 element offsets
    N, D = (1 << 30) + 16, 2
    w = torch.empty(N, D, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([N - 1, N - 2, 3], device="cuda")
    w[ids] = torch.randn(3, D, device="cuda").to(torch.bfloat16)
    out = embfuse.embedding_bag(ids, w, torch.tensor([0, 2], device="cuda"), mode="sum")
    ref = torch.stack([w[N - 1].float() + w[N - 2].float(), w[3].float()])
    assert_close(out, ref, torch.bfloat16, reduction=2)


@requires_kernels
@pytest.mark.parametrize("mode,weighted", [(SUM, False), (SUM, True), (MEAN, False), (SQRTN, False),
                                           (SQRTN, True), (WMEAN, False), (WMEAN, True)])
@pytest.mark.parametrize("padding_idx", [-1, 3])
@pytest.mark.parametrize("num_weights", [6, 2**31])
def test_backward_inputs_kernel_matches_torch(mode, padding_idx, weighted, num_weights):
    """Per-position ids, bags and scales of the backward: empty bags, padding (not counted by
    mean, sqrtn or wmean), weighted sqrtn and wmean (their weights' terms summed per bag)."""
    indices = torch.randint(0, 6, (140,), device=KERNEL_DEVICE)
    offsets = torch.tensor([0, 0, 7, 70, 71, 71, 140], device=KERNEL_DEVICE)
    psw = torch.rand(140, device=KERNEL_DEVICE) if weighted else None
    got = table_backward_inputs(indices, offsets, psw, mode, padding_idx, num_weights, 4, kernel=True)
    want = backward_inputs_reference(indices, offsets, psw, single_meta(num_weights, 4, mode, KERNEL_DEVICE), 6,
                                     padding_idx, scaled=mode in (MEAN, SQRTN, WMEAN))
    assert got[0].dtype == (torch.int32 if num_weights < 2**31 else torch.int64)  # the sort keys' type
    assert torch.equal(got[0].long(), want[0]) and torch.equal(got[1].long(), want[1])
    keep = want[0] >= 0  # scales of positions that feed nothing do not matter
    assert (got[2] is None) == (want[2] is None)
    if want[2] is not None and mode in (SQRTN, WMEAN) and weighted:  # weights summed in another order
        torch.testing.assert_close(got[2][keep], want[2].float()[keep], rtol=1e-6, atol=0)
    elif want[2] is not None:
        assert torch.equal(got[2][keep], want[2].float()[keep])


NAN_BAGS = [[0, 1, 2], [1, 0, 2], [1], [3, 0], [0, 3], [3], [4, 1], [1, 4], [2, 2], [3, 3], [5, 1, 2], [5, 5]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_nan_and_inf_rows_match_torch(device, mode):
    """NaN and +-inf in the table give torch's outputs and gradients in every mode: in max mode
    the bag's first pooled value stays if NaN, a later NaN is passed over, -inf is a value
    (padding_idx 5 is not pooled)."""
    nan, inf = float("nan"), float("inf")
    w = torch.tensor([[1.0, 2], [nan, 5], [3, 4], [-inf, nan], [inf, -1], [7, 7]], device=device)
    for ids in NAN_BAGS:
        i, off = torch.tensor(ids, device=device), torch.tensor([0], device=device)
        ours_w, theirs_w = w.clone().requires_grad_(), w.clone().requires_grad_()
        ours = embfuse.embedding_bag(i, ours_w, off, mode=mode, padding_idx=5)
        theirs = F.embedding_bag(i.cpu(), theirs_w.cpu(), off.cpu(), mode=mode, padding_idx=5)
        assert torch.equal(ours.cpu().nan_to_num(123.0), theirs.nan_to_num(123.0)), (ids, ours, theirs)
        if mode == "max":
            g = torch.randn_like(ours)
            (gw,) = torch.autograd.grad(ours, ours_w, g)
            (gt,) = torch.autograd.grad(theirs, theirs_w, g.cpu())
            assert torch.equal(gw.cpu(), gt.cpu()), ids


@requires_kernels
def test_max_kernel_keeps_torchs_nan_and_inf_rule():
    """The kernel's max pooling (interpreted on the CPU) against the reference on NAN_BAGS,
    with several bags per launch and ties across lanes."""
    from embfuse.ops.embedding_bag import MAX, embedding_bag_forward, embedding_bag_reference

    nan, inf = float("nan"), float("inf")
    w = torch.tensor([[1.0, 2], [nan, 5], [3, 4], [-inf, nan], [inf, -1], [7, 7]], device=KERNEL_DEVICE)
    ids = torch.tensor([i for bag in NAN_BAGS for i in bag], device=KERNEL_DEVICE)
    lengths = torch.tensor([0] + [len(b) for b in NAN_BAGS])
    offsets = torch.cumsum(lengths, 0).to(KERNEL_DEVICE)
    out, max_ids = embedding_bag_forward(w, ids, offsets, None, MAX, 5)
    ref, ref_ids = embedding_bag_reference(w, ids, offsets, None, MAX, 5)
    assert torch.equal(out.nan_to_num(123.0), ref.nan_to_num(123.0))
    assert torch.equal(max_ids, ref_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_mean_gradients_are_float64(device):
    """The 1 / count scale of mean pooling is taken in float64 for float64 tables: gradients and
    fused updates agree with torch's float64 to 1e-13 (a float32 scale is off by ~1e-8). Bags of
    7, 0, 13, 13 and 27 ids: none of their scales is exact in float32."""
    torch.manual_seed(3)
    ids = torch.randint(0, 50, (60,), device=device)
    offsets = torch.tensor([0, 7, 7, 20, 33], device=device)
    w0 = torch.randn(50, 8, dtype=torch.float64, device=device)
    g = torch.randn(5, 8, dtype=torch.float64, device=device)
    ref_w = w0.cpu().clone().requires_grad_()
    F.embedding_bag(ids.cpu(), ref_w, offsets.cpu(), mode="mean").backward(g.cpu())
    ref = ref_w.grad
    tight = dict(rtol=1e-13, atol=1e-13)
    for sparse in (False, True, "rowwise"):
        w = w0.clone().requires_grad_()
        embfuse.embedding_bag(ids, w, offsets, mode="mean", sparse=sparse).backward(g)
        torch.testing.assert_close((w.grad.to_dense() if w.grad.is_sparse else w.grad).cpu(), ref, **tight)
    bag = embfuse.nn.EmbeddingBag(50, 8, mode="mean", dtype=torch.float64, device=device,
                                  optimizer=embfuse.optim.SGD(lr=1.0))
    with torch.no_grad():
        bag.weight.copy_(w0)
    bag(ids, offsets).backward(g)
    torch.testing.assert_close(bag.weight.detach().cpu(), w0.cpu() - ref, **tight)
    ebc = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(50, 8, "t", feature_names=["f"],
                                                                     pooling="mean", data_type=torch.float64)],
                                         device=device, optimizer=embfuse.optim.SGD(lr=1.0))
    with torch.no_grad():
        ebc.weights.copy_(w0.reshape(-1))
    kjt = embfuse.KeyedJaggedTensor(["f"], ids, offsets=torch.cat([offsets, torch.tensor([60], device=device)]))
    ebc(kjt).values().backward(g)
    torch.testing.assert_close(ebc.weights.detach().view(50, 8).cpu(), w0.cpu() - ref, **tight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [False, True, "rowwise"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_padding_contributes_nothing_even_nan(device, sparse, mode):
    """Padding positions are not part of a bag: a NaN in the padding row or in the output
    gradient reaches no output and no gradient row, and torch's sparse gradient has no entry
    for them (issue 17 items 11, 12)."""
    nan = float("nan")
    w = torch.randn(5, 2, device=device)
    w[2] = nan  # the padding row
    ids, offsets = torch.tensor([1, 2, 2, 4], device=device), torch.tensor([0, 2], device=device)
    ours_w, theirs_w = w.clone().requires_grad_(), w.cpu().clone().requires_grad_()
    ours = embfuse.embedding_bag(ids, ours_w, offsets, mode=mode, sparse=sparse, padding_idx=2)
    theirs = F.embedding_bag(ids.cpu(), theirs_w, offsets.cpu(), mode=mode, sparse=sparse is True, padding_idx=2)
    torch.testing.assert_close(ours.cpu(), theirs)
    g = torch.ones(2, 2)
    g[1, 0] = nan
    ours.backward(g.to(device))
    theirs.backward(g)
    if sparse is True:
        assert ours_w.grad._nnz() == theirs_w.grad._nnz() == 2
    got = ours_w.grad.to_dense() if ours_w.grad.is_sparse else ours_w.grad
    want = theirs_w.grad.to_dense() if theirs_w.grad.is_sparse else theirs_w.grad
    assert torch.equal(got.cpu().nan_to_num(9.0), want.nan_to_num(9.0))
    g = torch.ones(4, 2)
    g[1:3] = nan  # the padding positions' output gradient
    for sp in (False, True):
        e_w, t_w = w.clone().requires_grad_(), w.cpu().clone().requires_grad_()
        embfuse.embedding(ids, e_w, padding_idx=2, sparse=sp).backward(g.to(device))
        F.embedding(ids.cpu(), t_w, padding_idx=2, sparse=sp).backward(g)
        if sp:
            assert e_w.grad._nnz() == t_w.grad._nnz() == 2
        assert torch.equal(e_w.grad.to_dense().cpu(), t_w.grad.to_dense())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("bounds_check", ["deferred", "sync", "off"])
def test_include_last_offset_with_one_offset_is_no_bag(device, mode, bounds_check):
    """One offset under include_last_offset holds no bag, whatever the ids: torch 2.13's CPU gives
    a (0, D) output for sum and mean (and its max crashes the process). There is no last bag to
    run to the end (an error used to say offsets[0] was the id count), and no id is read: torch's
    CPU backward, which embfuse's CPU path calls, gave those ids' rows garbage gradients."""
    w = torch.randn(10, 4, device=device, requires_grad=True)
    ids, one = torch.tensor([1, 2, 3], device=device), torch.tensor([0], device=device)
    for offsets, last in ((one, True), (one[:0], False)):  # (no offsets at all: no bag either)
        w.grad = None
        out = embfuse.embedding_bag(ids, w, offsets, mode=mode, include_last_offset=last, bounds_check=bounds_check)
        assert out.shape == (0, 4)
        out.sum().backward()
        assert torch.equal(w.grad, torch.zeros_like(w))
    bag = embfuse.nn.EmbeddingBag(10, 4, mode=mode, include_last_offset=True, device=device)
    assert bag(ids, one).shape == (0, 4)
    embfuse.check_errors()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 61])
def test_include_last_offset_last_bag_runs_to_the_end(device, mode, padding_idx):
    """With include_last_offset the last bag ends at the end of the input, whatever the last
    offset (torch's tested behaviour, pytorch issue 89677), in every mode (issue 17 item 13). So
    do torch's CUDA kernels, checked on the H100 with torch 2.11 (offsets [0, 3, 3], [0, 3, 1]);
    its CPU sum and mean stop at a last offset under the id count (2.13)."""
    w = torch.randn(100, 3, device=device)
    ids = torch.tensor([0, 1, 2, 3], device=device)
    pool = {"sum": lambda r: r.sum(0), "mean": lambda r: r.mean(0), "max": lambda r: r.max(0).values}[mode]
    want = torch.stack([pool(w[0:3]), pool(w[3:4])])
    for last in (3, 4):
        out = embfuse.embedding_bag(ids, w, torch.tensor([0, 3, last], device=device), mode=mode,
                                    include_last_offset=True, padding_idx=padding_idx)
        torch.testing.assert_close(out, want)
