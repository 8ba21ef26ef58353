import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse.ops.embedding import embedding_forward, embedding_reference
from embfuse.ops import tuning
from embfuse.optim import Adam, apply_sparse_update, apply_sparse_update_reference
from embfuse.optim.rules import init_state
from embfuse.ops.segments import (Layout, reduce_segments, rowwise_grad, rowwise_grad_reference, segment_grad,
                                  segment_grad_reference, single_table)
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels
from tests.tolerances import assert_close


@requires_kernels
@pytest.mark.parametrize("D", [1, 3, 64, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_gathers_exactly(D, dtype, index_dtype):
    w = torch.randn(50, D, device=KERNEL_DEVICE).to(dtype)
    ids = torch.randint(0, 50, (37,), device=KERNEL_DEVICE, dtype=index_dtype)
    assert torch.equal(embedding_forward(w, ids), embedding_reference(w, ids))


@requires_kernels
@pytest.mark.parametrize("D", [1, 3, 64, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding_idx,freq", [(-1, False), (4, False), (-1, True), (4, True)])
def test_backward_kernel_matches_float64_reference(D, dtype, padding_idx, freq):
    ids = torch.randint(0, 20, (300,), device=KERNEL_DEVICE)
    ids[::4] = 4  # one hot row: runs longer than a chunk
    grad = torch.randn(300, D, device=KERNEL_DEVICE).to(dtype)
    got = segment_grad(ids, grad, None, None, 20, padding_idx, freq, dtype)
    ref = segment_grad_reference(ids, grad.double(), None, None, 20, padding_idx, freq, torch.float64)
    assert_close(got, ref, dtype, reduction=100)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_idx", [None, 3, -2])
@pytest.mark.parametrize("freq", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_functional_matches_torch(device, padding_idx, freq, sparse):
    base = torch.randn(12, 5, device=device)
    w_t, w_e = base.clone().requires_grad_(), base.clone().requires_grad_()
    x = torch.randint(0, 12, (4, 6), device=device)
    x[:, 0] = 3
    # torch has no sparse gradient with freq scaling: compare with its dense one
    ref = F.embedding(x, w_t, padding_idx, scale_grad_by_freq=freq, sparse=sparse and not freq)
    out = embfuse.embedding(x, w_e, padding_idx, scale_grad_by_freq=freq, sparse=sparse)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert w_e.grad.is_sparse == sparse
    assert_close(w_e.grad.to_dense(), w_t.grad.to_dense(), torch.float32, reduction=24)


@pytest.mark.parametrize("device", DEVICES)
def test_max_norm_and_empty(device):
    base = torch.randn(12, 5, device=device) * 3
    w_t, w_e = base.clone(), base.clone()
    x = torch.tensor([1, 2, 2], device=device)
    assert_close(embfuse.embedding(x, w_e, max_norm=1.0), F.embedding(x, w_t, max_norm=1.0), torch.float32)
    assert_close(w_e, w_t, torch.float32)
    assert embfuse.embedding(torch.zeros(0, 3, dtype=torch.long, device=device), w_e).shape == (0, 3, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("freq", [False, True])
def test_an_empty_input_has_a_zero_gradient(device, sparse, freq):
    """torch 2.11's CUDA F.embedding raises "invalid argument" in this backward with
    scale_grad_by_freq (benchmarks/NOTES.md, session 40)."""
    w = torch.randn(7, 5, device=device, requires_grad=True)
    out = embfuse.embedding(torch.zeros(0, 3, dtype=torch.long, device=device), w, scale_grad_by_freq=freq,
                            sparse=sparse)
    out.sum().backward()
    assert w.grad.is_sparse == sparse and torch.equal(w.grad.to_dense(), torch.zeros_like(w))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    w = torch.randn(20, 8, device=device, requires_grad=True)
    ids = torch.randint(0, 20, (9,), device=device)
    status = torch.zeros(2, dtype=torch.int32, device=device)  # a deferred check's, passed
    torch.library.opcheck(torch.ops.embfuse.embedding.default, (w, ids, status, 2, False, False))
    torch.library.opcheck(torch.ops.embfuse.embedding_backward.default, (torch.randn(9, 8, device=device), ids, 20,
                                                                         2, True))
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: embfuse.embedding(x, w).square().sum(), fullgraph=True)
    (g,) = torch.autograd.grad(f(ids, w), w)
    assert_close(g, torch.autograd.grad(F.embedding(ids, w).square().sum(), w)[0], torch.float32, reduction=9)


@requires_kernels
@pytest.mark.parametrize("freq", [False, True])
@pytest.mark.parametrize("D", [3, 129, 256])
@pytest.mark.parametrize("tiles", ["small", "large"])
def test_backward_hot_row_spanning_tiles(freq, D, tiles, monkeypatch):
    """A row seen hundreds of times spans many tiles and levels. Both tile shapes: the one of
    small levels (8 warps), and the one of large levels (one warp a 128 columns: on the GPU the
    run sums are a scan in registers), forced here on a small input."""
    if tiles == "large":
        monkeypatch.setattr(tuning, "SMALL_LEVEL", 0)
    n = 1200
    ids = torch.randint(0, 50, (n,), device=KERNEL_DEVICE)
    ids[: n * 3 // 4] = 9
    ids = ids[torch.randperm(n, device=KERNEL_DEVICE)]
    grad = torch.randn(n, D, device=KERNEL_DEVICE)
    got = segment_grad(ids, grad, None, None, 50, -1, freq, torch.float32)
    ref = segment_grad_reference(ids, grad.double(), None, None, 50, -1, freq, torch.float64)
    assert_close(got, ref, torch.float32, reduction=n)
    assert torch.equal(got, segment_grad(ids, grad, None, None, 50, -1, freq, torch.float32))


@requires_kernels
@pytest.mark.parametrize("opt", [None, Adam(lr=0.05)], ids=["grad", "adam"])
@pytest.mark.parametrize("tree_level", [tuning.TREE_LEVEL, 100])
def test_a_deep_tree_of_levels_in_one_launch(opt, tree_level, monkeypatch):
    """The upper levels run as one tree in one launch (Segments.launch). 20000 positions in
    32-entry tiles make levels 2-4 of 1250, 80 and 6 entries: programs of level 2 go on to
    levels 3 and 4 when they finish last. With a tree from 100 entries on, level 2 is a launch of
    its own and the tree starts at level 3. A few hot rows span every level; Adam's programs
    take 32 of the 64 columns, so each column block keeps its own counters. Against the
    float64 reference, and bitwise the same on a second call."""
    monkeypatch.setattr(tuning, "SMALL_LEVEL", 0)
    monkeypatch.setattr(tuning, "TREE_LEVEL", tree_level)
    n, N, D = 20000, 300, 64
    ids = torch.randint(0, N, (n,), device=KERNEL_DEVICE)
    ids[::2], ids[1::7] = 5, 17
    ids[::13] = -1
    src = torch.randn(n, D, device=KERNEL_DEVICE)
    if opt is None:
        got = [segment_grad(ids, src, None, None, N, -1, False, torch.float32) for _ in range(2)]
        want = segment_grad_reference(ids, src.double(), None, None, N, -1, False, torch.float64)
    else:
        base = torch.randn(N, D, device=KERNEL_DEVICE)
        got = []
        for _ in range(2):
            w, state = base.clone(), init_state(opt, N, D, KERNEL_DEVICE)
            apply_sparse_update(w, state, opt, ids, src, kernel=True)
            got.append(w)
        want, state = base.double(), {k: v.double() for k, v in init_state(opt, N, D, KERNEL_DEVICE).items()}
        apply_sparse_update_reference(want, state, opt, ids, src.double(), None, None, 1)
    assert_close(got[0], want, torch.float32, reduction=n // 2)
    assert torch.equal(got[0], got[1])


@requires_kernels
def test_int64_sort_keys_give_the_same_gradient():
    """Keys wider than 32 bits (tables past 2^31 rows, or many large tables) sort as int64; the
    same ids forced down that path give the bitwise same gradient as the int32 one."""
    ids = torch.randint(0, 40, (700,), device=KERNEL_DEVICE)
    grad = torch.randn(700, 16, device=KERNEL_DEVICE)
    narrow = single_table(40, 16, KERNEL_DEVICE)
    wide = Layout(narrow.max_dim, narrow.vec, True, 0, narrow.own_source)
    got = [reduce_segments(ids, L, grad, torch.zeros(40, 16, device=KERNEL_DEVICE)) for L in (narrow, wide)]
    assert not narrow.wide_keys
    assert torch.equal(got[0], got[1])
    assert_close(got[1], segment_grad_reference(ids, grad.double(), None, None, 40, -1, False, torch.float64),
                 torch.float32, reduction=700)


@requires_kernels
@pytest.mark.parametrize("case", ["distinct", "one key", "mixed"])
def test_backward_tiles_of_every_kind(case):
    """Tiles with no repeated key, one key throughout and a mix, against the reference."""
    n, rows = 640, 1000
    ids = {"distinct": torch.randperm(rows)[:n], "one key": torch.full((n,), 7),
           "mixed": torch.randint(0, 40, (n,))}[case].to(KERNEL_DEVICE)
    grad = torch.randn(n, 64, device=KERNEL_DEVICE)
    got = segment_grad(ids, grad, None, None, rows, -1, False, torch.float32)
    ref = segment_grad_reference(ids, grad.double(), None, None, rows, -1, False, torch.float64)
    assert_close(got, ref, torch.float32, reduction=n)


@requires_kernels
@pytest.mark.parametrize("D", [3, 129])
@pytest.mark.parametrize("padding_idx,freq", [(-1, False), (9, False), (-1, True)])
@pytest.mark.parametrize("case", ["hot row", "no repeats", "all skipped"])
def test_rowwise_grad_kernel_is_the_dense_gradient_at_the_touched_rows(D, padding_idx, freq, case):
    """Renumbering rows by rank keeps every run and tile of the dense reduction: the row-wise
    values are bitwise the dense gradient's rows, and match the float64 reference."""
    n, rows = 1200, 5000
    ids = torch.randint(0, rows, (n,), device=KERNEL_DEVICE)
    if case == "hot row":
        ids[: n // 2] = 9  # spans tiles and levels
    elif case == "no repeats":
        ids = torch.randperm(rows, device=KERNEL_DEVICE)[:n]
    else:
        ids[:] = -1
    ids[::7] = -1
    grad = torch.randn(n, D, device=KERNEL_DEVICE)
    touched, values = rowwise_grad(ids, grad, None, None, rows, padding_idx, freq, torch.float32)
    ref_rows, ref_values = rowwise_grad_reference(ids, grad.double(), None, None, rows, padding_idx, freq,
                                                  torch.float64)
    assert torch.equal(touched.cpu(), ref_rows.cpu())
    assert_close(values, ref_values, torch.float32, reduction=n)
    dense = segment_grad(ids, grad, None, None, rows, padding_idx, freq, torch.float32)
    assert torch.equal(values, dense[touched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("freq", [False, True])
def test_rowwise_sparse_gradient_has_one_entry_per_touched_row(device, padding_idx, freq):
    w_t = torch.randn(12, 5, device=device, requires_grad=True)
    w_e = w_t.detach().clone().requires_grad_()
    x = torch.randint(0, 12, (4, 9), device=device)
    x[:, 0] = 3
    ref = F.embedding(x, w_t, padding_idx, scale_grad_by_freq=freq)
    out = embfuse.embedding(x, w_e, padding_idx, scale_grad_by_freq=freq, sparse="rowwise")
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    grad = w_e.grad
    assert grad.is_sparse  # (autograd drops the coalesced flag when it stores .grad)
    touched = x.unique()
    if padding_idx is not None:
        touched = touched[touched != padding_idx]
    assert torch.equal(grad._indices()[0], touched)
    assert_close(grad._values(), w_t.grad[touched], torch.float32, reduction=x.numel())


@requires_kernels
def test_rowwise_grad_op_passes_opcheck():
    """The opaque op a traced backward calls for the row-wise gradient (its output size is
    the data's: a dynamic size in its fake kernel)."""
    ids = torch.randint(0, 20, (40,), device=KERNEL_DEVICE)
    ids[::5] = -1
    src, scale = torch.randn(40, 8, device=KERNEL_DEVICE), torch.rand(40, device=KERNEL_DEVICE)
    torch.library.opcheck(torch.ops.embfuse.rowwise_grad.default, (ids, src, None, scale, 20, 3, True, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [True, "rowwise"])
def test_compiled_sparse_gradient_is_torchs(device, sparse):
    """The sparse gradients under torch.compile, at two batch sizes (the second with dynamic
    shapes), as torch's float64 gradient."""
    torch._dynamo.reset()
    w0 = torch.randn(30, 8, device=device)
    f = torch.compile(lambda x, w: embfuse.embedding(x, w, padding_idx=2, sparse=sparse).tanh(), fullgraph=True)
    for B in (6, 9):
        x = torch.randint(0, 30, (B, 5), device=device)
        x[0, 0] = 2
        w = w0.clone().requires_grad_()
        out = f(x, w)
        g = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, [w], g)
        ref = w0.double().requires_grad_()
        (want,) = torch.autograd.grad(F.embedding(x, ref, padding_idx=2).tanh(), [ref], g.double())
        assert got.is_sparse
        assert_close(got.to_dense(), want, torch.float32, reduction=B * 5)


def test_sparse_must_name_a_gradient_layout():
    with pytest.raises(ValueError, match="sparse must be False, True, 'coo' or 'rowwise', got 'dense'"):
        embfuse.embedding(torch.tensor([1]), torch.randn(3, 2), sparse="dense")


def test_integer_tables_are_looked_up():
    """nn.Embedding.from_pretrained of an integer table (torch looks it up, no gradient)."""
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        a = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=dtype)
        m = embfuse.nn.Embedding.from_pretrained(a)
        assert torch.equal(m(torch.tensor([1, 0])), a.flip(0))


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("freq", [False, True])
def test_double_backward_matches_torch(padding_idx, freq):
    """gradgradcheck in float64, and the double backward of torch's padding test: the padding
    row's weight + gradient is unchanged."""
    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1, 1, 2], [3, 5, 0, 1]])
    fn = lambda weight: embfuse.embedding(ids, weight, padding_idx, scale_grad_by_freq=freq)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (w,))
    for module in (embfuse.nn.Embedding(5, 2, padding_idx=0), torch.nn.Embedding(5, 2, padding_idx=0)):
        idx = torch.tensor([1, 3] + [0] * 3)
        total = module(idx).sum()
        (g,) = torch.autograd.grad(total, list(module.parameters()), create_graph=True)
        (g.sum() + total).backward()
        assert torch.equal(module.weight.grad[0], torch.zeros(2))


def test_forward_mode_ad_with_max_norm():
    """Forward-mode AD through embedding, max_norm included (the detached weight is renormed,
    as torch does): the tangent of each looked-up row is the weight tangent's row."""
    from torch.autograd import forward_ad

    weight = torch.randn(4, 4) * 2
    inp = torch.tensor([[0, 1], [2, 2]])
    for max_norm in (None, 1.0):
        with forward_ad.dual_level():
            dual_weight = forward_ad.make_dual(weight.clone(), torch.ones(4, 4))
            jvp = forward_ad.unpack_dual(embfuse.embedding(inp, dual_weight, max_norm=max_norm)).tangent
        assert torch.equal(jvp, torch.ones(2, 2, 4))
