import importlib

import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse import KeyedJaggedTensor
from embfuse._triton import interpreting
from embfuse.ops import deferred
from embfuse.optim import SGD, Adam, RowWiseAdagrad
from tests.conftest import DEVICES
from tests.tolerances import assert_close


def tables():
    # mixed widths, a table shared by two features, sum and mean
    return [EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="user", feature_names=["uid", "friend"]),
            EmbeddingBagConfig(num_embeddings=9, embedding_dim=3, name="item", feature_names=["iid"], pooling="mean"),
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=8, name="genre", feature_names=["genres"])]


ROWS = {"uid": 20, "friend": 20, "iid": 9, "genres": 5}


def random_kjt(keys, B, device, weighted=False):
    lengths = torch.randint(0, 4, (len(keys) * B,))
    lengths[0] = 0
    lengths[B * (len(keys) - 1):] = 0 if len(keys) > 2 else lengths[B * (len(keys) - 1):]  # an empty feature
    values = torch.cat([torch.randint(0, ROWS[k], (int(n),)) for k, n in
                        zip(keys, lengths.reshape(len(keys), B).sum(1))])
    w = torch.rand(values.numel()) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys, values, w, lengths=lengths).to(device)


def torch_pooled(ebc, kjt, weighted):
    """The oracle: one torch embedding_bag per feature, float64."""
    outs = {}
    d = kjt.to_dict()
    for t, w in zip(ebc.tables, ebc.table_weights()):
        for f in t.feature_names:
            jt = d[f]
            psw = jt.weights().double() if weighted else None
            outs[f] = F.embedding_bag(jt.values(), w.double(), jt.offsets()[:-1], mode=t.pooling,
                                      per_sample_weights=psw)
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_one_torch_embedding_bag_per_table(device, weighted, dtype):
    if weighted:  # torch weights sum pooling only
        ts = [EmbeddingBagConfig(t.num_embeddings, t.embedding_dim, t.name, dtype, t.feature_names) for t in tables()]
    else:
        ts = [EmbeddingBagConfig(t.num_embeddings, t.embedding_dim, t.name, dtype, t.feature_names,
                                 pooling=t.pooling) for t in tables()]
    ebc = EmbeddingBagCollection(ts, is_weighted=weighted, device=device)
    keys = ["genres", "uid", "iid", "friend"]  # not the collection's order: the output follows the tables
    kjt = random_kjt(keys, 6, device, weighted)
    out = ebc(kjt)
    assert out.keys() == ["uid", "friend", "iid", "genres"] and out.length_per_key() == [4, 4, 3, 8]
    ref = torch_pooled(ebc, kjt, weighted)
    for f, v in out.to_dict().items():
        assert_close(v, ref[f], dtype, reduction=4)
    g = torch.randn_like(out.values())
    out.values().backward(g)
    ref_w = [w.detach().double().requires_grad_() for w in ebc.table_weights()]
    d = kjt.to_dict()
    loss = 0
    for t, w in zip(ebc.tables, ref_w):
        for f in t.feature_names:
            jt, cols = d[f], out.offset_per_key()[out.keys().index(f)]
            psw = jt.weights().double() if weighted else None
            pooled = F.embedding_bag(jt.values(), w, jt.offsets()[:-1], mode=t.pooling, per_sample_weights=psw)
            loss = loss + (pooled * g[:, cols:cols + t.embedding_dim].double()).sum()
    loss.backward()
    got = [ebc.weights.grad[s:s + w.numel()].view_as(w) for s, w in zip(ebc._starts, ref_w)]
    for a, b in zip(got, ref_w):
        assert_close(a, b.grad, dtype, reduction=12)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_optimizer_trains_like_torch_sgd(device):
    ebc = EmbeddingBagCollection(tables(), device=device, optimizer=SGD(lr=0.5))
    ref = EmbeddingBagCollection(tables(), device=device)
    ref.load_state_dict(ebc.state_dict(), strict=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        kjt = random_kjt(["uid", "friend", "iid", "genres"], 5, device)
        target = torch.randn(5, 19, device=device)
        (ebc(kjt).values() - target).square().sum().backward()
        opt.zero_grad()
        (ref(kjt).values() - target).square().sum().backward()
        opt.step()
    assert ebc.weights.grad is None
    assert_close(ebc.weights, ref.weights, torch.float32, reduction=10)


@pytest.mark.parametrize("device", DEVICES)
def test_a_collection_beside_others_in_a_cat_gets_its_own_gradient(device):
    """Its output a column slice of the concatenation: its gradient is strided (a GPU kernel once
    read it with the wrong row stride)."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(), device=device)
    other = EmbeddingBagCollection([EmbeddingBagConfig(7, 1, "ad", feature_names=["ad"])], device=device,
                                   optimizer=SGD(lr=0.1))
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 5, device)
    ad = KeyedJaggedTensor(["ad"], torch.tensor([1, 6, 0]), lengths=torch.tensor([1, 0, 2, 0, 0])).to(device)
    gw = torch.randn(5, 3 + 19, dtype=torch.float64)
    dense = torch.randn(5, 2, device=device)
    (torch.cat([dense, other(ad).values(), ebc(kjt).values()], 1).double() * gw.to(device)).sum().backward()
    ref = EmbeddingBagCollection([EmbeddingBagConfig(t.num_embeddings, t.embedding_dim, t.name, torch.float64,
                                                     t.feature_names, pooling=t.pooling) for t in tables()])
    ref.weights.data.copy_(ebc.weights.detach().cpu())
    (ref(kjt.to("cpu")).values() * gw[:, 3:]).sum().backward()
    assert_close(ebc.weights.grad, ref.weights.grad, torch.float32, reduction=10)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_has_torchrec_keys_and_round_trips(device):
    ebc = EmbeddingBagCollection(tables(), device=device, optimizer=RowWiseAdagrad(lr=0.1))
    ebc(random_kjt(["uid", "friend", "iid", "genres"], 4, device)).values().sum().backward()
    sd = ebc.state_dict()
    assert [k for k in sd if k.startswith("embedding_bags")] == [
        "embedding_bags.user.weight", "embedding_bags.item.weight", "embedding_bags.genre.weight"]
    assert sd["embedding_bags.item.weight"].shape == (9, 3) and int(sd["optimizer_step"]) == 1
    other = EmbeddingBagCollection(tables(), device=device, optimizer=RowWiseAdagrad(lr=0.1))
    other.load_state_dict(sd)
    assert torch.equal(other.weights, ebc.weights) and torch.equal(other.optimizer_sum, ebc.optimizer_sum)
    # a table loads into a plain torch module, and back
    bag = torch.nn.EmbeddingBag(9, 3, mode="mean").to(device)
    bag.weight.data.copy_(sd["embedding_bags.item.weight"])
    plain = EmbeddingBagCollection(tables(), device=device)
    plain.load_state_dict({k: v for k, v in sd.items() if k.startswith("embedding_bags")})
    assert torch.equal(plain.embedding_weight("item"), bag.weight)
    with pytest.raises(RuntimeError, match="embedding_bags.genre.weight"):
        plain.load_state_dict({"embedding_bags.user.weight": sd["embedding_bags.user.weight"]})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["deferred", "sync"])
def test_bad_ids_name_the_feature_and_change_nothing(device, mode):
    """A training step on a bad batch: "sync" raises at the call, "deferred" (the default) by
    check_errors() at the latest (at once on the CPU); nothing is updated either way."""
    ebc = EmbeddingBagCollection(tables(), device=device, optimizer=SGD(lr=0.1, weight_decay=0.1), bounds_check=mode)
    before = ebc.weights.detach().clone()
    kjt = KeyedJaggedTensor(["uid", "friend", "iid", "genres"], torch.tensor([1, 2, 3, 9, 4]),
                            lengths=torch.tensor([1, 1, 1, 0, 1, 0, 0, 1])).to(device)
    with pytest.raises(IndexError, match=r"feature 'iid': values\[3\] = 9 \(sample 0\) is out of range for table "
                                         r"'item' of 9 rows"):
        ebc(kjt).values().sum().backward()
        embfuse.check_errors()
    assert torch.equal(ebc.weights, before)
    assert ebc.state_dict()["optimizer_step"] == 0
    with pytest.raises(ValueError, match=r"feature 'friend': lengths\[2\] \(sample 0\) = -1 is negative"):
        # (on the CPU the batch's own check refuses it; on a GPU the collection's)
        bad_len = KeyedJaggedTensor(["uid", "friend", "iid", "genres"], torch.tensor([1, 2], device=device),
                                    lengths=torch.tensor([1, 2, -1, 0, 0, 0, 0, 0]).to(device))
        ebc(bad_len).values().sum().backward()
        embfuse.check_errors()
    assert torch.equal(ebc.weights, before)
    with pytest.raises(KeyError, match="no feature 'genres'"):
        ebc(KeyedJaggedTensor(["uid", "friend", "iid"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0])))
    skip = EmbeddingBagCollection(tables(), device=device, bounds_check="skip")
    with pytest.warns(UserWarning, match="skipped 1 out-of-range"):
        out = skip(kjt)
    assert torch.equal(out["iid"][1], torch.zeros(3, device=device))  # the bad id's bag is empty now


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_values_narrowed_by_the_check_pool_as_given(device, weighted, monkeypatch):
    """A forward without gradient reads a large batch's int64 values as the int32 its check
    writes on a GPU (tuning.narrows; here every batch): bitwise the output of the values as given
    ("off"), forward_layer_norm's too; a bad batch still pools nothing and raises its error."""
    from embfuse.nn import collection
    from embfuse.ops import tuning

    monkeypatch.setattr(tuning, "NARROW_IDS", -1)
    monkeypatch.setattr(tuning, "NARROW_DIM", 0)
    read = []
    pool = collection.embedding_bag_collection
    monkeypatch.setattr(collection, "embedding_bag_collection", lambda w, v, *a: read.append(v.dtype) or pool(w, v, *a))
    configs = [EmbeddingBagConfig(30, 8, "a", feature_names=["f0", "f1"]),
               EmbeddingBagConfig(20, 8, "b", feature_names=["f2"], pooling="mean")]
    off, ebc = (EmbeddingBagCollection(configs, is_weighted=weighted, device=device, bounds_check=b)
                for b in ("off", "deferred"))
    ebc.load_state_dict(off.state_dict())
    lengths = torch.randint(0, 4, (15,))
    lengths[-1] = 2  # (the last value is f2's)
    values = torch.randint(0, 20, (int(lengths.sum()),))
    w = torch.rand(values.numel()) + 0.5 if weighted else None
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, w, lengths=lengths).to(device)
    norm_w, norm_b = torch.rand(3, 8, device=device) + 0.5, torch.randn(3, 8, device=device)
    with torch.no_grad():
        assert torch.equal(ebc(kjt).values(), off(kjt).values())
        assert read == [torch.int32 if device == "cuda" else torch.int64, torch.int64]
        assert torch.equal(ebc.forward_layer_norm(kjt, norm_w, norm_b), off.forward_layer_norm(kjt, norm_w, norm_b))
        embfuse.check_errors()
        bad_values = values.clone()
        bad_values[-1] = 20
        bad = KeyedJaggedTensor(["f0", "f1", "f2"], bad_values, w, lengths=lengths).to(device)
        with pytest.raises(IndexError, match=f"feature 'f2': values\\[{values.numel() - 1}\\] = 20"):
            out = ebc(bad).values()
            assert torch.equal(out, torch.zeros_like(out))
            embfuse.check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_collection_matches_torch_embedding(device):
    ts = [EmbeddingConfig(num_embeddings=20, embedding_dim=4, name="user", feature_names=["uid"]),
          EmbeddingConfig(num_embeddings=9, embedding_dim=4, name="item", feature_names=["iid", "hist"])]
    ec = EmbeddingCollection(ts, device=device)
    kjt = KeyedJaggedTensor(["uid", "iid", "hist"], torch.tensor([3, 19, 8, 0, 1, 2]),
                            lengths=torch.tensor([1, 1, 1, 0, 2, 1])).to(device)
    out = ec(kjt)
    user, item = ec.table_weights()
    assert torch.equal(out["uid"].values(), F.embedding(torch.tensor([3, 19], device=device), user))
    assert torch.equal(out["hist"].values(), F.embedding(torch.tensor([0, 1, 2], device=device), item))
    assert out["hist"].lengths().tolist() == [2, 1]
    out["hist"].values().sum().backward()
    assert torch.equal(ec.weights.grad.view(-1, 4)[20:23], torch.ones(3, 4, device=device))
    assert list(ec.state_dict()) == ["embeddings.user.weight", "embeddings.item.weight"]
    with pytest.raises(ValueError, match="share one embedding_dim"):
        EmbeddingCollection([ts[0], EmbeddingConfig(3, 5, "x", feature_names=["x"])])


@pytest.mark.parametrize("width", ["mixed", "one"])
def test_opcheck_and_compile(width):
    configs = tables() if width == "mixed" else [
        EmbeddingBagConfig(20, 4, "user", feature_names=["uid", "friend"]),
        EmbeddingBagConfig(9, 4, "item", feature_names=["iid"], pooling="mean"),
        EmbeddingBagConfig(5, 4, "genre", feature_names=["genres"])]
    ebc = EmbeddingBagCollection(configs)
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 4, "cpu")
    P = ebc._plan(kjt.keys(), ebc.weights.device)
    L = P.layout
    for status in (None, torch.zeros(2, dtype=torch.int32)):
        torch.library.opcheck(torch.ops.embfuse.embedding_bag_collection,
                              (ebc.weights.detach().requires_grad_(), kjt.values(), kjt.offsets(), None, status,
                               P.meta, P.src_meta, 4, P.total_dim, P.max_dim, L.vec, L.wide_keys, P.scaled,
                               P.weight_sums, P.skips, P.tail))
    compiled = torch.compile(lambda w, v, o: embfuse.ops.collection.embedding_bag_collection(w, v, o, None, P, 4),
                             fullgraph=True)
    got, want = compiled(ebc.weights, kjt.values(), kjt.offsets()), ebc(kjt).values()
    # (eager takes torch's pooling on the CPU, a traced call the reference: rounding apart)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_compiled_weighted_batch_of_one_sample_and_one_feature(device, pooling):
    """One bag of a one-row table of width 1 (tests/ops/test_embedding_bag.py says why), with
    weights, the loss taken in the graph: it failed to compile on the CPU before bags.index_sum.
    The bag's output is the weights' sum (over its length, mean) times the row, and the row's
    gradient that factor."""
    torch._dynamo.reset()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(1, 1, "t", feature_names=["f"], pooling=pooling)],
                                 is_weighted=True, device=device)
    psw = torch.rand(3, dtype=torch.float64) + 0.5
    kjt = KeyedJaggedTensor(["f"], torch.zeros(3, dtype=torch.long), psw.float(), lengths=torch.tensor([3]))
    with torch._inductor.config.patch(force_disable_caches=True):  # (see the test it points to)
        out = torch.compile(lambda k: ebc(k).values().sum(), fullgraph=True)(kjt.to(device))
        out.backward()
    scale = psw.sum() / (3 if pooling == "mean" else 1)
    assert_close(out, ebc.weights.detach().double().cpu().view(()) * scale, torch.float32, reduction=3)
    assert_close(ebc.weights.grad, scale.view(1), torch.float32, reduction=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted,strict", [(False, False), (True, False), (True, True)])
def test_torch_export_of_a_collection(device, weighted, strict):
    """A keyed batch in, a KeyedTensor out: the exported program pools as the module does, for
    a batch of other lengths too (the values' count is dynamic). Strict export rebuilds the
    batch from fake leaves outside any trace, where its construction checks must not read them."""
    ebc = EmbeddingBagCollection(tables(), is_weighted=weighted, device=device)
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 4, device, weighted)
    n = torch.export.Dim("n", min=2)
    shapes = {"features": [(n,), (n,) if weighted else None, None, None, None]}  # (the flattened leaves)
    exported = torch.export.export(ebc, (kjt,), dynamic_shapes=shapes, strict=strict).module()
    for batch in (kjt, random_kjt(["uid", "friend", "iid", "genres"], 4, device, weighted)):
        got, want = exported(batch), ebc(batch)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values(), want.values())


@pytest.mark.parametrize("device", DEVICES)
def test_torch_export_of_a_fused_collection(device, monkeypatch):
    """With autograd on, a fused optimizer's lookup refuses export with a clear error (the calls
    export would make keep its fake tensors) and the module trains on unchanged; under no_grad
    the plain lookup exports. Export is the process's first call here (no device log yet: it
    is made under export's tracing)."""
    monkeypatch.setattr(deferred, "_LOGS", {})
    ebc = EmbeddingBagCollection(tables(), device=device, optimizer=SGD(lr=0.1))
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 4, device)
    with pytest.raises(NotImplementedError, match="fused optimizer cannot be exported.*no_grad"):
        torch.export.export(ebc, (kjt,))
    twin = EmbeddingBagCollection(tables(), device=device, optimizer=SGD(lr=0.1))
    twin.load_state_dict(ebc.state_dict())
    for m in (ebc, twin):
        m(kjt).values().sum().backward()
    assert torch.equal(ebc.weights, twin.weights)
    with torch.no_grad():
        exported = torch.export.export(ebc, (kjt,)).module()
        torch.testing.assert_close(exported(kjt).values(), ebc(kjt).values())


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_lookup_is_an_op_and_compiles(device):
    """forward_layer_norm's lookup (the chain in the pooling kernel's epilogue on a GPU) passes
    opcheck and stays in one torch.compile(fullgraph=True) graph, with the eager result."""
    configs = [EmbeddingBagConfig(30, 8, "a", feature_names=["f0", "f1"]),
               EmbeddingBagConfig(20, 8, "b", feature_names=["f2"], pooling="mean")]
    ebc = EmbeddingBagCollection(configs, device=device)
    lengths = torch.randint(0, 4, (15,))
    lengths[6] = 0  # an empty bag: its row is the LayerNorm's bias through tanh
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.randint(0, 20, (int(lengths.sum()),)),
                            lengths=lengths).to(device)
    P = ebc._plan(kjt.keys(), ebc.weights.device)
    w, b = torch.rand(3, 8, device=device) + 0.5, torch.randn(3, 8, device=device)
    torch.library.opcheck(torch.ops.embfuse.embedding_bag_collection_layer_norm,
                          (ebc.weights.detach(), kjt.values(), kjt.offsets(), None, None, P.meta, w, b, 5,
                           P.total_dim, P.max_dim, P.layout.vec, P.weight_sums, P.skips, 1e-5, "tanh"))
    with torch.no_grad():
        want = ebc.forward_layer_norm(kjt, w, b, activation="tanh")
        x = ebc(kjt).values().view(5, 3, 8)
        torch.testing.assert_close(want, torch.tanh(torch.nn.functional.layer_norm(x, (8,)) * w + b).flatten(1))
        got = torch.compile(lambda k: ebc.forward_layer_norm(k, w, b, activation="tanh"), fullgraph=True)(kjt)
    torch.testing.assert_close(got, want)

@pytest.mark.parametrize("device", DEVICES)
def test_embedding_collection_with_a_fused_optimizer(device):
    ts = [EmbeddingConfig(num_embeddings=20, embedding_dim=4, name="user", feature_names=["uid"]),
          EmbeddingConfig(num_embeddings=9, embedding_dim=4, name="item", feature_names=["iid"])]
    ec = EmbeddingCollection(ts, device=device, optimizer=embfuse.optim.Adagrad(lr=0.1))
    before = ec.weights.detach().clone()
    kjt = KeyedJaggedTensor(["uid", "iid"], torch.tensor([3, 8]), lengths=torch.tensor([1, 1])).to(device)
    ec(kjt)["iid"].values().sum().backward()
    assert ec.weights.grad is None and ec.optimizer_sum.shape == (29, 4)
    changed = (ec.weights != before).nonzero().flatten().tolist()
    assert changed == [112, 113, 114, 115]  # item row 8 = global row 28, its 4 elements
    assert torch.allclose(ec.weights[112:116], before[112:116] - 0.1, atol=1e-6)  # Adagrad's first step: lr * sign


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", ["bag", "sequence"])
def test_statistics_count_each_tables_lookups(device, cls):
    """Against a plain Counter per table: features sharing a table counted together, an empty
    feature, the hottest rows in order (count, then row)."""
    from collections import Counter

    keys = ["uid", "friend", "iid", "genres"]
    if cls == "bag":
        ebc = EmbeddingBagCollection(tables(), device=device)
    else:
        ebc = EmbeddingCollection([EmbeddingConfig(num_embeddings=n, embedding_dim=4, name=t.name,
                                                   feature_names=t.feature_names)
                                   for n, t in zip((20, 9, 5), tables())], device=device)
    kjt = random_kjt(keys, 40, device)
    stats = ebc.statistics(kjt, top_k=3)
    counts = {t.name: Counter() for t in ebc.tables}
    for k, jt in kjt.to_dict().items():
        counts[ebc.tables[ebc._table_of[k]].name].update(jt.values().tolist())
    assert counts["genre"] == Counter()  # random_kjt leaves the last feature empty
    for name, c in counts.items():
        s = stats[name]
        assert (s.lookups, s.distinct) == (sum(c.values()), len(c))
        assert s.hottest == sorted(c.items(), key=lambda rc: (-rc[1], rc[0]))[:3]


def test_statistics_reject_bad_ids_like_the_forward():
    ebc = EmbeddingBagCollection(tables())
    kjt = KeyedJaggedTensor(["uid", "friend", "iid", "genres"], torch.tensor([3, 9, 1]),
                            lengths=torch.tensor([1, 0, 1, 1]))
    with pytest.raises(IndexError, match="iid"):
        ebc.statistics(kjt)


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_values_but_no_bags_is_refused(device):
    """Zero bags with some values failed inside torch (issue 17 item 8): on the host the batch
    refuses itself; what reaches the collection's check is refused there."""
    from embfuse.ops.validate import validate_collection

    with pytest.raises(ValueError, match="lengths add up to 0 but there are 2 values"):
        KeyedJaggedTensor(["uid"], torch.tensor([1, 2]), lengths=torch.zeros(0, dtype=torch.long), stride=0)
    ebc = EmbeddingBagCollection(tables(), device=device)
    plan = ebc._plan(["uid"], ebc.weights.device)
    with pytest.raises(ValueError, match="the batch has no bags but 2 values") as e:
        validate_collection(torch.tensor([1, 2], device=device), torch.zeros(1, dtype=torch.long, device=device),
                            None, plan.limits, 0, ["uid"], ["user"])
    assert isinstance(e.value, RuntimeError)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", ["sqrtn", "wmean"])
def test_tensorflow_poolings_pool_and_train_like_the_single_table_op(device, weighted, pooling):
    """pooling="sqrtn" / "wmean" in a collection (mixed with sum and mean, weighted or not): each
    feature as embfuse.embedding_bag(mode=pooling) pools it, in float64; and one fused SGD step
    moves the rows as that op's gradient says."""
    ts = [EmbeddingBagConfig(20, 4, "user", torch.float64, ["uid", "friend"], pooling=pooling),
          EmbeddingBagConfig(9, 3, "item", torch.float64, ["iid"], pooling="sum" if weighted else "mean"),
          EmbeddingBagConfig(5, 8, "genre", torch.float64, ["genres"], pooling=pooling)]
    ebc = EmbeddingBagCollection(ts, is_weighted=weighted, device=device, optimizer=SGD(lr=0.5))
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 5, device, weighted)
    before = [w.detach().clone().requires_grad_() for w in ebc.table_weights()]
    d, want = kjt.to_dict(), []
    for t, w in zip(ebc.tables, before):
        for f in t.feature_names:
            jt = d[f]
            pooled = embfuse.embedding_bag(jt.values(), w, jt.offsets(), mode=t.pooling, include_last_offset=True,
                                           per_sample_weights=jt.weights().double() if weighted else None)
            want.append(pooled)
    want = torch.cat(want, 1)
    out = ebc(kjt).values()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for w0, w1 in zip(before, ebc.table_weights()):
        torch.testing.assert_close(w1.detach(), w0.detach() - 0.5 * w0.grad, rtol=1e-12, atol=1e-12)


def test_is_weighted_is_torchrecs_method():
    assert EmbeddingBagCollection(tables(), is_weighted=True).is_weighted() is True
    assert EmbeddingBagCollection(tables()).is_weighted() is False


def _tf_tables(dtype=torch.float64):
    return [EmbeddingBagConfig(20, 4, "user", dtype, ["uid", "friend"], combiner="mean", default_id=3),
            EmbeddingBagConfig(9, 3, "item", dtype, ["iid"]),
            EmbeddingBagConfig(7, 5, "genre", dtype, ["genres"], combiner="sqrtn"),
            EmbeddingBagConfig(6, 2, "tag", dtype, ["tags"], combiner="sum", default_id=0)]


def _tf_batch(keys, B, device, weighted):
    """A batch whose TensorFlow-style features hold ids < 0, weights <= 0 and empty bags (the
    TorchRec table's feature, iid, only ids in range)."""
    rows = {"uid": 20, "friend": 20, "iid": 9, "genres": 7, "tags": 6}
    lengths = torch.randint(0, 5, (len(keys) * B,))
    lengths[0] = 0
    counts = lengths.reshape(len(keys), B).sum(1)
    values = torch.cat([torch.randint(0 if k == "iid" else -2, rows[k], (int(n),)) for k, n in zip(keys, counts)])
    weights = None
    if weighted:
        weights = torch.rand(values.numel()) + 0.5
        plain = torch.cat([torch.full((int(n),), k == "iid") for k, n in zip(keys, counts)])
        weights = torch.where((torch.rand(values.numel()) < 0.2) & ~plain, -weights, weights)
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule", [SGD(lr=0.5), Adam(lr=0.05)], ids=["sgd", "adam"])
def test_tensorflow_tables_are_safe_embedding_lookup_sparse(device, weighted, dtype, rule):
    """Tables with combiner= (TensorFlow's) beside a TorchRec one: each feature's output is
    embfuse.tf.safe_embedding_lookup_sparse of its bags (itself checked against TensorFlow) in
    float64; one fused step moves the rows as that function's gradient says, and only those
    (Adam would move a row handed a zero gradient). float32 tables take the kernels on a GPU (the
    safe pass, pooling, fused update)."""
    ebc = EmbeddingBagCollection(_tf_tables(dtype), is_weighted=weighted, device=device, optimizer=rule)
    keys, B = ["uid", "friend", "iid", "genres", "tags"], 6
    kjt = _tf_batch(keys, B, device, weighted)
    before = [w.detach().to(torch.float64, copy=True).requires_grad_() for w in ebc.table_weights()]
    want, d = [], kjt.to_dict()
    for t, w in zip(ebc.tables, before):
        for f in t.feature_names:
            jt = d[f]
            lengths = jt.lengths().long()
            rows = torch.repeat_interleave(torch.arange(B, device=device), lengths)
            cols = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(jt.offsets()[:-1].long(),
                                                                                         lengths)
            idx = torch.stack([rows, cols])
            shape = (B, max(int(lengths.max()), 1))
            sp_ids = torch.sparse_coo_tensor(idx, jt.values(), shape)
            sp_w = torch.sparse_coo_tensor(idx, jt.weights().double(), shape) if weighted else None
            if t.combiner is None:
                want.append(embfuse.embedding_bag(jt.values(), w, jt.offsets(), mode="sum", include_last_offset=True,
                                                  per_sample_weights=jt.weights().double() if weighted else None))
                continue
            want.append(embfuse.tf.safe_embedding_lookup_sparse(w, sp_ids, sp_w, combiner=t.combiner,
                                                                default_id=t.default_id))
    want = torch.cat(want, 1)
    out = ebc(kjt).values()
    assert_close(out, want, dtype, reduction=4)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    for w0, w1 in zip(before, ebc.table_weights()):
        touched = w0.grad.abs().sum(1) > 0
        want_w = w0.detach().clone()
        state = {k: torch.full((int(touched.sum()),) + (() if per == "row" else (w0.shape[1],)), float(v),
                               dtype=torch.float64, device=device) for k, (per, v) in rule.state_spec().items()}
        want_w[touched] = rule.update(want_w[touched], w0.grad[touched], state, 1)[0]
        assert_close(w1.detach(), want_w, dtype, reduction=8)


@pytest.mark.parametrize("device", DEVICES)
def test_an_unweighted_tensorflow_batch_is_the_weighted_one_with_weights_1(device):
    """Without weights the safe pass writes none (each entry weighs 1, a dropped one nothing, read
    from the ids): outputs, the fused update and its state are bitwise those of a weighted
    collection given weights of 1."""
    keys, B = ["uid", "friend", "iid", "genres", "tags"], 6
    kjt = _tf_batch(keys, B, device, weighted=False)
    ones = KeyedJaggedTensor(keys, kjt.values(), torch.ones_like(kjt.values(), dtype=torch.float32),
                             lengths=kjt.lengths())
    plain, weighted = (EmbeddingBagCollection(_tf_tables(torch.float32), is_weighted=w, device=device,
                                              optimizer=Adam(lr=0.05, weight_decay=0.1)) for w in (False, True))
    weighted.load_state_dict(plain.state_dict())
    for step in range(2):
        outs = [m(batch).values() for m, batch in ((plain, kjt), (weighted, ones))]
        assert torch.equal(outs[0], outs[1])
        g = torch.randn_like(outs[0])
        for out in outs:
            out.backward(g)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, weighted.state_dict()[k]), k
    for k, v in plain._fused.state.items():
        assert torch.equal(v, weighted._fused.state[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_a_vbe_batchs_padding_bags_take_no_default_id(device):
    """A VBE batch is padded to one stride with empty bags: those must not take a TensorFlow
    table's default id, which a fused Adam with weight decay would then move (found by the
    sharded VBE test). A real empty bag still takes it."""
    ts = [EmbeddingBagConfig(10, 4, "a", feature_names=["fa"], combiner="sum", default_id=7),
          EmbeddingBagConfig(10, 4, "b", feature_names=["fb"]),
          EmbeddingBagConfig(10, 4, "c", feature_names=["fc"], combiner="mean", default_id=5)]
    ebc = EmbeddingBagCollection(ts, device=device, optimizer=Adam(lr=0.1, weight_decay=0.1))
    before = [w.detach().clone() for w in ebc.table_weights()]
    # fa: one bag [1, 2]; fb: three; fc: an empty bag and [3]; three samples
    kjt = KeyedJaggedTensor(["fa", "fb", "fc"], torch.tensor([1, 2, 3, 4, 5, 3]),
                            lengths=torch.tensor([2, 1, 1, 1, 0, 1]), stride_per_key_per_rank=[[1], [3], [2]],
                            inverse_indices=(["fa", "fb", "fc"], torch.tensor([[0, 0, 0], [0, 1, 2], [0, 1, 1]])))
    out = ebc(kjt.to(device)).values()
    a, c = before[0], before[2]
    assert_close(out[:, :4], (a[1] + a[2]).expand(3, 4), torch.float32)
    assert_close(out[:, 8:], torch.stack([c[5], c[3], c[3]]), torch.float32)
    out.sum().backward()
    moved = [sorted((w1.detach() != w0).any(1).nonzero().flatten().tolist())
             for w0, w1 in zip(before, ebc.table_weights())]
    assert moved == [[1, 2], [3, 4, 5], [3, 5]]


@pytest.mark.parametrize("device", DEVICES)
def test_tensorflow_tables_refuse_what_tensorflow_refuses(device):
    """An id past its table is an error naming the feature and position, ids < 0 only where the
    table has a combiner; bad configurations are refused at construction."""
    ebc = EmbeddingBagCollection(_tf_tables(torch.float32), device=device)
    keys = ["uid", "friend", "iid", "genres", "tags"]
    kjt = _tf_batch(keys, 3, device, False)
    before = ebc.weights.detach().clone()
    values = kjt.values().clone()
    values[0] = 20  # uid's first value, past the user table
    with pytest.raises(IndexError, match=r"feature 'uid'.*values\[0\] = 20"):
        ebc(KeyedJaggedTensor(keys, values, lengths=kjt.lengths()))
        embfuse.check_errors()
    values = kjt.values().clone()
    start = sum(kjt.length_per_key()[:2])
    values[start] = -1  # iid: a TorchRec table, where -1 is out of range
    with pytest.raises(IndexError, match=r"feature 'iid'.*= -1"):
        ebc(KeyedJaggedTensor(keys, values, lengths=kjt.lengths()))
        embfuse.check_errors()
    assert torch.equal(ebc.weights.detach(), before)
    for bad, match in ((dict(combiner="max"), "combiner must be"), (dict(default_id=1), "give combiner"),
                       (dict(combiner="mean", pooling="mean"), "not both"),
                       (dict(combiner="mean", default_id=20), "out of range")):
        with pytest.raises(ValueError, match=match):
            EmbeddingBagCollection([EmbeddingBagConfig(20, 4, "user", feature_names=["uid"], **bad)])
    with pytest.raises(ValueError, match="neither hot_rows"):
        EmbeddingBagCollection(_tf_tables(torch.float32), optimizer=SGD(lr=0.1), hot_rows=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["deferred", "sync"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_bad_batch_under_rules_that_only_drop_negative_ids_changes_nothing(device, mode, weighted):
    """TensorFlow's sum without a default id drops ids < 0 and nothing else, so its batch reaches
    the pooling and the fused step as it came (no pass over bags), a bad one too: an id past a
    table, an id < 0 of the TorchRec table, a negative length each raise their error (at the call,
    or by check_errors()), and leave weights and optimizer state bitwise unchanged (Adam with
    weight decay moves any row handed a gradient). A good batch then trains."""
    from unittest import mock

    ts = [EmbeddingBagConfig(20, 4, "user", feature_names=["uid", "friend"], combiner="sum"),
          EmbeddingBagConfig(9, 3, "item", feature_names=["iid"])]
    ebc = EmbeddingBagCollection(ts, is_weighted=weighted, device=device, optimizer=Adam(lr=0.1, weight_decay=0.1),
                                 bounds_check=mode)
    keys = ["uid", "friend", "iid"]
    values = torch.tensor([3, -1, 19, -7, 0, 5, 8])
    lengths = torch.tensor([2, 1, 1, 0, 2, 1])  # (uid: 3 ids, friend: 1, iid: 3 in range of 9)
    weights = torch.rand(values.numel()) + 0.5 if weighted else None
    before = {k: v.clone() for k, v in ebc.state_dict().items()}

    def step(v, ls):
        ebc(KeyedJaggedTensor(keys, v, weights, lengths=ls).to(device)).values().sum().backward()
        embfuse.check_errors()

    past, negative = values.clone(), values.clone()
    past[2] = 20  # uid's third id, past the user table
    negative[5] = -1  # iid's: the TorchRec table's ids < 0 are out of range
    with mock.patch("embfuse.ops.safe.safe_bags_kernel", side_effect=AssertionError("the pass ran")), \
            mock.patch("embfuse.ops.safe._safe_bags_torch", side_effect=AssertionError("the pass ran")):
        for v, ls, error, match in (
                (past, lengths, IndexError, r"feature 'uid'.*values\[2\] = 20 \(sample 1\)"),
                (negative, lengths, IndexError, r"feature 'iid'.*= -1"),
                (values, torch.tensor([2, 1, 2, -1, 2, 1]), ValueError,
                 r"feature 'friend': lengths\[3\] \(sample 1\) = -1")):
            with pytest.raises(error, match=match):
                step(v, ls)
            after = ebc.state_dict()
            assert all(torch.equal(after[k], b) for k, b in before.items())
        step(values, lengths)
    assert int(ebc.state_dict()["optimizer_step"]) == 1
    moved = [sorted((w1.detach() != before[f"embedding_bags.{t}.weight"]).any(1).nonzero().flatten().tolist())
             for t, w1 in zip(["user", "item"], ebc.table_weights())]
    assert moved == [[3, 19], [0, 5, 8]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rule", [None, SGD(lr=0.5)], ids=["grad", "sgd"])
def test_variable_batch_size_per_feature_is_torchrecs_vbe(device, weighted, rule):
    """A batch whose features have their own batch sizes (TorchRec's VBE): each feature pooled
    over its own bags, output sample b of feature f taking its row inverse_indices[f][b]; the
    gradient (or one fused SGD step) of every table as that reference's, in float64."""
    ts = [EmbeddingBagConfig(20, 4, "user", torch.float64, ["uid", "friend"], pooling="wmean" if weighted else "mean"),
          EmbeddingBagConfig(9, 3, "item", torch.float64, ["iid"]),
          EmbeddingBagConfig(7, 5, "genre", torch.float64, ["genres"], pooling="sqrtn")]
    ebc = EmbeddingBagCollection(ts, is_weighted=weighted, device=device, optimizer=rule)
    keys, strides, B = ["iid", "uid", "genres", "friend"], [2, 5, 1, 3], 5  # (not the collection's order)
    rows_of = {"uid": 20, "friend": 20, "iid": 9, "genres": 7}
    lengths = torch.cat([torch.randint(0, 4, (s,)) for s in strides])
    values = torch.cat([torch.randint(0, rows_of[k], (int(sum(n)),)) for k, n in
                        zip(keys, torch.split(lengths, strides))])
    weights = torch.rand(values.numel(), dtype=torch.float64) + 0.5 if weighted else None
    inverse = torch.stack([torch.randint(0, s, (B,)) for s in strides])
    kjt = KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                            inverse_indices=(keys, inverse)).to(device)
    before = [w.detach().to(torch.float64, copy=True).requires_grad_() for w in ebc.table_weights()]
    d, want = kjt.to_dict(), []
    for t, w in zip(ebc.tables, before):
        for f in t.feature_names:
            jt = d[f]
            pooled = embfuse.embedding_bag(jt.values(), w, jt.offsets(), mode=t.pooling, include_last_offset=True,
                                           per_sample_weights=jt.weights() if weighted else None)
            want.append(pooled[inverse[keys.index(f)].to(device)])
    want = torch.cat(want, 1)
    out = ebc(kjt).values()
    assert out.shape == (B, 4 + 4 + 3 + 5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    if rule is None:
        grads = torch.split(ebc.weights.grad, [r * d for r, d in ebc._shapes])
        for g1, w0 in zip(grads, before):
            torch.testing.assert_close(g1.view(w0.shape), w0.grad, rtol=1e-12, atol=1e-12)
    else:
        for w0, w1 in zip(before, ebc.table_weights()):
            torch.testing.assert_close(w1.detach(), w0.detach() - 0.5 * w0.grad, rtol=1e-12, atol=1e-12)


def _vbe_lookup(item_dim, device, lengths=(1, 2, 0, 1, 3, 2), sized=True):
    """A collection (uid, friend: mean over a 4-wide table; iid: sum over an `item_dim`-wide one)
    and a VBE batch for it (strides 2, 3, 1) whose sizes (length_per_key) it carries if `sized`,
    as a loader's batch does."""
    ts = [EmbeddingBagConfig(20, 4, "user", feature_names=["uid", "friend"], pooling="mean"),
          EmbeddingBagConfig(9, item_dim, "item", feature_names=["iid"])]
    keys, strides = ["iid", "uid", "friend"], [2, 3, 1]
    lengths = torch.tensor(lengths)
    sizes = [int(n.sum()) for n in torch.split(lengths, strides)]
    kjt = KeyedJaggedTensor(keys, torch.randint(0, 9, (sum(sizes),)), lengths=lengths,
                            stride_per_key_per_rank=[[s] for s in strides], length_per_key=sizes if sized else None,
                            inverse_indices=(keys, torch.tensor([[0, 1, 1], [0, 1, 2], [0, 0, 0]])))
    return EmbeddingBagCollection(ts, device=device), kjt.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("item_dim", [3, 4], ids=["mixed-widths", "one-width"])
def test_a_compiled_vbe_batch_then_eager_ones(device, item_dim):
    """A VBE batch traced first (torch.compile, fullgraph) pools as the eager call does, and the
    eager calls after it still work: on a GPU the pinned ring that carries a VBE batch's host
    sizes keeps nothing the trace made (a fake buffer there would fail every later call). Both
    forms of the expansion: one gather for one width, a gather a run of widths."""
    ebc, kjt = _vbe_lookup(item_dim, device)
    got = torch.compile(lambda k: ebc(k).values(), fullgraph=True)(kjt)
    assert ebc._vbe_ring.host is None  # (the trace kept no buffer)
    for _ in range(3):  # (eager calls after it use the ring's rows in turn)
        assert_close(ebc(kjt).values(), got, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["export", "export-strict", "compile"])
def test_a_vbe_batch_without_its_sizes_traces(device, how):
    """A VBE batch that does not carry its length_per_key exports (strict or not, the values'
    count dynamic) and compiles (fullgraph): its sizes are read from the traced lengths as
    data-dependent values. The program then pools other batches of those strides as the module
    does, and refuses one whose lengths do not add up to its values (the graph's runtime
    assertion)."""
    ebc, kjt = _vbe_lookup(3, device, sized=False)
    if how.startswith("export"):
        n = torch.export.Dim("n", min=2)
        exported = torch.export.export(ebc, (kjt,), dynamic_shapes={"features": [(n,), None, None, None, None]},
                                       strict=how == "export-strict").module()
        run = lambda k: exported(k).values()  # noqa: E731
    else:
        run = torch.compile(lambda k: ebc(k).values(), fullgraph=True)
    for lengths in ((1, 2, 0, 1, 3, 2), (4, 0, 2, 2, 0, 1), (0, 0, 5, 1, 1, 2)):
        _, batch = _vbe_lookup(3, device, lengths, sized=False)
        assert_close(run(batch), ebc(batch).values(), torch.float32)
    _, short = _vbe_lookup(3, device, sized=False)
    short._values = short._values[:-1]
    with pytest.raises(RuntimeError, match=r"Eq\("):  # (torch's words for it: the assertion's expression)
        run(short)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("how", ["export", "compile"])
def test_a_traced_vbe_batch_of_an_embedding_collection(device, sized, how):
    """EmbeddingCollection's VBE lookup exported or compiled (fullgraph), with or without the
    batch's length_per_key: each feature's rows and lengths are its own samples', as in the eager
    call, for a batch of other lengths too. It pads without inverse indices (on a GPU through the
    padding's op), then gathers the rows of the padded batch."""
    ec = EmbeddingCollection([EmbeddingConfig(20, 4, "user", feature_names=["uid", "friend"]),
                              EmbeddingConfig(9, 4, "item", feature_names=["iid"])], device=device)
    _, kjt = _vbe_lookup(4, device, sized=sized)
    if how == "export":
        n = torch.export.Dim("n", min=2)
        run = torch.export.export(ec, (kjt,), dynamic_shapes={"features": [(n,), None, None, None, None]},
                                  strict=False).module()
    else:
        run = torch.compile(lambda k: ec(k), fullgraph=True)
    for lengths in ((1, 2, 0, 1, 3, 2), (4, 0, 2, 2, 0, 1)):
        _, batch = _vbe_lookup(4, device, lengths, sized=sized)
        got = run(batch)
        assert list(got) == ["uid", "friend", "iid"]
        for f, t in (("uid", "user"), ("friend", "user"), ("iid", "item")):
            assert torch.equal(got[f].lengths(), batch[f].lengths())
            torch.testing.assert_close(got[f].values(), ec.embedding_weight(t)[batch[f].values()], rtol=0, atol=0)


@pytest.mark.skipif(not interpreting(), reason="a GPU runs the path itself: test_a_compiled_vbe_batch_then_eager_ones")
@pytest.mark.parametrize("item_dim", [3, 4], ids=["mixed-widths", "one-width"])
def test_a_compiled_vbe_batch_traces_no_launch_outside_an_op(item_dim, monkeypatch):
    """The GPU's path of a traced VBE lookup, on the CPU: the padding (ops/vbe.py) and the
    expansion's gather (ops/embedding.py) take their kernel branches, and a launch that dynamo
    would trace outside an op fails (on a GPU dynamo cannot: torch 2.11 stops at _Distinct's id()
    of a tensor it made). Inside the padding's op, where wrap_triton traces the launch on a GPU,
    the reference stands in."""
    vbe, embedding = importlib.import_module("embfuse.ops.vbe"), importlib.import_module("embfuse.ops.embedding")
    launches, forward = vbe.pad_kernels, embedding.embedding_forward

    def pad(*args):
        return vbe.pad_reference(*args) if torch._C._len_torch_dispatch_stack() else launches(*args)

    def gather(*args):
        assert not torch.compiler.is_compiling(), "dynamo traced a launch outside an op"
        return forward(*args)
    for module in (vbe, embedding):
        monkeypatch.setattr(module, "use_kernels", lambda t: True)
    monkeypatch.setattr(vbe, "pad_kernels", pad)
    monkeypatch.setattr(embedding, "embedding_forward", gather)
    ebc, kjt = _vbe_lookup(item_dim, "cpu")
    got = torch.compile(lambda k: ebc(k).values(), fullgraph=True)(kjt)
    assert_close(got, ebc(kjt).values(), torch.float32)
