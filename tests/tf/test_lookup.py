"""embfuse.tf against TensorFlow's documented results and a float64 oracle written entry by entry
from TensorFlow's rules (tf.compat.v1.nn.embedding_ops: combiners, pruning, fill_empty_rows,
clip_by_norm, mod/div partitions)."""

import itertools
import math

import pytest
import torch

import embfuse
from embfuse.tf import embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from tests.conftest import DEVICES
from tests.tolerances import assert_close


def sparse(entries, shape, device="cpu", dtype=torch.int64):
    """A torch sparse COO tensor from [(index tuple, value)] in the given (row-major) order."""
    idx = torch.tensor([list(i) for i, _ in entries], dtype=torch.int64).reshape(-1, len(shape)).T
    vals = torch.tensor([v for _, v in entries], dtype=dtype)
    return torch.sparse_coo_tensor(idx, vals, shape).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_tensorflows_documented_examples(device):
    """The examples of TensorFlow's docstrings for embedding_lookup_sparse (combiner mean,
    weighted) and safe_embedding_lookup_sparse (an id of -1 pruned, default_id 0)."""
    params = torch.randn(10, 4, dtype=torch.float64, device=device)
    at = [(0, 0), (0, 1), (1, 0), (2, 3)]
    weights = sparse(list(zip(at, [2.0, 0.5, 1.0, 3.0])), (3, 5), device, torch.float64)
    out = embedding_lookup_sparse(params, sparse(list(zip(at, [1, 3, 0, 1])), (3, 5), device), weights,
                                  combiner="mean")
    want = torch.stack([(params[1] * 2.0 + params[3] * 0.5) / 2.5, params[0], params[1]])
    torch.testing.assert_close(out, want)
    out = safe_embedding_lookup_sparse(params, sparse(list(zip(at, [1, 3, -1, 1])), (3, 5), device), weights,
                                       combiner="mean", default_id=0)
    torch.testing.assert_close(out, want)  # row 1: its only id pruned, the default id 0 with weight 1


@pytest.mark.parametrize("strategy,shards", [
    ("div", [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]),
    ("mod", [[0, 5, 10], [1, 6, 11], [2, 7, 12], [3, 8], [4, 9]]),
])
def test_partitions_follow_tensorflows_documented_layout(strategy, shards):
    """TensorFlow's embedding_lookup docstring: 13 ids over 5 shards."""
    params = [torch.tensor(s, dtype=torch.float64)[:, None] for s in shards]
    ids = torch.arange(13)
    assert torch.equal(embedding_lookup(params, ids, partition_strategy=strategy)[:, 0], ids.double())


def _clip(e, max_norm):
    if max_norm is None:
        return e
    norm = torch.sqrt((e * e).sum()) if bool((e * e).sum() > 0) else (e * e).sum()
    return e * max_norm / torch.clamp(norm, min=max_norm)


def _row_of(shards, i, strategy):
    P = len(shards)
    if P == 1:
        return shards[0][i]
    if strategy == "mod":
        return shards[i % P][i // P]
    total = sum(s.shape[0] for s in shards)
    q, r = divmod(total, P)
    for p in range(P):  # shard p holds ids [start, start + size)
        start, size = p * q + min(p, r), q + (p < r)
        if start <= i < start + size:
            return shards[p][i - start]
    raise AssertionError(i)


def oracle(shards, entries, batch_shape, combiner, default_id, max_norm, strategy, safe):
    """TensorFlow's rules entry by entry: entries = [(output row, id, weight or None)]."""
    D = shards[0].shape[1]
    out = []
    for r in range(math.prod(batch_shape)):
        mine = [(i, w) for row, i, w in entries if row == r]
        if safe:
            mine = [(i, w) for i, w in mine if i >= 0 and (w is None or combiner == "sum" or w > 0)]
            if not mine and default_id is not None:
                mine = [(default_id, None if entries and entries[0][2] is None else 1.0)]
        ws = [torch.tensor(1.0, dtype=torch.float64) if w is None else w for _, w in mine]
        total = sum((w * _clip(_row_of(shards, i, strategy).double(), max_norm) for (i, _), w in zip(mine, ws)),
                    torch.zeros(D, dtype=torch.float64))
        div = {"sum": 1.0, "mean": sum(ws, torch.tensor(0.0, dtype=torch.float64)),
               "sqrtn": torch.sqrt(sum((w * w for w in ws), torch.tensor(0.0, dtype=torch.float64)))}[combiner]
        out.append(total / div if (combiner == "sum" or div != 0) else total * 0)
    return torch.stack(out).reshape(*batch_shape, D)


def safe_lookup_grid(test):
    """combiner x weighted x default_id x max_norm x partitions x rank, the grid both the oracle
    test and the comparison with TensorFlow itself run."""
    for mark in (pytest.mark.parametrize("rank", [2, 3]),
                 pytest.mark.parametrize("strategy,num_shards",
                                         [("div", 1), ("div", 3), ("mod", 3), ("div", 5), ("mod", 5)]),
                 pytest.mark.parametrize("max_norm", [None, 0.7]), pytest.mark.parametrize("default_id", [None, 2]),
                 pytest.mark.parametrize("weighted", [False, True]),
                 pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])):
        test = mark(test)
    return test


def batch(rank, weighted, safe, total, seed):
    """Random sparse ids (rank 2 or 3, row-major, empty rows included) and weights."""
    g = torch.Generator().manual_seed(seed)
    shape = (4, 5) if rank == 2 else (2, 3, 4)
    entries = []
    for at in itertools.product(*(range(s) for s in shape)):
        if at[:-1] == (1,) * (rank - 1) or torch.rand((), generator=g) < 0.5:
            continue  # row 1 (1, 1) stays empty, the rest half full
        i = int(torch.randint(-1 if safe else 0, total, (), generator=g))
        w = float(torch.rand((), generator=g)) * 1.2 - 0.2 if weighted else None
        entries.append((at, i, w))
    return shape, entries


@pytest.mark.parametrize("device", DEVICES)
@safe_lookup_grid
def test_safe_lookup_matches_tensorflows_rules(device, combiner, weighted, default_id, max_norm, strategy,
                                               num_shards, rank):
    sizes = {1: [17], 3: [5, 4, 4], 5: [4, 4, 4, 4, 3]}[num_shards]
    total = sum(sizes)
    shards = [torch.randn(n, 3, dtype=torch.float64, device=device, requires_grad=True) for n in sizes]
    shape, entries = batch(rank, weighted, True, total, seed=rank * 7 + num_shards)
    ids = sparse([(at, i) for at, i, _ in entries], shape, device)
    w = sparse([(at, wt) for at, _, wt in entries], shape, device, torch.float64) if weighted else None
    params = shards[0] if num_shards == 1 else shards
    out = safe_embedding_lookup_sparse(params, ids, w, combiner=combiner, default_id=default_id, max_norm=max_norm,
                                       partition_strategy=strategy)
    flat = [(sum(a * math.prod(shape[k + 1:-1]) for k, a in enumerate(at[:-1])), i,
             None if wt is None else torch.tensor(wt, dtype=torch.float64)) for at, i, wt in entries]
    cpu_shards = [s.detach().cpu().requires_grad_() for s in shards]
    want = oracle(cpu_shards, flat, shape[:-1], combiner, default_id, max_norm, strategy, safe=True)
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu(), want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    got = torch.autograd.grad(out, shards, g.to(device), allow_unused=True)
    expect = torch.autograd.grad(want, cpu_shards, g, allow_unused=True)
    for a, b in zip(got, expect):
        a = torch.zeros_like(shards[0][:0]) if a is None else a
        b = torch.zeros_like(a).cpu() if b is None else b
        torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("default_id,max_norm,num_shards", [(None, None, 1), (2, None, 1), (2, 0.7, 3)])
def test_sparse_weights_get_tensorflows_gradient(device, combiner, default_id, max_norm, num_shards):
    """Coalesced sparse_weights that require a gradient get one, as TensorFlow's do (pruned entries
    a zero): against the oracle's, entry by entry, float64. Uncoalesced ones are refused, as is
    a gradient through the module (its values would reach the lookup detached)."""
    sizes = {1: [17], 3: [5, 4, 4]}[num_shards]
    shards = [torch.randn(n, 3, dtype=torch.float64, device=device) for n in sizes]
    shape, entries = batch(2, True, True, sum(sizes), seed=11 + num_shards)  # row-major, unique: coalesced order
    ids = sparse([(at, i) for at, i, _ in entries], shape, device).coalesce()
    w = sparse([(at, wt) for at, _, wt in entries], shape, device, torch.float64).coalesce().requires_grad_()
    params = shards[0] if num_shards == 1 else shards
    out = safe_embedding_lookup_sparse(params, ids, w, combiner=combiner, default_id=default_id, max_norm=max_norm,
                                       partition_strategy="div")
    g = torch.randn(out.shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, w, g.to(device))
    ws = [torch.tensor(wt, dtype=torch.float64, requires_grad=True) for *_, wt in entries]
    flat = [(at[0], i, wt) for (at, i, _), wt in zip(entries, ws)]
    want = oracle([s.cpu() for s in shards], flat, shape[:-1], combiner, default_id, max_norm, "div", safe=True)
    expect = torch.autograd.grad(want, ws, g, allow_unused=True)
    expect = torch.stack([torch.zeros((), dtype=torch.float64) if e is None else e for e in expect])
    assert torch.equal(got.coalesce().indices().cpu(), ids.indices().cpu())
    torch.testing.assert_close(got.coalesce().values().cpu(), expect, rtol=1e-10, atol=1e-12)
    assert expect.abs().sum() > 0
    loose_ids = sparse([(at, i) for at, i, _ in entries], shape, device)
    loose_w = sparse([(at, wt) for at, _, wt in entries], shape, device, torch.float64).requires_grad_()
    with pytest.raises(NotImplementedError, match="must be coalesced"):
        safe_embedding_lookup_sparse(params, loose_ids, loose_w)
    with torch.no_grad():  # (no gradient asked: no refusal)
        safe_embedding_lookup_sparse(params, loose_ids, loose_w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookup_sparse_in_low_precision_matches_float64(device, dtype, combiner):
    """embedding_lookup_sparse: trailing empty rows dropped, inner ones zeros; fp16/bf16 tables
    pooled in fp32 (the one-table path through embfuse's embedding_bag)."""
    table = torch.randn(20, 8, device=device)
    entries = [((0, 0), 3, 0.5), ((0, 1), 7, 2.0), ((2, 0), 3, 1.0), ((2, 1), 3, 0.25), ((2, 4), 19, 1.5)]
    ids = sparse([(at, i) for at, i, _ in entries], (6, 5), device)
    w = sparse([(at, wt) for at, _, wt in entries], (6, 5), device, torch.float32).to(dtype)
    out = embedding_lookup_sparse(table.to(dtype), ids, w, combiner=combiner)
    assert out.shape == (3, 8) and out.dtype == dtype
    # the oracle reads the table as stored (rounded to dtype), in float64
    want = oracle([table.to(dtype).double().cpu()], [(at[0], i, torch.tensor(wt).to(dtype).double())
                                                     for at, i, wt in entries],
                  (3,), combiner, None, None, "mod", safe=False)
    assert_close(out, want, dtype, reduction=3)


def test_bad_input_is_refused_clearly():
    table = torch.randn(10, 4)
    ids = sparse([((0, 0), 3), ((1, 0), 10)], (2, 2))
    with pytest.raises(IndexError, match="id 10 at position 1 is out of range for a table of 10 rows"):
        embedding_lookup_sparse(table, ids, None)
    with pytest.raises(ValueError, match="shard 1 is .* shards share a width"):
        safe_embedding_lookup_sparse([table, torch.randn(3, 5)], sparse([((0, 0), 1)], (1, 2)))
    with pytest.raises(ValueError, match="same indices as sparse_ids"):
        safe_embedding_lookup_sparse(table, sparse([((0, 0), 1)], (1, 2)),
                                     sparse([((0, 1), 1.0)], (1, 2), dtype=torch.float32))
    with pytest.raises(ValueError, match="shard 0 has 10 rows; 2 shards of 13 rows in all hold 7"):
        embedding_lookup([table, torch.randn(3, 4)], torch.tensor([1]))
    with pytest.raises(ValueError, match="rank 2 or more"):
        safe_embedding_lookup_sparse(table, torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1]), (3,)))
    with pytest.raises(TypeError, match="sparse COO tensor"):
        safe_embedding_lookup_sparse(table, torch.tensor([[1, 2]]))
    w = sparse([((0, 0), 0.5)], (1, 2), dtype=torch.float32).coalesce().requires_grad_()
    with pytest.raises(NotImplementedError, match="sparse_weights get no gradient from SafeEmbeddingBag"):
        embfuse.tf.SafeEmbeddingBag(10, 4)(sparse([((0, 0), 1)], (1, 2)).coalesce(), w)
    with pytest.raises(ValueError, match="combiner must be one of"):
        safe_embedding_lookup_sparse(table, ids, combiner="max")
    with pytest.raises(IndexError, match="default_id 12 is out of range"):
        safe_embedding_lookup_sparse(table, sparse([((0, 0), 1)], (1, 2)), default_id=12)
    before = table.clone()
    safe_embedding_lookup_sparse(table, sparse([((0, 0), 1)], (1, 2)), max_norm=0.1)
    assert torch.equal(table, before)  # TensorFlow clips a copy; the table is never renormed


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_id_is_named_at_the_callers_position(device):
    """Entries not in row order are sorted into bags; the error still names the entry where the
    caller put it (values[1] here), in the function and the module, deferred or not."""
    table = torch.randn(10, 4, device=device)
    sp = sparse([((1, 0), 3), ((0, 0), 50), ((0, 1), 2)], (2, 2), device)
    for lookup in (lambda: safe_embedding_lookup_sparse(table, sp),
                   lambda: embfuse.tf.SafeEmbeddingBag(10, 4, device=device)(sp)):
        with pytest.raises(IndexError, match=r"values\[1\] = 50 \(sample 0\)"):
            lookup()
            embfuse.check_errors()


def test_module_level_access():
    assert embfuse.tf.safe_embedding_lookup_sparse is safe_embedding_lookup_sparse


@pytest.mark.parametrize("device", DEVICES)
def test_edge_batches(device):
    """Every id pruned (zeros, or the default id's row), no ids at all, and entries not in
    row-major order (pooled alike)."""
    t = torch.randn(5, 3, device=device)
    pruned = sparse([((0, 0), -1), ((1, 0), -1)], (3, 2), device)
    for combiner in ("sum", "mean", "sqrtn"):
        assert torch.equal(safe_embedding_lookup_sparse(t, pruned, combiner=combiner), torch.zeros(3, 3, device=device))
        torch.testing.assert_close(safe_embedding_lookup_sparse(t, pruned, combiner=combiner, default_id=1),
                                   t[1].expand(3, 3))
    none = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                   (3, 2)).to(device)
    assert embedding_lookup_sparse(t, none, None).shape == (0, 3)
    assert torch.equal(safe_embedding_lookup_sparse(t, none), torch.zeros(3, 3, device=device))
    unordered = sparse([((2, 0), 1), ((0, 0), 2), ((2, 1), 4)], (3, 2), device)
    torch.testing.assert_close(embedding_lookup_sparse(t, unordered, None, combiner="sum"),
                               torch.stack([t[2], torch.zeros(3, device=device), t[1] + t[4]]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_partitioned_lookup_that_reads_no_row_stays_differentiable(device):
    """Every id or weight pruned, or no ids: zeros that still backpropagate (zero gradients), as
    TensorFlow's and torch's lookups do, so a training step on such a batch does not fail."""
    shards = [torch.randn(3, 2, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2)]
    ids = sparse([((0, 0), 1), ((1, 0), 2)], (2, 2), device)
    w = sparse([((0, 0), -1.0), ((1, 0), 0.0)], (2, 2), device, torch.float64)
    outs = [safe_embedding_lookup_sparse(shards, ids, w, combiner=c) for c in ("mean", "sqrtn")]
    outs.append(embedding_lookup(shards, torch.zeros(0, dtype=torch.long, device=device)))
    for out in outs:
        grads = torch.autograd.grad(out.sum(), shards, allow_unused=True)
        assert all(g is not None and torch.equal(g, torch.zeros_like(s)) for g, s in zip(grads, shards))

@pytest.mark.parametrize("device", DEVICES)
def test_sum_keeps_zero_weights_so_their_row_is_not_empty(device):
    """TensorFlow prunes weights <= 0 only for mean and sqrtn: with sum a weight of 0 is an entry,
    so its row is not empty and gets no default id (it pools to 0)."""
    t = torch.randn(5, 3, device=device)
    ids = sparse([((0, 0), 3), ((1, 0), 2)], (2, 2), device)
    w = sparse([((0, 0), 0.0), ((1, 0), 2.0)], (2, 2), device, torch.float32)
    out = safe_embedding_lookup_sparse(t, ids, w, combiner="sum", default_id=4)
    torch.testing.assert_close(out, torch.stack([torch.zeros(3, device=device), 2 * t[2]]))
    out = safe_embedding_lookup_sparse(t, ids, w, combiner="mean", default_id=4)  # pruned: the default
    torch.testing.assert_close(out, torch.stack([t[4], t[2]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_coalesced_input_skips_the_sort_and_pools_alike(device, combiner):
    """A coalesced sparse tensor (sorted, unique indices: TensorFlow's canonical order) takes the
    path without the row sort; a shuffled one with the same entries pools the same."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(40, 4, device=device, dtype=torch.float64)
    entries = [((r, c), int(torch.randint(-1, 40, (), generator=g))) for r in range(6) for c in range(3)
               if r != 2 and torch.rand((), generator=g) < 0.7]
    weights = [(at, float(torch.rand((), generator=g)) + 0.1) for at, _ in entries]
    perm = torch.randperm(len(entries), generator=g).tolist()
    shuffled = sparse([entries[k] for k in perm], (6, 3), device)
    shuffled_w = sparse([weights[k] for k in perm], (6, 3), device, torch.float64)
    ordered, ordered_w = shuffled.coalesce(), shuffled_w.coalesce()
    assert ordered.is_coalesced() and not shuffled.is_coalesced()
    a = safe_embedding_lookup_sparse(t, shuffled, shuffled_w, combiner=combiner, default_id=5)
    b = safe_embedding_lookup_sparse(t, ordered, ordered_w, combiner=combiner, default_id=5)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
