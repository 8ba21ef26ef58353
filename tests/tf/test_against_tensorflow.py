"""embfuse.tf against TensorFlow itself, where it is installed (`pip install tensorflow-cpu`; CI
does not need it, and these tests are skipped there): random batches through both, float64
tables, outputs and the gradients of the tables and of the sparse weights compared."""


import numpy as np
import pytest
import torch

from embfuse.tf import embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from tests.tf.test_lookup import safe_lookup_grid, batch, sparse

tf = pytest.importorskip("tensorflow", reason="the optional comparison with TensorFlow: pip install tensorflow-cpu")


def _tf_sparse(shape, entries, values):
    indices = np.array([list(at) for at, *_ in entries], dtype=np.int64).reshape(-1, len(shape))
    return tf.SparseTensor(indices, np.array(values), shape)


def _tf_run(fn, shards, g):
    """TensorFlow's output and the gradients of sum(out * g) with respect to each shard (dense)."""
    variables = [tf.Variable(s.detach().numpy()) for s in shards]
    with tf.GradientTape() as tape:
        out = fn(variables if len(variables) > 1 else variables[0])
        loss = tf.reduce_sum(out * g.numpy())
    grads = tape.gradient(loss, variables)
    return out.numpy(), [np.zeros(v.shape) if d is None else tf.convert_to_tensor(d).numpy()
                         for v, d in zip(variables, grads)]



@safe_lookup_grid
def test_safe_embedding_lookup_sparse_gives_tensorflows_numbers(combiner, weighted, default_id, max_norm, strategy,
                                                                num_shards, rank):
    sizes = {1: [17], 3: [5, 4, 4], 5: [4, 4, 4, 4, 3]}[num_shards]
    torch.manual_seed(num_shards * 10 + rank)
    shards = [torch.randn(n, 3, dtype=torch.float64, requires_grad=True) for n in sizes]
    shape, entries = batch(rank, weighted, True, sum(sizes), seed=rank * 7 + num_shards + 100)
    ids = sparse([(at, i) for at, i, _ in entries], shape)
    w = sparse([(at, wt) for at, _, wt in entries], shape, dtype=torch.float64) if weighted else None
    params = shards[0] if num_shards == 1 else shards
    out = safe_embedding_lookup_sparse(params, ids, w, combiner=combiner, default_id=default_id, max_norm=max_norm,
                                       partition_strategy=strategy)
    g = torch.randn(out.shape, dtype=torch.float64)
    tf_ids = _tf_sparse(shape, entries, [i for _, i, _ in entries])
    tf_w = _tf_sparse(shape, entries, [wt for *_, wt in entries]) if weighted else None
    want, want_grads = _tf_run(lambda p: tf.compat.v1.nn.safe_embedding_lookup_sparse(
        p, tf_ids, tf_w, combiner=combiner, default_id=default_id, max_norm=max_norm,
        partition_strategy=strategy), shards, g)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, shards, g, allow_unused=True)
    for a, b, s in zip(got, want_grads, shards):
        np.testing.assert_allclose(torch.zeros_like(s) if a is None else a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("strategy,num_shards", [("mod", 1), ("mod", 3), ("div", 3)])
def test_embedding_lookup_sparse_gives_tensorflows_numbers(combiner, weighted, strategy, num_shards):
    sizes = {1: [17], 3: [6, 6, 5]}[num_shards]
    torch.manual_seed(num_shards + 50)
    shards = [torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in sizes]
    shape, entries = batch(2, weighted, False, sum(sizes), seed=num_shards + 300)
    entries = [e for e in entries if e[2] is None or e[2] > 0]  # (weights <= 0 are TF's undefined ground here)
    ids = sparse([(at, i) for at, i, _ in entries], shape)
    w = sparse([(at, wt) for at, _, wt in entries], shape, dtype=torch.float64) if weighted else None
    params = shards[0] if num_shards == 1 else shards
    out = embedding_lookup_sparse(params, ids, w, combiner=combiner, partition_strategy=strategy)
    g = torch.randn(out.shape, dtype=torch.float64)
    tf_ids = _tf_sparse(shape, entries, [i for _, i, _ in entries])
    tf_w = _tf_sparse(shape, entries, [wt for *_, wt in entries]) if weighted else None
    want, want_grads = _tf_run(lambda p: tf.compat.v1.nn.embedding_lookup_sparse(
        p, tf_ids, tf_w, combiner=combiner, partition_strategy=strategy), shards, g)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, shards, g, allow_unused=True)
    for a, b, s in zip(got, want_grads, shards):
        np.testing.assert_allclose(torch.zeros_like(s) if a is None else a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("default_id", [None, 2])
@pytest.mark.parametrize("max_norm", [None, 0.7])
@pytest.mark.parametrize("strategy,num_shards,rank", [("div", 1, 2), ("mod", 3, 2), ("div", 3, 3)])
def test_sparse_weights_get_tensorflows_gradient(combiner, default_id, max_norm, strategy, num_shards, rank):
    """The gradient of sum(out * g) with respect to sparse_weights' values (coalesced: the order
    batch() makes them in), TensorFlow's against ours."""
    sizes = {1: [17], 3: [5, 4, 4]}[num_shards]
    torch.manual_seed(num_shards * 10 + rank + 400)
    shards = [torch.randn(n, 3, dtype=torch.float64) for n in sizes]
    shape, entries = batch(rank, True, True, sum(sizes), seed=rank * 7 + num_shards + 400)
    ids = sparse([(at, i) for at, i, _ in entries], shape).coalesce()
    w = sparse([(at, wt) for at, _, wt in entries], shape, dtype=torch.float64).coalesce().requires_grad_()
    params = shards[0] if num_shards == 1 else shards
    out = safe_embedding_lookup_sparse(params, ids, w, combiner=combiner, default_id=default_id, max_norm=max_norm,
                                       partition_strategy=strategy)
    g = torch.randn(out.shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, w, g)
    values = tf.Variable(np.array([wt for *_, wt in entries]))
    tf_ids = _tf_sparse(shape, entries, [i for _, i, _ in entries])
    tf_params = [tf.constant(s.numpy()) for s in shards]
    with tf.GradientTape() as tape:
        tf_w = tf.SparseTensor(_tf_sparse(shape, entries, [0.0] * len(entries)).indices, values, shape)
        tf_out = tf.compat.v1.nn.safe_embedding_lookup_sparse(
            tf_params if num_shards > 1 else tf_params[0], tf_ids, tf_w, combiner=combiner, default_id=default_id,
            max_norm=max_norm, partition_strategy=strategy)
        loss = tf.reduce_sum(tf_out * g.numpy())
    want = tf.convert_to_tensor(tape.gradient(loss, values)).numpy()
    np.testing.assert_allclose(got.coalesce().values().numpy(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ["mod", "div"])
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_embedding_lookup_gives_tensorflows_numbers(strategy, max_norm):
    torch.manual_seed(7)
    shards = [torch.randn(n, 5, dtype=torch.float64, requires_grad=True) for n in (4, 4, 3)]
    ids = torch.randint(0, 11, (3, 4))
    out = embedding_lookup(shards, ids, partition_strategy=strategy, max_norm=max_norm)
    g = torch.randn(out.shape, dtype=torch.float64)
    want, want_grads = _tf_run(lambda p: tf.compat.v1.nn.embedding_lookup(
        p, ids.numpy(), partition_strategy=strategy, max_norm=max_norm), shards, g)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, shards, g)
    for a, b in zip(got, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
