"""The fused training step under torch.compile(fullgraph=True): the lookup and its update are
opaque ops of the graph (optim/lookup.py), and a compiled model trains as the eager one does."""

import pytest
import torch

import embfuse
from embfuse.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse.optim import Adagrad, Adam, RowWiseAdagrad, SGD
from embfuse.sparse import KeyedJaggedTensor
from tests.conftest import DEVICES

OPTIMIZERS = [SGD(lr=0.1), Adagrad(lr=0.1, lr_decay=0.01), RowWiseAdagrad(lr=0.1), Adam(lr=0.05)]
OPT_IDS = ["sgd", "adagrad", "rowwise", "adam"]


class Collection(torch.nn.Module):
    """Two tables (sum and mean), weighted bags, a dense layer after the lookup."""

    def __init__(self, optimizer, device):
        super().__init__()
        tables = [EmbeddingBagConfig(100, 8, name="t0", feature_names=["f0"]),
                  EmbeddingBagConfig(50, 8, name="t1", feature_names=["f1"], pooling="mean")]
        self.ebc = EmbeddingBagCollection(tables, is_weighted=True, optimizer=optimizer, device=device)
        self.dense = torch.nn.Linear(16, 1, device=device)

    def forward(self, kjt):
        return self.dense(self.ebc(kjt).values()).square().sum()

    @staticmethod
    def batch(g, device):
        lengths = torch.randint(0, 5, (12,), generator=g)
        n = int(lengths.sum())
        kjt = KeyedJaggedTensor(["f0", "f1"], torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g),
                                lengths=lengths)
        return (kjt.to(device),)


class Bag(torch.nn.Module):
    """One table with per-sample weights that take a gradient."""

    def __init__(self, optimizer, device):
        super().__init__()
        self.bag = embfuse.nn.EmbeddingBag(40, 6, mode="sqrtn", optimizer=optimizer, device=device)

    def forward(self, ids, offsets, weights):
        return self.bag(ids, offsets, weights).square().sum()

    @staticmethod
    def batch(g, device):
        ids = torch.randint(0, 40, (11,), generator=g)
        weights = torch.rand(11, generator=g).to(device).requires_grad_()
        return ids.to(device), torch.tensor([0, 4, 4, 9], device=device), weights


class Rows(torch.nn.Module):
    """Plain lookups: one table with a padding row, and a collection of two."""

    def __init__(self, optimizer, device):
        super().__init__()
        self.emb = embfuse.nn.Embedding(40, 4, padding_idx=2, optimizer=optimizer, device=device)
        self.ec = EmbeddingCollection([EmbeddingConfig(30, 4, name="a", feature_names=["f0"]),
                                       EmbeddingConfig(20, 4, name="b", feature_names=["f1"])],
                                      optimizer=optimizer, device=device)

    def forward(self, ids, kjt):
        rows = self.emb(ids).square().sum()
        return rows + sum(jt.values().square().sum() for jt in self.ec(kjt).values())

    @staticmethod
    def batch(g, device):
        lengths = torch.randint(0, 4, (8,), generator=g)
        kjt = KeyedJaggedTensor(["f0", "f1"], torch.randint(0, 20, (int(lengths.sum()),), generator=g),
                                lengths=lengths)
        return torch.randint(0, 40, (3, 5), generator=g).to(device), kjt.to(device)


def train(make, compiled, device, steps=3):
    """The state after `steps` steps, and the per-sample weights' gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    step = torch.compile(model, fullgraph=True) if compiled else model
    g, grads = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = type(model).batch(g, device)
        step(*batch).backward()
        grads += [t.grad for t in batch if isinstance(t, torch.Tensor) and t.requires_grad]
    embfuse.check_errors()
    return model.state_dict(), grads


# every rule on the collection (one state tensor, two, one a row, none); each route on one rule
CASES = [pytest.param(Collection, opt, id=f"collection-{i}") for opt, i in zip(OPTIMIZERS, OPT_IDS)] + [
    pytest.param(Bag, OPTIMIZERS[3], id="bag-adam"), pytest.param(Rows, OPTIMIZERS[1], id="rows-adagrad")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,opt", CASES)
def test_a_compiled_step_trains_as_the_eager_one(device, kind, opt):
    eager, eager_grads = train(lambda: kind(opt, device), False, device)
    compiled, compiled_grads = train(lambda: kind(opt, device), True, device)
    start = kind(opt, device).state_dict()
    for k, v in eager.items():
        # Inductor may order the dense layer's arithmetic differently: fp32 rounding apart
        torch.testing.assert_close(compiled[k], v, rtol=1e-5, atol=1e-6, msg=k)
        if k.endswith("step"):
            assert int(v) == 3, k
    assert any(not torch.equal(v, start[k]) for k, v in eager.items() if v.is_floating_point())
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_batch_in_a_compiled_step_changes_no_row(device):
    """Nor the step count: the compiled backward's update finds its batch's check through the
    check op's status copy and takes its step back when the batch is found bad."""
    torch._dynamo.reset()
    model = Collection(Adagrad(lr=0.1), device)
    step = torch.compile(model, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    step(*Collection.batch(g, device)).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert [int(v) for k, v in before.items() if k.endswith("step")] == [1]
    (kjt,) = Collection.batch(g, device)
    values = kjt.values().clone()
    values[-1] = 100  # f1's table has 50 rows
    bad = KeyedJaggedTensor(kjt.keys(), values, kjt.weights(), lengths=kjt.lengths())
    with pytest.raises(IndexError, match="'f1'.*100"):
        step(bad).backward()
        embfuse.check_errors()
    for k, v in before.items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_a_compiled_step_is_not_taken_for_an_export(monkeypatch):
    """torch 2.11's dynamo takes torch.compiler.is_exporting() for True under torch.compile, where
    a fused lookup refuses to be exported: the lookup reads export's own flag instead."""
    # as torch 2.11's dynamo reads it: True inside any dynamo trace
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    torch._dynamo.reset()
    model = Bag(SGD(lr=0.1), "cpu")
    before = model.bag.weight.detach().clone()
    torch.compile(model, fullgraph=True)(*Bag.batch(torch.Generator().manual_seed(1), "cpu")).backward()
    assert not torch.equal(model.bag.weight, before)


def test_opcheck_of_the_fused_lookup_ops():
    from embfuse.optim.lookup import FusedOptimizer, _BagCall, _call

    w = torch.randn(20, 4)
    ids, offsets, psw = torch.randint(0, 20, (7,)), torch.tensor([0, 3, 3, 7]), torch.rand(7, requires_grad=True)
    # lr 0: opcheck runs the op and its backward several times and compares the outputs
    still = FusedOptimizer(SGD(lr=0.0), 20, 4, "cpu")
    call = _call(_BagCall, still, 3, -1)  # (sqrtn: the weights' gradient reads the output)
    torch.library.opcheck(torch.ops.embfuse.fused_lookup,
                          (still.anchor, w, [], ids, offsets, psw, None, call.handle, 0))
    # the update mutates the table and the state it declares, and nothing else
    fused = FusedOptimizer(Adagrad(lr=0.1), 20, 4, "cpu")
    call = _call(_BagCall, fused, 0, -1)
    torch.library.opcheck(torch.ops.embfuse.fused_update_, (w, list(fused.state.values()), ids, offsets, None,
                                                            torch.randn(3, 4), None, call.handle, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_copied_module_compiles_to_its_own_tables():
    """Compiled graphs name the optimizer and plan by an int (embfuse/_handles.py): a deep copy
    takes names of its own, so training the compiled copy leaves the original as it was."""
    import copy

    torch._dynamo.reset()
    model = Collection(SGD(lr=0.1), "cpu")
    g = torch.Generator().manual_seed(1)
    model(*Collection.batch(g, "cpu")).backward()  # (the original's plan and calls exist)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = copy.deepcopy(model)
    torch.compile(twin, fullgraph=True)(*Collection.batch(g, "cpu")).backward()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(twin.ebc.weights, model.ebc.weights)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [SGD(lr=0.1), Adam(lr=0.05)], ids=["sgd", "adam"])
def test_reduce_overhead_replays_the_fused_step(rule):
    """mode="reduce-overhead" (Inductor's CUDA graphs): warm-up, capture, then replays, each of
    which updates the tables as an eager step does. (A replay leaves the host's step count where
    the capture left it; Adam's bias corrections follow the GPU's count, which replays advance.)"""
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Collection(rule, "cuda")
        step = torch.compile(model, fullgraph=True, mode="reduce-overhead") if compiled else model
        batch = Collection.batch(torch.Generator().manual_seed(1), "cuda")  # one shape: one graph
        for _ in range(5):
            # (a dense .grad kept across steps would be a graph output the next replay overwrites)
            model.zero_grad(set_to_none=True)
            step(*batch).backward()
        embfuse.check_errors()
        return model.ebc.weights.detach().clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_reduce_overhead_replays_padded_batches_of_any_length():
    """Batches of other lengths padded to one capacity (PaddedKeyedJaggedTensor): one graph,
    replayed for every batch, training as the eager steps on the batches themselves do."""
    from torch._dynamo.utils import counters

    from embfuse.sparse import PaddedKeyedJaggedTensor

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Collection(SGD(lr=0.1), "cuda")
        step = torch.compile(model, fullgraph=True, mode="reduce-overhead") if compiled else model
        g = torch.Generator().manual_seed(1)
        graphs = []
        for _ in range(6):
            (kjt,) = Collection.batch(g, "cpu")
            batch = PaddedKeyedJaggedTensor.from_kjt(kjt, 64) if compiled else kjt
            model.zero_grad(set_to_none=True)
            step(batch.to("cuda")).backward()
            graphs.append(counters["stats"]["unique_graphs"])
        embfuse.check_errors()
        assert graphs[1] == graphs[-1], graphs
        return model.ebc.weights.detach().clone()

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", [None, SGD(lr=0.1)], ids=["autograd", "sgd"])
def test_reduce_overhead_one_feature(optimizer):
    """A collection of one table and one feature under reduce-overhead, with autograd gradients or
    a fused update: a check's error function must not keep the graph pool's offsets alive (Inductor
    refuses the recording then), the warm-up run's check included."""
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(1000, 16, name="t", feature_names=["f"])],
                                     optimizer=optimizer, device="cuda")
        step = torch.compile(ebc, fullgraph=True, mode="reduce-overhead") if compiled else ebc
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids = torch.randint(0, 1000, (9,), generator=g)
            kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.tensor([6, 1, 0, 2]))
            ebc.zero_grad(set_to_none=True)
            step(kjt.to("cuda")).values().square().sum().backward()
        embfuse.check_errors()
        grad = ebc.weights.grad
        return ebc.weights.detach().clone(), None if grad is None else grad.clone()

    (weights, grad), (eager_weights, eager_grad) = run(True), run(False)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-5, atol=1e-6)
    assert (grad is None) == (optimizer is not None)
    if grad is not None:
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
