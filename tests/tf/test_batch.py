"""keyed_batch + an EmbeddingBagCollection of TensorFlow-style tables: every feature's output is
safe_embedding_lookup_sparse's (itself checked against TensorFlow), in one collection call."""

import pytest
import torch

import embfuse
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig
from embfuse.ops.errors import BadArgumentError
from embfuse.optim import Adagrad
from embfuse.tf import keyed_batch, safe_embedding_lookup_sparse
from tests.conftest import KERNEL_DEVICE
from tests.tf.test_lookup import batch, sparse
from tests.tolerances import assert_close

DEVICES = sorted({"cpu", KERNEL_DEVICE})
# feature -> (rows, combiner, default id)
FEATURES = {"a": (17, "mean", 5), "b": (11, "sqrtn", None), "c": (13, "sum", 0), "d": (9, "mean", None)}


def _sparse_batch(weighted, device, B=None):
    ids, weights = {}, {}
    for seed, (f, (rows, _, _)) in enumerate(FEATURES.items()):
        shape, entries = batch(2, weighted, True, rows, seed)
        if B is not None:
            shape = (B, shape[1])
            entries = [e for e in entries if e[0][0] < B]
        ids[f] = sparse([(at, i) for at, i, _ in entries], shape, device)
        if weighted:
            weights[f] = torch.sparse_coo_tensor(ids[f]._indices(), torch.tensor(
                [w for _, _, w in entries], dtype=torch.float32, device=device), shape)
    if "b" in ids:  # one feature in an order that is not row-major
        perm = torch.randperm(ids["b"]._nnz(), device=device)
        idx = ids["b"]._indices()[:, perm]
        ids["b"] = torch.sparse_coo_tensor(idx, ids["b"]._values()[perm], ids["b"].shape)
        if weighted:
            weights["b"] = torch.sparse_coo_tensor(idx, weights["b"]._values()[perm], ids["b"].shape)
    return ids, (weights if weighted else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_a_collection_of_tensorflow_tables_is_one_safe_lookup_a_feature(device, weighted):
    tables = [EmbeddingBagConfig(rows, 4, f"t{f}", feature_names=[f], combiner=c, default_id=d)
              for f, (rows, c, d) in FEATURES.items()]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, device=device)
    ids, weights = _sparse_batch(weighted, device, B=6)
    out = ebc(keyed_batch(ids, weights)).to_dict()
    for (f, (_, c, d)), w in zip(FEATURES.items(), ebc.table_weights()):
        want = safe_embedding_lookup_sparse(w.double(), ids[f], None if weights is None else weights[f], c, d)
        assert_close(out[f], want, torch.float32, reduction=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_a_compiled_collection_of_tensorflow_tables(device, weighted):
    """torch.compile does not trace sparse tensors (torch's rule): a model compiled whole
    (fullgraph) takes the keyed batch made outside it, and its collection of TensorFlow-style
    tables pools as the eager one does, for a second batch too."""
    tables = [EmbeddingBagConfig(rows, 4, f"t{f}", feature_names=[f], combiner=c, default_id=d)
              for f, (rows, c, d) in FEATURES.items()]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, device=device)
    pooled = torch.compile(lambda kjt: ebc(kjt).values(), fullgraph=True)
    for B in (6, 3):
        kjt = keyed_batch(*_sparse_batch(weighted, device, B=B))
        assert_close(pooled(kjt), ebc(kjt).values(), torch.float32, reduction=8)


@pytest.mark.gpu
def test_the_collections_training_step_never_synchronises():
    tables = [EmbeddingBagConfig(rows, 4, f"t{f}", feature_names=[f], combiner=c, default_id=d)
              for f, (rows, c, d) in FEATURES.items()]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, device="cuda", optimizer=Adagrad(lr=0.1))
    ids, weights = _sparse_batch(True, "cuda", B=6)
    ebc(keyed_batch(ids, weights)).values().sum().backward()  # compiled kernels, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ebc(keyed_batch(ids, weights)).values().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    embfuse.check_errors()


def test_keyed_batch_refuses_what_it_cannot_pool():
    ids, _ = _sparse_batch(False, "cpu", B=6)
    with pytest.raises(BadArgumentError, match="2-D"):
        keyed_batch({"x": sparse([((0, 0, 0), 1)], (2, 2, 2))})
    with pytest.raises(BadArgumentError, match="has 5 rows; the features before it have 6"):
        keyed_batch({**ids, "x": sparse([((0, 0), 1)], (5, 2))})
    with pytest.raises(BadArgumentError, match="weights must have the features"):
        keyed_batch(ids, {"a": ids["a"]})
    with pytest.raises(ValueError, match="at least one"):
        keyed_batch({})
