"""Two models from one start, each holding its own sharding of one collection, and the check
that they trained alike (the dense weights, then every table and optimizer state)."""

import copy

import torch

import embfuse.distributed as ed
from embfuse import EmbeddingBagCollection
from embfuse.optim import Adagrad
from tests.distributed.test_sharded import PLANS, tables


def twins(make, plan="mixed_unplaced", device="cpu"):
    """make(sharded collection, its pooled width) -> model with the collection as `.sparse`."""
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables(), optimizer=Adagrad(lr=0.1), device=device)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    a = make(ed.shard(copy.deepcopy(ebc), PLANS[plan]), width).to(device)
    b = copy.deepcopy(a)
    b.sparse = ed.shard(ebc, PLANS[plan])  # (a deep copy would share the process group's state)
    return a, b


def dense(model):
    return [p for n, p in model.named_parameters() if not n.startswith("sparse")]


def assert_trained_alike(a, b, exact=True):
    check = torch.equal if exact else lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    for x, y in zip(dense(a), dense(b)):
        assert check(x, y)
    want, got = a.sparse.full_state_dict(), b.sparse.full_state_dict()
    for k in want:
        assert check(got[k], want[k]), k
