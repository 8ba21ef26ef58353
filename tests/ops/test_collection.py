"""The table-batched kernels (interpreted on the CPU in CI) against the float64 references."""

import pytest
import torch

from embfuse.ops import tuning
from embfuse.ops.bags import POOL, WEIGHT_SUMS, backward_inputs, backward_inputs_reference, bag_of_value
from embfuse.ops.collection import (Plan, collection_backward, collection_backward_reference, collection_forward,
                                    collection_native, collection_native_backward, collection_reference,
                                    feature_native_backward, table_view)
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from embfuse.optim.fused import collection_update
from embfuse.optim.rules import init_state
from tests.conftest import KERNEL_DEVICE, requires_kernels
from tests.tolerances import assert_close

# mixed widths (1, 3, 16, 33), tables shared by two features, sum, mean, sqrtn and wmean
TABLES = [(11, 3), (7, 16), (5, 1), (9, 33)]
FEATURES = [(0, "sum"), (1, "mean"), (0, "mean"), (2, "sqrtn"), (3, "sum"), (1, "wmean")]


def batch(B, device, weighted=False, max_len=4, hot=False):
    lengths = torch.randint(0, max_len + 1, (len(FEATURES) * B,))
    lengths[B:2 * B] = 0  # feature 1 is empty in this batch
    lengths[0] = 0  # and an empty bag
    feats = torch.arange(len(FEATURES)).repeat_interleave(B).repeat_interleave(lengths)
    rows = torch.tensor([TABLES[t][0] for t, _ in FEATURES])[feats]
    values = (torch.rand(feats.numel()) * rows).long()
    if hot:  # most ids on one row per table: runs much longer than a tile, several levels
        values = torch.where(torch.rand(values.numel()) < 0.8, rows // 2, values)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    psw = torch.rand(values.numel()) + 0.5 if weighted else None
    return values.to(device), offsets.to(device), None if psw is None else psw.to(device)


def plan(device, pooling=None):
    """The collection of FEATURES, or with every feature pooled by `pooling`."""
    cols, col = [], 0
    for t, _ in FEATURES:
        cols.append(col)
        col += TABLES[t][1]
    return Plan(TABLES, [(t, pooling or p, c) for (t, p), c in zip(FEATURES, cols)], device)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_kernel_with_vector_loads_matches_float64(dtype):
    """Widths that are all multiples of 4 (vector loads), one wider than a column block (260:
    a second, mostly masked block) and narrower ones that leave blocks idle."""
    tables = [(11, 8), (7, 260), (5, 4), (9, 12)]
    P = Plan(tables, [(0, "sum", 0), (1, "mean", 8), (2, "sum", 268), (3, "sum", 272), (0, "sum", 284)],
             KERNEL_DEVICE)
    assert P.layout.vec == 4
    B, F = 6, 5
    lengths = torch.randint(0, 5, (F * B,))
    feats = torch.arange(F).repeat_interleave(B).repeat_interleave(lengths)
    rows = torch.tensor([tables[t][0] for t in (0, 1, 2, 3, 0)])[feats]
    values = (torch.rand(feats.numel()) * rows).long().to(KERNEL_DEVICE)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(KERNEL_DEVICE)
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE).to(dtype)
    out = collection_forward(weights, values, offsets, None, P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    ref = collection_reference(weights.double(), values, offsets, None, P.meta, B, P.total_dim, P.max_dim)
    assert_close(out, ref, dtype, reduction=4)


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
def test_few_long_bags_match_float64(weighted, pooling_warps):
    """FEATURES x 3 bags of up to 250 ids: the spread launch shape (tuning.spreads)."""
    B = 3
    P = plan(KERNEL_DEVICE)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=250)
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    out = collection_forward(weights, values, offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    assert pooling_warps == [4]
    collection_forward(weights.bfloat16(), values, offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    assert pooling_warps == [4, 1]  # bf16 rows of at most 33 columns: 66 bytes
    ref = collection_reference(weights.double(), values, offsets, None if psw is None else psw.double(), P.meta, B,
                               P.total_dim, P.max_dim)
    assert_close(out, ref, torch.float32, reduction=250)


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_of_one_width_match_float64(weighted, dtype):
    """Every feature as wide as the pooling's column block (16 here): the kernel's FULL form, a
    constant width without column masks; every pooling mode, a table read by two features."""
    B, D = 6, 16
    tables = [(11, D), (7, D), (5, D)]
    modes = ["sum", "mean", "sqrtn", "wmean", "sum"]
    P = Plan(tables, [(t, p, D * f) for f, (t, p) in enumerate(zip([0, 1, 0, 2, 1], modes))], KERNEL_DEVICE)
    lengths = torch.randint(0, 6, (len(modes) * B,))
    feats = torch.arange(len(modes)).repeat_interleave(B).repeat_interleave(lengths)
    rows = torch.tensor([tables[t][0] for t in [0, 1, 0, 2, 1]])[feats]
    values = (torch.rand(feats.numel()) * rows).long().to(KERNEL_DEVICE)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(KERNEL_DEVICE)
    psw = torch.rand(values.numel(), device=KERNEL_DEVICE) + 0.5 if weighted else None
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE).to(dtype)
    out = collection_forward(weights, values, offsets, None if psw is None else psw.to(dtype), P.meta, B,
                             P.total_dim, P.max_dim, P.layout.vec)
    ref = collection_reference(weights.double(), values, offsets, None if psw is None else psw.to(dtype).double(),
                               P.meta, B, P.total_dim, P.max_dim)
    assert_close(out, ref, dtype, reduction=6)


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_len", [9, 40])
def test_int32_values_pool_as_int64_values(weighted, max_len):
    """int32 values pool bitwise as the same int64 values, also from a view that starts at an odd
    element (4-byte aligned only), in tiles of 4 and 16 rows (the other int32 tests here pool
    one row a step: their bags are short)."""
    B = 7
    P = plan(KERNEL_DEVICE)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=max_len)
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    args = (P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    want = collection_forward(weights, values, offsets, psw, *args)
    ref = collection_reference(weights.double(), values, offsets, None if psw is None else psw.double(), *args[:-1])
    assert_close(want, ref, torch.float32, reduction=max_len)
    assert torch.equal(collection_forward(weights, values.int(), offsets, psw, *args), want)
    odd = torch.cat([values.new_zeros(1), values]).int()[1:]
    assert odd.data_ptr() % 8 == 4
    assert torch.equal(collection_forward(weights, odd, offsets, psw, *args), want)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pooling", [None, "sum"], ids=["mixed", "all-sum"])
def test_forward_and_backward_kernels_match_float64(dtype, weighted, index_dtype, pooling):
    B = 5
    P = plan(KERNEL_DEVICE, pooling)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted)
    values, offsets = values.to(index_dtype), offsets.to(index_dtype)
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE).to(dtype)
    out = collection_forward(weights, values, offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    ref = collection_reference(weights.double(), values, offsets, None if psw is None else psw.double(), P.meta, B,
                               P.total_dim, P.max_dim)
    assert_close(out, ref, dtype, reduction=4)
    grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE).to(dtype)
    L = P.layout
    got = collection_backward(grad, values, offsets, psw, P.meta, P.src_meta, L, B, P.num_elements, P.scaled,
                              P.weight_sums)
    want = collection_backward_reference(grad.double(), values, offsets, psw, P.meta, B, P.num_elements, P.max_dim)
    assert_close(got, want, dtype, reduction=len(values))
    assert torch.equal(got, collection_backward(grad, values, offsets, psw, P.meta, P.src_meta, L, B, P.num_elements,
                                                P.scaled, P.weight_sums))
    # the gradient as a column slice of a wider one (torch.cat's backward): rows strided wider than they are
    wide = torch.randn(B, P.total_dim + 3, device=KERNEL_DEVICE).to(dtype)
    wide[:, 1:1 + P.total_dim] = grad
    assert torch.equal(got, collection_backward(wide[:, 1:1 + P.total_dim], values, offsets, psw, P.meta, P.src_meta,
                                                L, B, P.num_elements, P.scaled, P.weight_sums))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [None, "sum"], ids=["every-pooling", "all-sum"])
@pytest.mark.parametrize("dims", [(8, 8, 8, 8), (8, 16, 3, 8)], ids=["one-width", "mixed-widths"])
def test_the_cpus_native_paths_match_float64(dtype, weighted, pooling, dims):
    """The CPU's own forward (torch's embedding_bag per feature), backward (gradient rows into
    buffer rows: per feature, and the traced one-width form) and fused update of a
    collection, every pooling, with ids a safe lookup dropped (SKIPPED, -1; each table's row 0,
    which no kept id names, holding inf, which a dropped id must not read): the element-wise
    references'."""
    tables = [(r, d) for (r, _), d in zip([(11, 0), (7, 0), (5, 0), (9, 0)], dims)]
    cols = [0]
    for t, _ in FEATURES:
        cols.append(cols[-1] + dims[t])
    P = Plan(tables, [(t, pooling or p, cols[f]) for f, (t, p) in enumerate(FEATURES)], "cpu")
    B = 7
    values, offsets, psw = batch(B, "cpu", weighted)
    rows = torch.tensor([tables[t][0] for t, _ in FEATURES]).repeat_interleave(B)
    values = (torch.rand(values.numel()) * rows.repeat_interleave(offsets.diff())).long()
    weights = torch.randn(P.num_elements, dtype=torch.float64)
    if weighted:  # (ops/safe.py leaves a dropped entry as SKIPPED, always with weight 0)
        values = values.clamp(min=1)
        values[::5], psw[::5] = -1, 0
        for _, _, elem, _ in P.tables:
            weights[elem] = float("inf")
    psw64, psw = (None, None) if psw is None else (psw.double(), psw.to(dtype))
    got = collection_native(weights.to(dtype), values, offsets, psw, P.meta, B, P.total_dim, P.max_dim)
    want = collection_reference(weights, values, offsets, psw64, P.meta, B, P.total_dim, P.max_dim)
    assert_close(got, want, dtype, reduction=4)
    grad = torch.randn(B, P.total_dim, dtype=torch.float64)
    args = (grad.to(dtype), values, offsets, psw, P.meta, B, P.num_elements)
    want = collection_backward_reference(grad, values, offsets, psw64, P.meta, B, P.num_elements, P.max_dim)
    assert_close(feature_native_backward(*args, P.scaled), want, dtype, reduction=len(values))
    if len(set(dims)) == 1:  # (the traced form; unweighted sums: no scale at all)
        assert_close(collection_native_backward(*args, P.max_dim, P.scaled), want, dtype, reduction=len(values))
    # the fused update: the rule on each table's touched rows of that gradient (row and element state)
    for opt in (RowWiseAdagrad(lr=0.1, weight_decay=0.01), Adam(lr=0.05)):
        w, state = weights.to(dtype, copy=True), init_state(opt, P.num_rows, 0, "cpu", P.num_elements)
        collection_update(w, state, opt, values, offsets, psw, P, B, grad.to(dtype), 1, kernel=False)
        expected = weights.clone()
        for n, dim, elem, _ in P.tables:
            g = table_view(want, elem, n, dim)
            touched = g.abs().sum(1) > 0
            fresh = {k: v.double() for k, v in init_state(opt, int(touched.sum()), dim, "cpu").items()}
            new, _ = opt.update(table_view(weights, elem, n, dim)[touched], g[touched], fresh, 1)
            table_view(expected, elem, n, dim)[touched] = new
        assert_close(w, expected, dtype, reduction=8)


def test_unchecked_offsets_never_take_the_cpus_collection_past_the_values():
    """bounds_check="off" on the CPU: a collection's offsets past the values, negative or
    decreasing pool the values that exist, as the offsets held inside [0, n] and non-decreasing
    (torch's CPU kernel, given them, raises or reads past the values)."""
    P = Plan([(10, 4), (6, 4)], [(0, "sum", 0), (1, "mean", 4)], "cpu")
    weights, values = torch.randn(64, dtype=torch.float64), torch.randint(0, 6, (12,))
    for offsets, cut in (([0, 2, 50, 4, 6, 9, 12], [0, 2, 12, 12, 12, 12, 12]),
                         ([0, 2, 1, 4, 6, 9, 12], [0, 2, 2, 4, 6, 9, 12]),
                         ([-5, 2, 4, 4, 6, 9, 40], [0, 2, 4, 4, 6, 9, 12])):
        got = collection_native(weights, values, torch.tensor(offsets), None, P.meta, 3, P.total_dim, P.max_dim)
        want = collection_reference(weights, values, torch.tensor(cut), None, P.meta, 3, P.total_dim, P.max_dim)
        assert_close(got, want, torch.float64), offsets


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_cpus_count_of_a_values_bag_is_searchsorteds(dtype):
    """bag_of_value on the CPU (a count of the offsets and a prefix sum) gives searchsorted's bag
    (the GPU's form): empty bags, values before the first offset and past the last, offsets
    below 0 and past the values."""
    torch.manual_seed(0)
    for _ in range(300):
        FB, n = int(torch.randint(0, 12, ())), int(torch.randint(0, 30, ()))
        offsets = torch.randint(-3, 34, (FB + 1,)).sort().values.to(dtype)
        want = torch.searchsorted(offsets, torch.arange(n, dtype=dtype), right=True) - 1
        assert torch.equal(bag_of_value(offsets, n), want), (offsets, n)


@requires_kernels
@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1, weight_decay=0.01),
                                 Adam(lr=0.05)], ids=["sgd", "adagrad", "rowwise", "adam"])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_update_kernel_matches_the_reference(opt, weighted):
    """Weighted features of both poolings; unweighted sums, where no scale is read."""
    B = 6
    P = plan(KERNEL_DEVICE, None if weighted else "sum")
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted=weighted)
    base = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    w, w64 = base.clone(), base.double()
    state = init_state(opt, P.num_rows, 0, KERNEL_DEVICE, P.num_elements)
    state64 = {k: v.double() for k, v in state.items()}
    for step in (1, 2):
        grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE)
        collection_update(w, state, opt, values, offsets, psw, P, B, grad, step, kernel=True)
        collection_update(w64, state64, opt, values, offsets, psw if psw is None else psw.double(), P, B,
                          grad.double(), step, kernel=False)
    assert_close(w, w64, torch.float32, reduction=8)
    for k in state:
        assert_close(state[k], state64[k], torch.float32, reduction=len(values))


@requires_kernels
@pytest.mark.parametrize("opt", [None, SGD(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.05)],
                         ids=["grad", "sgd", "rowwise", "adam"])
@pytest.mark.parametrize("tiles", ["small", "large"])
def test_hot_rows_of_many_tables_through_every_level(opt, tiles, monkeypatch):
    """~5000 ids, 80% on one row of each table: several levels carry runs across tile edges,
    with entries of different tables (and none) side by side; in the tile shape of small levels
    and (forced) in that of large ones. Adam's programs take 32 columns: the 33-wide table's
    rows are reduced in two column blocks."""
    if tiles == "large":
        monkeypatch.setattr(tuning, "SMALL_LEVEL", 0)
    B = 48
    P = plan(KERNEL_DEVICE)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted=True, max_len=40, hot=True)
    grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE)
    if opt is None:
        got = collection_backward(grad, values, offsets, psw, P.meta, P.src_meta, P.layout, B, P.num_elements)
        want = collection_backward_reference(grad.double(), values, offsets, psw, P.meta, B, P.num_elements,
                                             P.max_dim)
        assert_close(got, want, torch.float32, reduction=len(values))
        return
    base = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    w, w64 = base.clone(), base.double()
    state = init_state(opt, P.num_rows, 0, KERNEL_DEVICE, P.num_elements)
    state64 = {k: v.double() for k, v in state.items()}
    collection_update(w, state, opt, values, offsets, psw, P, B, grad, 1, kernel=True)
    collection_update(w64, state64, opt, values, offsets, psw.double(), P, B, grad.double(), 1, kernel=False)
    assert_close(w, w64, torch.float32, reduction=len(values))


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("wide_keys", [False, True])
@pytest.mark.parametrize("pooling", [None, "sum"], ids=["mixed", "all-sum"])
def test_backward_inputs_kernel_matches_torch(weighted, wide_keys, pooling):
    B = 7
    P = plan(KERNEL_DEVICE, pooling)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=70)  # bags longer than a 32-wide block
    got = backward_inputs(values, offsets, psw, P.meta, B, wide_keys=wide_keys, scaled=P.scaled,
                          weight_sums=P.weight_sums, kernel=True)
    want = backward_inputs_reference(values, offsets, psw, P.meta, B, scaled=P.scaled)
    assert got[0].dtype == (torch.int64 if wide_keys else torch.int32)
    # unweighted sums scale nothing: no scale at all
    assert (got[2] is None) == (want[2] is None) == (pooling == "sum" and not weighted)
    assert torch.equal(got[0].long(), want[0]) and torch.equal(got[1].long(), want[1])
    if want[2] is not None:
        # sum and mean: bitwise (IEEE division in both); sqrtn and wmean: within an ulp or two (the
        # kernel's sums, square root and division round on their own; the interpreter's may differ
        # from the GPU's)
        summed = torch.isin(P.meta[:, POOL][want[1] // B], torch.tensor(WEIGHT_SUMS, device=KERNEL_DEVICE))
        assert torch.equal(got[2][~summed], want[2][~summed])
        torch.testing.assert_close(got[2][summed], want[2][summed], rtol=1e-6, atol=0)


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_batch_that_skips_passes_over_every_negative_id(weighted, index_dtype):
    """The kernels of a batch that `skips` (TensorFlow's rules leave dropped ids < 0 as they came:
    ops/safe.py) pass over every id < 0, not only SKIPPED (-1): no row read, none counted in a
    mean or summed in a norm (their weights are not 0 here), no gradient: the float64
    references', which pool ids >= 0 only. Bags longer than a step of each pass."""
    B = 5
    P = plan(KERNEL_DEVICE)
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=40)
    negative = torch.tensor([-1, -2, -7, -10**6, torch.iinfo(index_dtype).min], device=KERNEL_DEVICE)
    at = torch.arange(0, values.numel(), 3, device=KERNEL_DEVICE)
    values[at] = negative[torch.arange(at.numel(), device=KERNEL_DEVICE) % negative.numel()]
    values, offsets = values.to(index_dtype), offsets.to(index_dtype)
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    out = collection_forward(weights, values, offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec,
                             skips=True)
    psw64 = None if psw is None else psw.double()
    want = collection_reference(weights.double(), values, offsets, psw64, P.meta, B, P.total_dim, P.max_dim)
    assert_close(out, want, torch.float32, reduction=40)
    keys, bag, scale = backward_inputs(values, offsets, psw, P.meta, B, scaled=P.scaled, weight_sums=P.weight_sums,
                                       skips=True, kernel=True)
    want_keys, want_bag, want_scale = backward_inputs_reference(values, offsets, psw64, P.meta, B, dtype=torch.float64)
    assert torch.equal(keys, want_keys) and torch.equal(bag.long(), want_bag)
    torch.testing.assert_close(scale.double(), want_scale, rtol=1e-6, atol=0)
    grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE)
    got = collection_backward(grad, values, offsets, psw, P.meta, P.src_meta, P.layout, B, P.num_elements, P.scaled,
                              P.weight_sums, skips=True)
    want = collection_backward_reference(grad.double(), values, offsets, psw64, P.meta, B, P.num_elements, P.max_dim)
    assert_close(got, want, torch.float32, reduction=len(values))


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ["none", "tanh", "sigmoid", "relu"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_layer_norm_epilogue_matches_pool_then_chain(dtype, act, affine, weighted):
    """The pooling kernel with embfuse.ops.chain's LayerNorm + activation as its epilogue equals
    the pooled output (rounded to the table's dtype) through the chain's float64 reference."""
    from embfuse.ops.chain import layer_norm_act_reference

    tables = [(13, 6), (9, 6), (20, 6)]
    P = Plan(tables, [(0, "sum", 0), (1, "mean", 6), (2, "sqrtn", 12), (0, "mean", 18)], KERNEL_DEVICE)
    B, F, D = 5, 4, 6
    lengths = torch.randint(0, 5, (F * B,))
    lengths[3] = 0  # an empty bag: LayerNorm of zeros is the bias
    feats = torch.arange(F).repeat_interleave(B).repeat_interleave(lengths)
    rows = torch.tensor([13, 9, 20, 13])[feats]
    values = (torch.rand(feats.numel()) * rows).long().to(KERNEL_DEVICE)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(KERNEL_DEVICE)
    psw = (torch.rand(values.numel()) + 0.5).to(KERNEL_DEVICE) if weighted else None
    weights = torch.randn(P.num_elements, device=KERNEL_DEVICE).to(dtype)
    w = (torch.rand(F, D) + 0.5).to(KERNEL_DEVICE) if affine else None
    b = torch.randn(F, D).to(KERNEL_DEVICE) if affine else None
    out = collection_forward(weights, values, offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec,
                             weight_sums=P.weight_sums, epilogue=(w, b, 1e-5, act))
    pooled = collection_reference(weights.double(), values, offsets, None if psw is None else psw.double(), P.meta,
                                  B, P.total_dim, P.max_dim).to(dtype).double()
    ref = layer_norm_act_reference(pooled.view(B, F, D), None if w is None else w.double(),
                                   None if b is None else b.double(), 1e-5, act).view(B, F * D)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_a_cpu_collection_of_one_width_pools_in_one_call_as_feature_by_feature(pooling, weighted, monkeypatch):
    """CPU tables of one width and one pooling: a small batch takes one native call over the flat
    buffer (collection_native's _one_call), a large one a call a feature; both give torch's own
    embedding_bag of each feature, in float64 (a table shared by two features, empty bags)."""
    import torch.nn.functional as F

    from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from embfuse.ops import collection

    tables = [EmbeddingBagConfig(30, 4, "t0", torch.float64, ["f0", "f2"], pooling=pooling),
              EmbeddingBagConfig(20, 4, "t1", torch.float64, ["f1"], pooling=pooling)]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    B = 5
    lengths = torch.randint(0, 4, (3 * B,))
    values = torch.randint(0, 20, (int(lengths.sum()),))
    w = torch.rand(values.numel(), dtype=torch.float64) + 0.5 if weighted else None
    kjt = KeyedJaggedTensor(["f0", "f2", "f1"], values, w, lengths=lengths)
    d, want = kjt.to_dict(), []
    for t, table in zip(tables, ebc.table_weights()):
        for name in t.feature_names:
            want.append(F.embedding_bag(d[name].values(), table, d[name].offsets(), mode=pooling,
                                        include_last_offset=True, per_sample_weights=d[name].weights_or_none()))
    want = torch.cat(want, 1)
    took = []
    one_call = collection._one_call
    monkeypatch.setattr(collection, "_one_call", lambda *a: took.append(one_call(*a)) or took[-1])
    with torch.no_grad():
        one = ebc(kjt).values()
        monkeypatch.setattr(tuning, "CPU_ONE_CALL_OUTPUT", 0)
        each = ebc(kjt).values()
    assert len(took) == 1 and took[0] is not None
    torch.testing.assert_close(one, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(each, want, rtol=1e-12, atol=1e-12)
    # a staged batch (fx.capture's buffer) holds values past its features' runs, pooled by no bag
    P = ebc._plan(kjt.keys(), ebc.weights.device)
    staged = torch.cat([values, torch.randint(0, 20, (7,))])
    staged_w = None if w is None else torch.cat([w, torch.full((7,), 100.0, dtype=torch.float64)])
    for cut in (tuning.CPU_ONE_CALL_OUTPUT, 1 << 30):
        monkeypatch.setattr(tuning, "CPU_ONE_CALL_OUTPUT", cut)
        got = collection.collection_native(ebc.weights.detach(), staged, kjt.offsets(), staged_w, P.meta, B,
                                           P.total_dim, P.max_dim)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(took) == 2 and took[1] is not None
    # bounds_check="off": an unchecked first offset past 0 skips the ids before it, on both paths
    late = kjt.offsets().clone()
    late[0] = 1
    each_and_one = []
    for cut in (0, 1 << 30):
        monkeypatch.setattr(tuning, "CPU_ONE_CALL_OUTPUT", cut)
        each_and_one.append(collection.collection_native(ebc.weights.detach(), values, late, w, P.meta, B,
                                                         P.total_dim, P.max_dim))
    torch.testing.assert_close(each_and_one[1], each_and_one[0], rtol=1e-12, atol=1e-12)
