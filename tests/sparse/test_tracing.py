"""The jagged classes under torch.fx and pytree (torch.export / torch.compile inputs and outputs),
and TorchRec's rules for empty and meta batches."""

import logging

import pytest
import torch
import torch.fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from embfuse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, PaddedKeyedJaggedTensor
from tests.conftest import DEVICES


def test_a_container_made_from_traced_values_is_one_node():
    class Make(torch.nn.Module):
        def forward(self, values, lengths):
            jt = JaggedTensor(values, lengths=lengths)
            kjt = KeyedJaggedTensor(["a", "b"], values, lengths=lengths)
            return jt, kjt

    gm = torch.fx.symbolic_trace(Make())
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [JaggedTensor, KeyedJaggedTensor]
    jt, kjt = gm(torch.arange(5), torch.tensor([2, 0, 1, 2]))
    assert jt.offsets().tolist() == [0, 2, 2, 3, 5] and kjt["b"].values().tolist() == [2, 3, 4]


def test_making_containers_outside_tracing_logs_nothing():
    """torch's ProxyableClassMeta logs a warning the first time any program asks whether fx
    traces; the containers ask only while it does."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger(torch.fx._symbolic_trace.__name__)
    log.addHandler(handler)
    try:
        torch.fx._symbolic_trace.is_fx_tracing_warning.cache_clear()
        KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
        KeyedTensor(["a"], [1], torch.zeros(2, 1))
    finally:
        log.removeHandler(handler)
    assert records == []


def test_a_container_made_from_constants_is_folded():
    class Count(torch.nn.Module):
        def forward(self, x):
            kjt = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
            return x + kjt.values().numel() + kjt.lengths().numel()

    gm = torch.fx.symbolic_trace(Count())
    assert "KeyedJaggedTensor" not in gm.code and gm(torch.zeros(1)).item() == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_key_views_of_a_batch_without_its_sizes_compile(device, padded):
    """to_dict of a batch that does not carry its length_per_key compiles (fullgraph): the sizes
    are read from the traced lengths as data-dependent values, and the graph asserts at run time
    that they add up to the values (at most, padded), where an eager call raises ValueError."""
    def batch(lengths):
        lengths = torch.tensor(lengths)
        kjt = KeyedJaggedTensor(["a", "b"], torch.randperm(int(lengths.sum())), lengths=lengths, stride=2)
        return (PaddedKeyedJaggedTensor.from_kjt(kjt, kjt.values().numel() + 3) if padded else kjt).to(device)
    views = torch.compile(lambda k: [jt.values() for jt in k.to_dict().values()], fullgraph=True)
    for lengths in ([2, 0, 1, 3], [0, 4, 1, 1]):
        kjt, a = batch(lengths), sum(lengths[:2])
        got = views(kjt)
        assert len(got) == 2
        assert torch.equal(got[0], kjt.values()[:a]) and torch.equal(got[1], kjt.values()[a:sum(lengths)])
    short = batch([2, 0, 1, 3])
    short._values = short._values[:5]  # (lengths add up to 6)
    with pytest.raises(ValueError, match="add up to"):
        short.to_dict()
    with pytest.raises(RuntimeError, match=r"Eq\(|Expected cond"):  # (torch's words: the assertion's expression)
        views(short)


def test_static_helpers_of_traced_containers_are_one_call():
    class Concat(torch.nn.Module):
        def forward(self, kjts):
            return KeyedJaggedTensor.concat(kjts)

    class Regroup(torch.nn.Module):
        def forward(self, kts, groups):
            return KeyedTensor.regroup(kts, groups), KeyedTensor.regroup_as_dict(kts, groups, ["x", "y"])

    a = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    b = KeyedJaggedTensor(["b"], torch.arange(3, 4), lengths=torch.tensor([0, 1]))
    got = torch.fx.symbolic_trace(Concat())([a, b])
    assert got.keys() == ["a", "b"] and got.values().tolist() == [0, 1, 2, 3]
    kt1 = KeyedTensor.from_tensor_list(["p", "q"], [torch.rand(2, 1), torch.rand(2, 2)])
    kt2 = KeyedTensor.from_tensor_list(["r"], [torch.rand(2, 3)])
    groups = [["r", "p"], ["q"]]
    gm = torch.fx.symbolic_trace(Regroup())
    assert sum(n.op == "call_function" for n in gm.graph.nodes) == 2
    (lists, named), (want, _) = gm([kt1, kt2], groups), Regroup()([kt1, kt2], groups)
    assert all(torch.equal(x, y) for x, y in zip(lists, want)) and torch.equal(named["y"], want[1])

    class EmptyLike(torch.nn.Module):  # TorchRec's test_traceable_empty_like, less its TorchScript
        def forward(self, kjt):
            empty = KeyedJaggedTensor.empty_like(kjt)
            return empty.values().numel() + empty.weights().numel() + empty.stride()

    weighted = KeyedJaggedTensor(["a"], torch.arange(3.0), torch.rand(3), lengths=torch.tensor([1, 2]))
    gm = torch.fx.symbolic_trace(EmptyLike())
    assert "_empty_like" in gm.code  # one call (unwrapped, tracing it iterated a Proxy and failed)
    assert gm(weighted) == EmptyLike()(weighted) == 2


def test_from_dense_lengths_traces_with_or_without_weights():
    values, lengths = torch.arange(12.0).reshape(3, 4), torch.tensor([2, 0, 3])
    traced = torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)
    jt = traced(values=values, lengths=lengths)
    assert jt.values().tolist() == [0.0, 1.0, 8.0, 9.0, 10.0] and jt.weights_or_none() is None
    assert traced(values=values, lengths=lengths, weights=-values).weights().tolist() == [-0.0, -1, -8, -9, -10]


def test_pytree_key_paths_name_every_leaf():
    """torch.export names its inputs and outputs by key path: each class has a flatten_with_keys."""
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), torch.rand(3), lengths=torch.tensor([1, 0, 2, 0]))
    kt, jt = KeyedTensor(["a"], [2], torch.rand(2, 2)), kjt.to_dict()["a"]
    paths, _ = pytree.tree_flatten_with_path((kjt, jt, kt))
    names = [pytree.keystr(p) for p, _ in paths]
    assert names == ["[0]._values", "[0]._weights", "[0]._lengths", "[0]._offsets", "[0]._inverse_indices",
                     "[1]._values", "[1]._weights", "[1]._lengths", "[1]._offsets", "[2]._values"]
    leaves = pytree.tree_flatten((kjt, jt, kt))[0]
    assert len(leaves) == len(paths) and all(a is b for (_, a), b in zip(paths, leaves))


def test_pytree_round_trips():
    kt = KeyedTensor(["a", "b"], [1, 2], torch.rand(3, 3))
    leaves, spec = pytree.tree_flatten(kt)
    assert len(leaves) == 1 and leaves[0] is kt.values()
    back = pytree.tree_unflatten(leaves, spec)
    assert back.keys() == ["a", "b"] and back.length_per_key() == [1, 2]
    swapped = KeyedTensor(["b", "a"], [2, 1], torch.cat([kt["b"], kt["a"]], 1))
    assert torch.equal(fx_pytree.tree_flatten_spec(swapped, spec)[0], kt.values())  # in the spec's key order

    vbe = KeyedJaggedTensor(["a", "b"], torch.arange(5), torch.rand(5), lengths=torch.tensor([2, 0, 1, 1, 1]),
                            stride_per_key_per_rank=[[2], [3]], inverse_indices=(["a", "b"], torch.tensor(
                                [[0, 1, 0], [2, 1, 0]])))
    leaves, spec = pytree.tree_flatten(vbe)
    back = pytree.tree_unflatten(leaves, spec)
    assert back.keys() == vbe.keys() and back.stride_per_key() == [2, 3] and back.stride() == 3
    assert torch.equal(back.inverse_indices()[1], vbe.inverse_indices()[1])
    assert torch.equal(back.weights(), vbe.weights())
    jt = JaggedTensor(torch.arange(3), offsets=torch.tensor([0, 1, 3]))
    back = pytree.tree_unflatten(*pytree.tree_flatten(jt))
    assert back.lengths().tolist() == [1, 2] and back.offsets().tolist() == [0, 1, 3]
    # made from offsets, it stays so (lengths_or_none() None); a spec saved before the inverse
    # indices were a leaf has four children
    kjt = KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 1, 3]))
    leaves, spec = pytree.tree_flatten(kjt)
    children = [spec.child(i) for i in range(4)] if hasattr(spec, "child") else spec.children_specs[:4]  # (2.11)
    older = pytree.TreeSpec(spec.type, spec.context, children)
    back = pytree.tree_unflatten(leaves[:4], older)
    assert back.lengths_or_none() is None and back.offsets().tolist() == [0, 1, 3] and back.keys() == ["a"]


def test_empty_counts_of_any_dtype_are_taken_and_other_float_counts_refused():
    """torch.tensor([]) is float32: TorchRec takes it as no lengths; float lengths with entries
    are refused with an error that is both embfuse's TypeError and TorchRec's AssertionError."""
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([]), lengths=torch.tensor([[], []]), length_per_key=[0, 0])
    a = kjt.to_dict()["a"]
    assert kjt.stride() == 0 and a.lengths().dtype == torch.int32 and a.lengths().numel() == a.offsets().numel() == 0
    for lengths in (torch.tensor([1.0, 2.0]), torch.tensor([1, 2], dtype=torch.bool)):
        with pytest.raises(TypeError, match="lengths must be integers") as e:
            JaggedTensor(torch.arange(3), lengths=lengths)
        assert isinstance(e.value, AssertionError)
