"""The overlap pass on gloo (2 ranks): the traced graph's requests move before the ops that do
not need the lookup and the waits after them, and training through the rewritten graph gives the
eager model's losses, weights and tables bitwise."""

import copy

import torch
import torch.nn.functional as F

import embfuse.distributed as ed
from embfuse import EmbeddingBagCollection
from embfuse.fx import overlap_collectives
from embfuse.fx.overlap import STAGES
from embfuse.optim import Adagrad
from tests.distributed.test_pipeline import batches
from tests.distributed.test_sharded import PLANS, tables
from tests.distributed.worlds import run_world


class SparseFirst(torch.nn.Module):
    """Written as eager code often is: the lookup first, then the dense part that does not need it."""

    def __init__(self, sparse, width):
        super().__init__()
        self.sparse = sparse
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.top = torch.nn.Linear(4 + width, 1)

    def forward(self, b):
        pooled = self.sparse(b["sparse_features"]).values()
        dense = self.mlp(b["dense"])
        logit = self.top(torch.cat([dense, pooled], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logit, b["label"])


def _overlap(rank, world):
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables(), optimizer=Adagrad(lr=0.1))
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    eager = SparseFirst(ed.shard(copy.deepcopy(ebc), PLANS["mixed_unplaced"]), width)
    other = copy.deepcopy(eager)
    other.sparse = ed.shard(ebc, PLANS["mixed_unplaced"])
    gm = overlap_collectives(other)
    nodes = list(gm.graph.nodes)
    request, middle, wait = (next(i for i, n in enumerate(nodes) if n.target is f) for f in STAGES)
    mlp = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target.startswith("mlp")]
    assert request < min(mlp) and max(mlp) < wait and request < middle < wait, [n.format_node() for n in nodes]
    assert not any(n.op == "call_module" and n.target == "sparse" for n in nodes)
    opts = [torch.optim.SGD([p for n, p in m.named_parameters() if not n.startswith("sparse")], lr=0.1)
            for m in (eager, gm)]
    for b in batches(rank, 3):
        losses = []
        for m, opt in zip((eager, gm), opts):
            opt.zero_grad()
            loss = m(b)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), losses
    for (n, a), b in zip(gm.named_parameters(), eager.parameters()):
        if not n.startswith("sparse"):
            assert torch.equal(a, b), n
    want, got = eager.sparse.full_state_dict(), gm.sparse.full_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_the_overlap_pass_moves_requests_early_and_waits_late_and_changes_no_result():
    run_world(_overlap, 2)


def _compiled(rank, world):
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables(), optimizer=Adagrad(lr=0.1))
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    eager = SparseFirst(ed.shard(copy.deepcopy(ebc), PLANS["mixed_unplaced"]), width)
    other = copy.deepcopy(eager)
    other.sparse = ed.shard(ebc, PLANS["mixed_unplaced"])
    compiled = torch.compile(other)  # the dense parts compiled, the sharded call run eagerly between them
    for b in batches(rank, 3):
        losses = [m(b) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    want, got = eager.sparse.full_state_dict(), other.sparse.full_state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_model_with_a_sharded_collection_trains_under_torch_compile():
    run_world(_compiled, 2)
