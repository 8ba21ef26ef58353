"""Padded batches (sparse/padded.py): values padded to a capacity look up and train as the batch
itself, the padding neither checked nor read, and batches of other lengths keep one graph."""

import pytest
import torch
from torch._dynamo.utils import counters

import embfuse
from embfuse.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse.ops import bags
from embfuse.ops.collection import Plan
from embfuse.ops.validate import validate_collection
from embfuse.optim import Adam, RowWiseAdagrad, SGD
from embfuse.sparse import KeyedJaggedTensor, PaddedKeyedJaggedTensor
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels
from tests.tolerances import assert_close

TABLES = [EmbeddingBagConfig(60, 8, "t0", feature_names=["f0"]),
          EmbeddingBagConfig(30, 4, "t1", feature_names=["f1"], pooling="mean"),
          EmbeddingBagConfig(45, 8, "t2", feature_names=["f2"], pooling="sqrtn")]
ROWS = [60, 30, 45]


def _batch(g, B=5, weighted=True):
    lengths = torch.randint(0, 5, (3 * B,), generator=g)
    feats = torch.arange(3).repeat_interleave(B).repeat_interleave(lengths)
    values = (torch.rand(feats.numel(), generator=g) * torch.tensor(ROWS)[feats]).long()
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(["f0", "f1", "f2"], values, weights, lengths=lengths)


def _padded(kjt, capacity, g):
    """kjt padded with garbage (ids past every table, negative ids, huge weights): never read."""
    pad = capacity - kjt.values().numel()
    junk = torch.randint(-5, 10**6, (pad,), generator=g)
    weights = kjt.weights_or_none()
    return PaddedKeyedJaggedTensor(kjt.keys(), torch.cat([kjt.values(), junk]),
                                   None if weights is None else torch.cat([weights, torch.full((pad,), 1e30)]),
                                   lengths=kjt.lengths())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", [None, SGD(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.05)],
                         ids=["grad", "sgd", "rowwise", "adam"])
def test_a_padded_batch_looks_up_and_trains_as_the_batch(device, rule):
    g = torch.Generator().manual_seed(0)
    plain = EmbeddingBagCollection(TABLES, is_weighted=True, device=device, optimizer=rule)
    padded = EmbeddingBagCollection(TABLES, is_weighted=True, device=device, optimizer=rule)
    padded.load_state_dict(plain.state_dict())
    for _ in range(3):
        kjt = _batch(g)
        pkjt = _padded(kjt, kjt.values().numel() + 37, g)
        outs = [m(b.to(device)).values() for m, b in ((plain, kjt), (padded, pkjt))]
        # (to rounding: the pooling kernel's launch shape is picked from the value count, padding included)
        assert_close(outs[1], outs[0], torch.float32, 4)
        for out in outs:
            (out * torch.arange(out.shape[1], device=device)).square().sum().backward()
    embfuse.check_errors()
    # (on a GPU the segment reduction groups a row's terms otherwise when the padding is sorted in)
    terms = 3 * kjt.values().numel()
    if rule is None:
        assert_close(padded.weights.grad, plain.weights.grad, torch.float32, terms)
    for a, b in zip(padded.state_dict().values(), plain.state_dict().values()):
        assert_close(a, b, torch.float32, terms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["deferred", "sync"])
def test_bad_ids_before_the_padding_are_found_and_change_nothing(device, mode):
    g = torch.Generator().manual_seed(1)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True, device=device, optimizer=SGD(lr=0.1), bounds_check=mode)
    kjt = _batch(g)
    values = kjt.values().clone()
    n = values.numel()
    values[n - 1] = 45  # the last value: feature f2, whose table has 45 rows
    bad = _padded(KeyedJaggedTensor(kjt.keys(), values, kjt.weights(), lengths=kjt.lengths()), n + 9, g)
    before = ebc.weights.detach().clone()
    with pytest.raises(embfuse.BadIdError, match=r"f2.*values\[%d\] = 45" % (n - 1)):
        ebc(bad.to(device)).values().sum().backward()
        embfuse.check_errors()
    assert torch.equal(ebc.weights.detach(), before)


def test_lengths_past_the_capacity_are_refused():
    kjt = _batch(torch.Generator().manual_seed(2))
    n = kjt.values().numel()
    with pytest.raises(ValueError, match=f"the batch has {n} values, more than the capacity {n - 1}"):
        PaddedKeyedJaggedTensor.from_kjt(kjt, n - 1)
    with pytest.raises(ValueError, match=f"lengths add up to {n}, past the {n - 1} values"):
        PaddedKeyedJaggedTensor(kjt.keys(), kjt.values()[:-1], lengths=kjt.lengths())


@requires_kernels
def test_the_check_kernel_stops_at_the_last_bag():
    """The deferred check's kernel (interpreted on the CPU): garbage past the last bag passes,
    a bad id before it and offsets that end past the values are flagged."""
    kjt = _batch(torch.Generator().manual_seed(3), weighted=False)
    n = kjt.values().numel()
    values = torch.cat([kjt.values(), torch.tensor([-7, 10**9, 5])]).to(KERNEL_DEVICE)
    offsets = kjt.offsets().to(KERNEL_DEVICE)
    limits = torch.tensor(ROWS, device=KERNEL_DEVICE)

    def check(v, o, tail=True):  # (sync: the kernel's flags are read at once; the host names the fault)
        validate_collection(v, o, None, limits, 5, ["f0", "f1", "f2"], ["t0", "t1", "t2"], "sync", kernel=True,
                            tail=tail)

    check(values, offsets)
    with pytest.raises(embfuse.BadBatchError, match=f"lengths add up to {n} but there are {n + 3} values"):
        check(values, offsets, tail=False)  # a plain batch's lengths add up to its values
    wrong = values.clone()
    wrong[n - 1] = 10**9
    with pytest.raises(embfuse.BadIdError, match=r"values\[%d\] = 1000000000" % (n - 1)):
        check(wrong, offsets)
    with pytest.raises(embfuse.BadBatchError, match=f"lengths add up to {n} but there are {n - 1} values"):
        check(values[:n - 1], offsets)


@requires_kernels
def test_backward_inputs_give_the_padding_no_row():
    kjt = _batch(torch.Generator().manual_seed(4))
    n = kjt.values().numel()
    P = Plan([(60, 8), (30, 4), (45, 8)], [(0, "sum", 0), (1, "mean", 8), (2, "sqrtn", 12)], KERNEL_DEVICE)
    values = torch.cat([kjt.values(), torch.full((50,), 10**6)]).to(KERNEL_DEVICE)
    psw = torch.cat([kjt.weights(), torch.full((50,), 1e30)]).to(KERNEL_DEVICE)
    offsets = kjt.offsets().to(KERNEL_DEVICE)
    keys, bag, scale = bags.backward_inputs(values, offsets, psw, P.meta, 5, kernel=True, weight_sums=P.weight_sums,
                                            tail=True)
    want = bags.backward_inputs_reference(values[:n], offsets, psw[:n], P.meta, 5)
    assert torch.equal(keys[:n].long(), want[0]) and torch.equal(bag[:n].long(), want[1])
    torch.testing.assert_close(scale[:n], want[2])
    assert (keys[n:] == -1).all() and (bag[n:] == 0).all() and (scale[n:] == 0).all()


def test_views_hold_the_batch_and_moves_keep_the_padding():
    kjt = _batch(torch.Generator().manual_seed(5))
    p = PaddedKeyedJaggedTensor.from_kjt(kjt, kjt.values().numel() + 11)
    assert p.capacity() == kjt.values().numel() + 11 and p.values()[-11:].eq(0).all()
    for a, b in zip(p.to_dict().values(), kjt.to_dict().values()):
        assert torch.equal(a.values(), b.values()) and torch.equal(a.weights(), b.weights())
    assert torch.equal(p.permute([2, 0]).values(), kjt.permute([2, 0]).values())
    assert torch.equal(p.split([1, 2])[1].values(), kjt.split([1, 2])[1].values())
    back = p.unpad()
    assert type(back) is KeyedJaggedTensor and torch.equal(back.values(), kjt.values())
    pinned = p.pin_memory() if torch.cuda.is_available() else p
    assert type(pinned) is PaddedKeyedJaggedTensor and torch.equal(pinned.values(), p.values())
    leaves, spec = torch.utils._pytree.tree_flatten(p)
    assert type(torch.utils._pytree.tree_unflatten(leaves, spec)) is PaddedKeyedJaggedTensor
    with pytest.raises(ValueError, match="cannot concat padded batches"):
        KeyedJaggedTensor.concat([p, kjt])


def test_what_a_padded_batch_cannot_do_is_refused():
    p = PaddedKeyedJaggedTensor.from_kjt(_batch(torch.Generator().manual_seed(6), weighted=False), 100)
    ec = EmbeddingCollection([EmbeddingConfig(60, 4, "t0", feature_names=["f0"]),
                              EmbeddingConfig(30, 4, "t1", feature_names=["f1"]),
                              EmbeddingConfig(45, 4, "t2", feature_names=["f2"])])
    with pytest.raises(NotImplementedError, match="unpad"):
        ec(p)
    hot = EmbeddingBagCollection(TABLES, optimizer=SGD(lr=0.1), hot_rows=4)
    with pytest.raises(NotImplementedError, match="hot_rows"):
        hot(p)
    with pytest.raises(ValueError, match="one batch size for every feature"):
        PaddedKeyedJaggedTensor(["f0"], torch.arange(3), lengths=torch.tensor([1, 2]), stride_per_key_per_rank=[[2]])


def test_batches_of_other_lengths_keep_one_compiled_graph():
    """The point of padding: torch.compile(fullgraph=True) of a fused step sees one shape."""
    g = torch.Generator().manual_seed(7)
    torch._dynamo.reset()
    plain = EmbeddingBagCollection(TABLES, is_weighted=True, optimizer=SGD(lr=0.1))
    padded = EmbeddingBagCollection(TABLES, is_weighted=True, optimizer=SGD(lr=0.1))
    padded.load_state_dict(plain.state_dict())
    step = torch.compile(lambda kjt: padded(kjt).values().square().sum(), fullgraph=True)
    graphs = []
    for _ in range(4):
        kjt = _batch(g)
        step(PaddedKeyedJaggedTensor.from_kjt(kjt, 64)).backward()
        plain(kjt).values().square().sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], graphs
    torch.testing.assert_close(padded.weights, plain.weights, rtol=1e-6, atol=1e-6)


def test_statistics_count_the_batch_not_its_padding():
    kjt = _batch(torch.Generator().manual_seed(8))
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    assert ebc.statistics(_padded(kjt, kjt.values().numel() + 20, torch.Generator())) == ebc.statistics(kjt)


@pytest.mark.gpu
def test_hot_rows_resident_in_l2_count_no_padding():
    """pin_hot_rows_in_l2 chooses its rows from the batch only (counted, the padding would be
    lookups of row 0 of the last feature's table) and reads as the plain lookup does."""
    g = torch.Generator().manual_seed(9)
    plain, pinned, pinned_padded = (EmbeddingBagCollection(TABLES, is_weighted=True, device="cuda",
                                                           pin_hot_rows_in_l2=pin) for pin in (False, True, True))
    pinned.load_state_dict(plain.state_dict())
    pinned_padded.load_state_dict(plain.state_dict())
    kjt = _batch(g, B=64)
    padded = PaddedKeyedJaggedTensor.from_kjt(kjt, kjt.values().numel() + 2000).to("cuda")
    with torch.no_grad():
        for _ in range(2):
            want = plain(kjt.to("cuda")).values()
            assert_close(pinned_padded(padded).values(), want, torch.float32, 4)
            assert_close(pinned(kjt.to("cuda")).values(), want, torch.float32, 4)
    assert pinned_padded.l2_residency.active and pinned_padded.l2_residency == pinned.l2_residency


@pytest.mark.parametrize("device", DEVICES)
def test_one_width_and_the_layer_norm_epilogue_take_a_padded_batch(device):
    """Tables of one width (on the CPU: torch's native embedding_bag over the flat buffer) and
    forward_layer_norm (on a GPU: the chain in the pooling kernel's epilogue)."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(50, 4, "a", feature_names=["f0"]),
                                  EmbeddingBagConfig(30, 4, "b", feature_names=["f1"], pooling="mean")], device=device)
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([2, 1, 0, 3]))
    padded = _padded(kjt, 20, torch.Generator().manual_seed(10)).to(device)
    kjt = kjt.to(device)
    w, b = torch.rand(2, 4, device=device), torch.rand(2, 4, device=device)
    with torch.no_grad():
        assert_close(ebc(padded).values(), ebc(kjt).values(), torch.float32, 4)
        assert_close(ebc.forward_layer_norm(padded, w, b, activation="tanh"),
                     ebc.forward_layer_norm(kjt, w, b, activation="tanh"), torch.float32, 4)
    embfuse.check_errors()
