"""The overlap pass on gloo (2 ranks): the traced graph's requests move before the ops that do
not need the lookup and the waits after them, and training through the rewritten graph gives the
eager model's losses, weights and tables bitwise."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from embfuse.fx import overlap_collectives
from embfuse.fx.overlap import STAGES
from tests.distributed.test_pipeline import batches
from tests.distributed.twins import assert_trained_alike, dense, twins
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


def _overlap(rank, world, device="cpu", vbe=False):
    eager, other = twins(SparseFirst, device=device)
    gm = overlap_collectives(other)
    nodes = list(gm.graph.nodes)
    request, middle, send, wait = (next(i for i, n in enumerate(nodes) if n.target is f) for f in STAGES)
    mlp = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target.startswith("mlp")]
    assert request < min(mlp) and max(mlp) < wait and request < middle < wait, [n.format_node() for n in nodes]
    assert send == middle + 1 and min(mlp) < middle < max(mlp), [n.format_node() for n in nodes]
    assert not any(n.op == "call_module" and n.target == "sparse" for n in nodes)
    opts = [torch.optim.SGD(dense(m), lr=0.1) for m in (eager, gm)]
    for b in batches(rank, 3, vbe=vbe):
        b = {k: v.to(device) for k, v in b.items()}
        losses = []
        for m, opt in zip((eager, gm), opts):
            opt.zero_grad()
            loss = m(b)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), losses
    assert_trained_alike(eager, gm)


@pytest.mark.parametrize("vbe", [False, True])
def test_the_overlap_pass_moves_requests_early_and_waits_late_and_changes_no_result(vbe):
    """`vbe`: batches whose features have their own batch sizes (their output rows travel from
    the request to the wait)."""
    run_world(_overlap, 2, "cpu", vbe)


def _compiled(rank, world, overlap, device="cpu", vbe=False):
    from torch._inductor.compile_fx import compile_fx

    eager, other = twins(SparseFirst, device=device)
    # the dense parts compiled; the sharded call (or the pass's request and lookup, in the pass's
    # order) run eagerly between them; with the pass, the send and the wait are compiled
    seen = []

    def inductor(gm, example_inputs):
        seen.append(gm)
        return compile_fx(gm, example_inputs)

    model = overlap_collectives(other, functional=overlap == "functional") if overlap else other
    compiled = torch.compile(model, backend=inductor)
    graphs = []
    for b in batches(rank, 3, vbe=vbe):
        b = {k: v.to(device) for k, v in b.items()}
        losses = [m(b) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], graphs  # batches of other sizes compile nothing again
    assert_trained_alike(eager, other, exact=False)
    functional = [gm for gm in seen if any("all_to_all_single" in str(n.target) for n in gm.graph.nodes)]
    if world == 1:  # one rank sends nothing: its pooled rows are its output
        assert not functional
    elif overlap == "functional":  # the pooled rows' all-to-all inside a compiled region, with the layers after it
        assert functional and any(any(n.op == "call_module" or "linear" in str(n.target) for n in gm.graph.nodes)
                                  for gm in functional), [gm.code for gm in seen]
    else:
        assert not functional


@pytest.mark.parametrize("overlap,vbe", [(False, False), (True, False), ("functional", False), ("functional", True)])
def test_a_model_with_a_sharded_collection_trains_under_torch_compile(overlap, vbe):
    run_world(_compiled, 2, overlap, "cpu", vbe)
