"""The collections' TorchRec surface: features shared by tables, EmbeddingCollection's
need_indices, the per-table views, the meta device and torch.fx tracing."""

import pytest
import torch

import embfuse
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse import KeyedJaggedTensor
from embfuse.optim import SGD
from tests.conftest import DEVICES


def shared_tables(dtype=torch.float64):
    # f1 is looked up by both tables (TorchRec names its outputs f1@t1 and f1@t2)
    return [EmbeddingBagConfig(10, 3, "t1", dtype, ["f1", "f3"]),
            EmbeddingBagConfig(12, 4, "t2", dtype, ["f2", "f1"], pooling="mean")]


def batch(device):
    keys, B = ["f3", "f1", "f2"], 4  # not the collection's order
    lengths = torch.tensor([1, 0, 2, 3, 2, 2, 0, 1, 3, 1, 1, 0])
    values = torch.randint(0, 10, (int(lengths.sum()),))
    return KeyedJaggedTensor(keys, values, lengths=lengths, stride=B).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", [None, SGD(lr=0.5)], ids=["grad", "sgd"])
def test_a_feature_shared_by_two_tables_is_looked_up_in_each(device, rule):
    ebc = EmbeddingBagCollection(shared_tables(), device=device, optimizer=rule)
    assert ebc.embedding_names_by_table() == [["f1@t1", "f3"], ["f2", "f1@t2"]]
    kjt = batch(device)
    before = [w.detach().clone().requires_grad_() for w in ebc.table_weights()]
    d, want = kjt.to_dict(), []
    for t, w in zip(ebc.tables, before):
        for f in t.feature_names:
            want.append(embfuse.embedding_bag(d[f].values(), w, d[f].offsets(), mode=t.pooling,
                                              include_last_offset=True))
    want = torch.cat(want, 1)
    out = ebc(kjt)
    assert out.keys() == ["f1@t1", "f3", "f2", "f1@t2"] and out.length_per_key() == [3, 3, 4, 4]
    torch.testing.assert_close(out.values(), want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    out.values().backward(g)
    want.backward(g)
    if rule is None:
        for g1, w0 in zip(torch.split(ebc.weights.grad, [r * d for r, d in ebc._shapes]), before):
            torch.testing.assert_close(g1.view(w0.shape), w0.grad, rtol=1e-12, atol=1e-12)
    else:
        for w1, w0 in zip(ebc.table_weights(), before):
            torch.testing.assert_close(w1.detach(), w0.detach() - 0.5 * w0.grad, rtol=1e-12, atol=1e-12)


def test_configs_follow_torchrecs_rules():
    t = EmbeddingBagConfig(10, 3, "lonely")
    ebc = EmbeddingBagCollection([t])
    assert t.feature_names == ["lonely"] and ebc.embedding_bag_configs() == [t]  # TorchRec's default feature
    with pytest.raises(ValueError, match="lists a feature twice"):
        EmbeddingBagCollection([EmbeddingBagConfig(10, 3, "t", feature_names=["a", "a"])])
    with pytest.raises(ValueError, match="distinct, non-empty names"):
        EmbeddingBagCollection([EmbeddingBagConfig(10, 3, "t", feature_names=["a"]),
                                EmbeddingBagConfig(10, 3, "t", feature_names=["b"])])


@pytest.mark.parametrize("device", DEVICES)
def test_per_table_views_are_the_flat_buffer(device):
    ebc = EmbeddingBagCollection(shared_tables(torch.float32), device=device)
    views = ebc.embedding_bags
    assert list(views) == ["t1", "t2"] and ebc.device == ebc.weights.device
    assert views["t2"].num_embeddings == 12 and views["t2"].embedding_dim == 4
    with torch.no_grad():
        views["t2"].weight[5] = 7.0  # TorchRec code initialises tables this way
    assert (ebc.embedding_weight("t2")[5] == 7.0).all()
    assert [k for k, _ in ebc.named_parameters()] == ["weights"]  # the views add no parameters
    ec = EmbeddingCollection([EmbeddingConfig(10, 5, "t", feature_names=["f"])], device=device)
    assert ec.embeddings["t"].weight.shape == (10, 5) and ec.embedding_configs()[0].name == "t"


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_collection_shares_features_and_returns_indices(device):
    ec = EmbeddingCollection([EmbeddingConfig(10, 5, "t1", torch.float64, ["f1", "f2"]),
                              EmbeddingConfig(10, 5, "t2", torch.float64, ["f2"])], device=device, need_indices=True)
    assert ec.need_indices() and ec.embedding_dim() == 5
    kjt = KeyedJaggedTensor(["f1", "f2"], torch.tensor([0, 1, 2, 3]), offsets=torch.tensor([0, 2, 3, 3, 4])).to(device)
    out = ec(kjt)
    assert list(out) == ["f1", "f2@t1", "f2@t2"]
    t1, t2 = ec.embedding_weight("t1"), ec.embedding_weight("t2")
    torch.testing.assert_close(out["f1"].values(), t1[[0, 1, 2]])
    torch.testing.assert_close(out["f2@t1"].values(), t1[[3]])
    torch.testing.assert_close(out["f2@t2"].values(), t2[[3]])
    assert out["f1"].weights().tolist() == [0, 1, 2] and out["f2@t2"].weights().tolist() == [3]
    assert out["f1"].lengths().tolist() == [2, 1] and out["f2@t2"].lengths().tolist() == [0, 1]



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keys", [["f2", "f1"], ["f3", "f2", "f1"]])
def test_embedding_collection_returns_features_in_table_order_whatever_the_batch_order(device, keys):
    """TorchRec's outputs follow the tables (then their features), not the batch's keys."""
    ec = EmbeddingCollection([EmbeddingConfig(10, 5, "t1", torch.float64, ["f1"]),
                              EmbeddingConfig(10, 5, "t2", torch.float64, ["f2"])], device=device)
    n = len(keys)
    kjt = KeyedJaggedTensor(keys, torch.arange(2 * n), lengths=torch.full((2 * n,), 1)).to(device)
    out = ec(kjt)
    assert list(out) == ["f1", "f2"]
    for f, t in (("f1", "t1"), ("f2", "t2")):
        torch.testing.assert_close(out[f].values(), ec.embedding_weight(t)[kjt[f].values()])

def test_collections_run_on_the_meta_device():
    """TorchRec builds models on the meta device: shapes without data, nothing to check."""
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(shared_tables(torch.float32), is_weighted=True)
        kjt = KeyedJaggedTensor(["f1", "f2", "f3"], torch.zeros(12, dtype=torch.int64), torch.zeros(12),
                                offsets=torch.arange(0, 13, 2))
    assert ebc.device.type == "meta" and ebc.embedding_bags["t1"].weight.is_meta
    assert kjt.length_per_key() == [4, 4, 4]  # the values split evenly (TorchRec's rule): no data to sum
    out = ebc(kjt)
    assert out.values().is_meta and out.values().shape == (2, 14)


@pytest.mark.parametrize("cls", ["bag", "sequence"])
def test_fx_traces_a_model_around_a_collection(cls):
    """torch.fx.symbolic_trace: a collection is one node (call_module inside a model, a call of
    its forward when traced alone), the rest of the model traced as usual."""
    if cls == "bag":
        coll = EmbeddingBagCollection(shared_tables(torch.float32))
    else:
        coll = EmbeddingCollection([EmbeddingConfig(10, 3, "t1", feature_names=["f1", "f3"]),
                                    EmbeddingConfig(12, 3, "t2", feature_names=["f2", "f1"])])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.coll, self.out = coll, torch.nn.Linear(3, 1)

        def forward(self, kjt):
            got = self.coll(kjt)
            return self.out(got["f1@t1"] if cls == "bag" else got["f1@t2"].values())

    model, kjt = Model(), batch("cpu")
    gm = torch.fx.symbolic_trace(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["coll", "out"]
    torch.testing.assert_close(gm(kjt), model(kjt))
    alone = torch.fx.symbolic_trace(coll)
    got, want = alone(kjt), coll(kjt)
    if cls == "bag":
        torch.testing.assert_close(got.values(), want.values())
    else:
        assert list(got) == list(want) and all(torch.equal(got[k].values(), want[k].values()) for k in want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_variable_batch_of_one_width_equals_its_expanded_batch(device):
    """Every feature one width (the expansion is one row gather): the VBE batch's output and
    gradients equal those of the fixed batch that repeats each deduplicated bag."""
    ts = [EmbeddingBagConfig(30, 4, f"t{i}", torch.float64, [f"f{i}"], pooling=p) for i, p in
          enumerate(["sum", "mean", "sum"])]
    ebc = EmbeddingBagCollection(ts, device=device)
    keys, strides, B = ["f0", "f1", "f2"], [2, 5, 3], 5
    per_key = [torch.randint(0, 4, (s,)) for s in strides]
    ids = [torch.randint(0, 30, (int(n.sum()),)) for n in per_key]
    inverse = torch.stack([torch.randint(0, s, (B,)) for s in strides])
    vbe = KeyedJaggedTensor(keys, torch.cat(ids), lengths=torch.cat(per_key),
                            stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, inverse)).to(device)
    lengths, values = [], []
    for n, v, inv in zip(per_key, ids, inverse):
        bags = torch.split(v, n.tolist())
        lengths.append(n[inv]), values.extend(bags[i] for i in inv.tolist())
    fixed = KeyedJaggedTensor(keys, torch.cat(values), lengths=torch.cat(lengths), stride=B).to(device)
    got, want = ebc(vbe).values(), ebc(fixed).values()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    got.backward(g)
    grad, ebc.weights.grad = ebc.weights.grad.clone(), None
    want.backward(g)
    torch.testing.assert_close(grad, ebc.weights.grad, rtol=1e-12, atol=1e-12)


def test_inverse_indices_outside_a_features_samples_are_refused():
    with pytest.raises(ValueError, match=r"inverse_indices of feature 'b': \[1\] = 2 is not one of its 2 samples"):
        KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1, 1]),
                          stride_per_key_per_rank=[[1], [2]],
                          inverse_indices=(["a", "b"], torch.tensor([[0, 0, 0], [1, 2, 0]])))


@pytest.mark.gpu
def test_the_pinned_ring_never_rewrites_a_row_a_copy_has_yet_to_read():
    """The VBE forward's small host data: while the GPU is busy, every copy still gets its own
    values (rows still in use are not reused: a fresh pinned tensor instead)."""
    from embfuse.nn.vbe import PinnedRing

    ring, dev = PinnedRing(slots=2, width=4), torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    outs = []
    for i in range(12):
        x = torch.tanh(x @ x)  # keeps the GPU behind the host
        outs.append(ring.to([i, i + 1, i + 2, i + 3, i + 4], dev))  # (wider than the ring: regrown)
    assert [o.tolist() for o in outs] == [[i, i + 1, i + 2, i + 3, i + 4] for i in range(12)]


def test_the_pinned_ring_keeps_nothing_a_trace_made():
    """Traced (torch.export's or torch.compile's fake tensors, here on fake CUDA tensors), the
    ring's values are a plain tensor and the ring makes no pinned buffer or event: one made under
    the trace would be a fake tensor kept for the eager calls after it (ops/deferred.py's device
    log had that bug)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from embfuse.nn.vbe import PinnedRing

    ring = PinnedRing(slots=2, width=4)
    with FakeTensorMode():
        out = ring.to([1, 2, 3], torch.device("cuda"))
    assert out.shape == (3,) and out.device.type == "cuda" and out.dtype == torch.int64
    assert ring.host is None and ring.events == [None, None] and ring.k == 0


def _vbe_batch(device, keys=("f0", "f1"), strides=(2, 3), rows=10, B=3):
    per_key = [torch.randint(0, 4, (s,)) for s in strides]
    per_key[0][0] = 0  # an empty bag
    ids = torch.randint(0, rows, (int(sum(n.sum() for n in per_key)),))
    inverse = torch.stack([torch.randint(0, s, (B,)) for s in strides])
    return KeyedJaggedTensor(list(keys), ids, lengths=torch.cat(per_key),
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(list(keys), inverse)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_collection_statistics_and_layer_norm_take_a_variable_batch(device):
    """TorchRec's VBE beyond the pooled forward: EmbeddingCollection gives each feature's
    samples (its own count); statistics count every id; the LayerNorm path normalises the
    expanded output."""
    kjt = _vbe_batch(device)
    ec = EmbeddingCollection([EmbeddingConfig(10, 4, "t0", torch.float64, ["f0"]),
                              EmbeddingConfig(10, 4, "t1", torch.float64, ["f1"])], device=device)
    out = ec(kjt)
    for f, t in (("f0", "t0"), ("f1", "t1")):
        jt = kjt[f]
        assert torch.equal(out[f].lengths(), jt.lengths())
        torch.testing.assert_close(out[f].values(), ec.embedding_weight(t)[jt.values()])
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(10, 4, "t0", torch.float64, ["f0"]),
                                  EmbeddingBagConfig(10, 4, "t1", torch.float64, ["f1"])], device=device)
    stats = ebc.statistics(kjt)
    assert [stats[t].lookups for t in ("t0", "t1")] == [kjt["f0"].values().numel(), kjt["f1"].values().numel()]
    w, b = torch.rand(2, 4, dtype=torch.float64, device=device), torch.rand(2, 4, dtype=torch.float64, device=device)
    got = ebc.forward_layer_norm(kjt, w, b, activation="tanh")
    x = ebc(kjt).values().view(3, 2, 4)
    want = torch.tanh(torch.nn.functional.layer_norm(x, (4,), eps=1e-5) * w + b).flatten(1)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_a_variable_batch_is_refused_inside_a_cuda_graph_capture():
    """Its per-feature sizes cross from the host at each call: a replay would read stale ones."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(10, 4, "t0", feature_names=["f0"]),
                                  EmbeddingBagConfig(10, 4, "t1", feature_names=["f1"])], device="cuda")
    kjt = _vbe_batch("cuda")
    ebc(kjt)
    torch.cuda.synchronize()
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ebc(kjt)
    assert ebc(kjt).values().shape == (3, 8)  # the context still works
