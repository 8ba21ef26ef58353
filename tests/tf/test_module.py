"""SafeEmbeddingBag: the functional safe_embedding_lookup_sparse's numbers (itself checked
against TensorFlow), gradients, and the fused update against the rule applied by hand."""


import pytest
import torch

from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from embfuse.tf import SafeEmbeddingBag, safe_embedding_lookup_sparse
from tests.conftest import KERNEL_DEVICE
from tests.tf.test_lookup import batch, sparse
from tests.tolerances import assert_close

DEVICES = sorted({"cpu", KERNEL_DEVICE})


def _inputs(rank, weighted, total, seed, device, dtype=torch.float32):
    shape, entries = batch(rank, weighted, True, total, seed)
    ids = sparse([(at, i) for at, i, _ in entries], shape, device)
    w = sparse([(at, wt) for at, _, wt in entries], shape, device, dtype) if weighted else None
    return ids, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("default_id", [None, 2])
@pytest.mark.parametrize("rank", [2, 3])
def test_forward_and_gradient_are_the_functional_lookups(device, combiner, weighted, default_id, rank):
    torch.manual_seed(rank)
    m = SafeEmbeddingBag(17, 3, combiner, default_id, device=device)
    ids, w = _inputs(rank, weighted, 17, seed=rank * 13 + weighted, device=device)
    out = m(ids, w)
    table = m.weight.detach().double().requires_grad_()
    want = safe_embedding_lookup_sparse(table, ids, None if w is None else w.double(), combiner=combiner,
                                        default_id=default_id)
    assert out.shape == want.shape
    assert_close(out, want, torch.float32, reduction=4)
    g = torch.randn_like(want)
    out.backward(g.float())
    want.backward(g)
    assert_close(m.weight.grad, table.grad, torch.float32, reduction=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("rule", [SGD(lr=0.1), Adagrad(lr=0.1), Adam(lr=0.05),
                                  RowWiseAdagrad(lr=0.1, weight_decay=0.01)],
                         ids=["sgd", "adagrad", "adam", "rowwise-decay"])
def test_the_fused_update_is_the_rule_on_the_functional_gradient(device, combiner, rule):
    """Only the rows TensorFlow looks up move (Adam and weight decay would move a row handed a
    zero gradient: dropped ids and unused default ids must hand it none)."""
    torch.manual_seed(3)
    m = SafeEmbeddingBag(17, 4, combiner, default_id=5, optimizer=rule, device=device)
    table = m.weight.detach().double().clone()
    state = {k: v.double().clone().reshape(table.shape[0], -1).squeeze(1) for k, v in m.bag._fused.state.items()}
    for step in (1, 2):
        ids, w = _inputs(2, True, 17, seed=40 + step, device=device)
        g = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step)).to(device)
        (m(ids, w) * g.float()).sum().backward()
        ref = table.clone().requires_grad_()
        (safe_embedding_lookup_sparse(ref, ids, w.double(), combiner=combiner, default_id=5) * g).sum().backward()
        touched = ref.grad.abs().sum(1) > 0
        new, state_new = rule.update(table[touched], ref.grad[touched], {k: v[touched] for k, v in state.items()}, step)
        table[touched] = new
        for k in state:
            state[k][touched] = state_new[k]
        assert m.weight.grad is None
        assert_close(m.weight, table, torch.float32, reduction=8)


def test_ids_past_the_table_are_refused():
    m = SafeEmbeddingBag(10, 4)
    with pytest.raises(IndexError, match="out of range"):
        m(sparse([((0, 0), 3), ((1, 0), 10)], (2, 2)))
    with pytest.raises(ValueError, match="default_id 10 is out of range"):
        SafeEmbeddingBag(10, 4, default_id=10)


@pytest.mark.gpu
def test_the_training_step_never_synchronises():
    m = SafeEmbeddingBag(17, 4, "sqrtn", default_id=5, optimizer=Adagrad(lr=0.1), device="cuda")
    ids, w = _inputs(3, True, 17, seed=9, device="cuda")
    # weights built on the ids' own index tensor (as a loader makes both): nothing to compare
    w = torch.sparse_coo_tensor(ids._indices(), w._values(), w.shape)
    m(ids, w).sum().backward()  # compiled kernels, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            m(ids, w).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_batches_without_ids():
    none = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), (3, 2))
    m = SafeEmbeddingBag(10, 4, "mean", default_id=3, optimizer=SGD(lr=0.1))
    torch.testing.assert_close(m(none), m.weight[3].detach().expand(3, 4))  # every row the default
    assert SafeEmbeddingBag(10, 4, "sqrtn")(none).abs().sum() == 0
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), (0, 2))
    assert SafeEmbeddingBag(10, 4)(empty).shape == (0, 4)


def test_module_skips_the_sort_for_coalesced_input_and_pools_alike():
    g = torch.Generator().manual_seed(4)
    m = SafeEmbeddingBag(30, 3, "sqrtn", default_id=2)
    idx = torch.tensor([[3, 0, 1, 0, 3], [1, 0, 0, 2, 0]])
    ids = torch.randint(-1, 30, (5,), generator=g)
    w = torch.rand(5, generator=g) + 0.1
    shuffled = torch.sparse_coo_tensor(idx, ids, (5, 4))
    shuffled_w = torch.sparse_coo_tensor(idx, w, (5, 4))
    a = m(shuffled, shuffled_w)
    b = m(shuffled.coalesce(), shuffled_w.coalesce())
    torch.testing.assert_close(b, a)
