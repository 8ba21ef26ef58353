from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embfuse
from embfuse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


@st.composite
def kjts(draw, weighted=None):
    F = draw(st.integers(0, 4))
    B = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 3), min_size=F * B, max_size=F * B))
    n = sum(lengths)
    values = torch.tensor(draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), dtype=torch.int64)
    w = draw(st.booleans()) if weighted is None else weighted
    weights = torch.rand(n) if w else None
    return KeyedJaggedTensor([f"f{i}" for i in range(F)], values, weights,
                             lengths=torch.tensor(lengths, dtype=torch.int64), stride=B)


def per_sample(kjt):
    """{key: [(ids of sample b, weights of sample b)]}: the meaning of a KJT, layout aside."""
    out = {}
    for key, jt in kjt.to_dict().items():
        o = jt.offsets().tolist()
        w = jt.weights_or_none()
        out[key] = [(jt.values()[a:b].tolist(), None if w is None else w[a:b].tolist()) for a, b in zip(o, o[1:])]
    return out


@settings(max_examples=60, deadline=None)
@given(kjts())
def test_to_dict_and_offsets_agree_with_the_lengths(kjt):
    d = kjt.to_dict()
    assert list(d) == kjt.keys()
    assert [jt.values().numel() for jt in d.values()] == kjt.length_per_key()
    assert kjt.offsets()[-1] == kjt.values().numel() and kjt.offset_per_key()[-1] == kjt.values().numel()
    B = kjt.stride()
    for i, jt in enumerate(d.values()):
        assert torch.equal(jt.lengths(), kjt.lengths()[i * B:(i + 1) * B])
        assert sum(len(x) for x in jt.to_dense()) == jt.values().numel()
    kjt.validate()


@settings(max_examples=60, deadline=None)
@given(kjts(), st.data())
def test_permute_split_concat_keep_every_sample(kjt, data):
    F = len(kjt.keys())
    order = data.draw(st.permutations(range(F)))
    p = kjt.permute(order)
    assert p.keys() == [kjt.keys()[i] for i in order]
    assert per_sample(p) == per_sample(kjt)
    cuts = sorted(data.draw(st.lists(st.integers(0, F), max_size=3)))
    segments = [b - a for a, b in zip([0] + cuts, cuts + [F])]
    parts = kjt.split(segments)
    assert [len(x.keys()) for x in parts] == segments
    back = KeyedJaggedTensor.concat(parts)
    assert back.keys() == kjt.keys() and torch.equal(back.values(), kjt.values())
    assert torch.equal(back.lengths(), kjt.lengths())
    if F:
        assert per_sample(KeyedJaggedTensor.from_jt_dict(kjt.to_dict())) == per_sample(kjt)


@settings(max_examples=30, deadline=None)
@given(kjts())
def test_to_moves_everything_in_one_buffer(kjt):
    # on the CPU "meta" stands in for a device: the packed copy is still one tensor
    moved = kjt.to("meta")
    assert moved.device().type == "meta" and moved.keys() == kjt.keys()
    assert moved.values().dtype == kjt.values().dtype and moved.lengths().shape == kjt.lengths().shape
    assert moved.length_per_key() == kjt.length_per_key()  # computed before the move
    assert (moved.weights_or_none() is None) == (kjt.weights_or_none() is None)


@pytest.mark.gpu
def test_to_cuda_is_one_copy_and_exact():
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(7), torch.rand(7), lengths=torch.tensor([1, 2, 0, 4]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moved = kjt.to("cuda", non_blocking=True)
    assert [e.name for e in prof.events()].count("cudaMemcpyAsync") == 1
    assert per_sample(moved.to("cpu")) == per_sample(kjt)
    pinned = kjt.pin_memory()  # packed once: its move is the one copy, with nothing packed on the host
    assert pinned.values().is_pinned() and per_sample(pinned) == per_sample(kjt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moved = pinned.to("cuda", non_blocking=True)
    names = [e.name for e in prof.events()]
    assert names.count("cudaMemcpyAsync") == 1 and names.count("aten::copy_") == 1
    assert per_sample(moved.to("cpu")) == per_sample(kjt)


@pytest.mark.parametrize("bad, message", [
    (dict(lengths=torch.tensor([1, -1, 2, 0])), "feature 'a': lengths\\[1\\] \\(sample 1\\) = -1 is negative"),
    (dict(lengths=torch.tensor([1, 1, 2, 0])), "lengths add up to 4 but there are 2 values"),
])
def test_validate_names_the_problem(bad, message):
    values = torch.arange(2)
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(["a", "b"], values, **bad).validate()


def test_constructor_rejects_bad_layouts():
    with pytest.raises(ValueError, match="do not split evenly"):
        KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(KeyError, match="no key 'z'"):
        KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2]))["z"]


def test_a_kjt_is_a_generic_jagged_container_as_torchrecs():
    """Float and 2-D values and repeated keys are TorchRec's (issue 20); only a lookup needs
    integer ids, and it says so."""
    kjt = KeyedJaggedTensor(["a", "b"], torch.rand(5, 3), lengths=torch.tensor([1, 1, 2, 1]),
                            weights=torch.rand(5))
    assert kjt["b"].values().shape == (3, 3) and kjt["b"].weights().shape == (3,)
    assert torch.equal(kjt.to("cpu").values(), kjt.values())
    twice = kjt.permute([1, 1, 0])
    assert twice.keys() == ["b", "b", "a"] and twice.length_per_key() == [3, 3, 2]
    assert torch.equal(twice.values(), torch.cat([kjt.values()[2:], kjt.values()[2:], kjt.values()[:2]]))
    repeated = KeyedJaggedTensor(["a", "a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    assert repeated["a"].values().tolist() == [1, 2]  # the last "a", as TorchRec's
    with pytest.raises(TypeError, match="values must be int32 or int64, got torch.float32"):
        embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(4, 2, "t", feature_names=["a"])])(
            KeyedJaggedTensor(["a"], torch.rand(2), lengths=torch.tensor([2])))
    # integer weights (TorchRec's EmbeddingCollection puts ids there): checked where they scale rows
    ids = KeyedJaggedTensor(["a"], torch.arange(2), torch.arange(2), lengths=torch.tensor([2]))
    assert ids.weights().tolist() == [0, 1]
    with pytest.raises(TypeError, match="weights must be floating point, got torch.int64"):
        embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(4, 2, "t", feature_names=["a"])],
                                       is_weighted=True)(ids)


def test_keyed_tensor_and_jagged_tensor():
    kt = KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).reshape(2, 5))
    assert kt.offset_per_key() == [0, 2, 5]
    assert torch.equal(kt["b"], torch.tensor([[2.0, 3, 4], [7, 8, 9]]))
    jt = JaggedTensor(torch.arange(3), offsets=torch.tensor([0, 0, 3]))
    assert jt.lengths().tolist() == [0, 3] and [x.tolist() for x in jt.to_dense()] == [[], [0, 1, 2]]


@pytest.mark.parametrize("make, exc, message", [
    (lambda: KeyedJaggedTensor("uid", torch.arange(2), lengths=torch.tensor([2])), TypeError,
     "keys must be a sequence of strings"),
    (lambda: KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2.0])), (TypeError, AssertionError),
     "lengths must be integers"),
    (lambda: JaggedTensor(torch.arange(2), offsets=torch.tensor([0.0, 2.0])), (TypeError, AssertionError),
     "offsets must be integers"),
    (lambda: KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([[2]])), ValueError,
     "lengths must be 1-D"),
    (lambda: KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([3])), ValueError,
     "lengths add up to 3 but there are 2 values"),
    (lambda: KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2]), weights=torch.rand(3)),
     ValueError, "weights has shape"),
    (lambda: KeyedJaggedTensor(["a", "b"], torch.arange(3), offsets=torch.tensor([0, 2, 1])), ValueError,
     r"offsets must start at 0 and never decrease; offsets\[2\] = 1"),
])
def test_inconsistent_batches_are_refused_at_construction(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


def test_slicing_by_key_refuses_lengths_that_do_not_add_up():
    """Lengths on a device are not summed at construction (no device read); to_dict and split,
    which read the per-key counts anyway, check them. (Lengths on the meta device stand in for
    a GPU's here; the per-key counts are given.)"""
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1], device="meta"), stride=1,
                            length_per_key=[1, 1])
    with pytest.raises(ValueError, match="lengths add up to 2 but there are 3 values"):
        kjt.to_dict()
    with pytest.raises(ValueError, match="lengths add up to 2 but there are 3 values"):
        kjt.split([1, 1])


def test_torchrecs_constructors():
    """JaggedTensor.empty / from_dense_lengths / from_dense, KeyedJaggedTensor.empty / empty_like."""
    e = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int64, weights_dtype=torch.float32)
    assert e.values().shape == (0,) and e.weights().dtype == torch.float32 and e.lengths().dtype == torch.int32
    dense = torch.arange(12.0).reshape(3, 4)
    jt = JaggedTensor.from_dense_lengths(dense, torch.tensor([2, 0, 3]), weights=dense * 10)
    assert jt.values().tolist() == [0.0, 1.0, 8.0, 9.0, 10.0] and jt.weights().tolist() == [0.0, 10.0, 80.0, 90.0,
                                                                                             100.0]
    assert jt.offsets().tolist() == [0, 2, 2, 5]
    jt = JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([]), torch.tensor([7.0, 8.0])])
    assert jt.lengths().tolist() == [1, 0, 2] and jt.lengths().dtype == torch.int32 and jt.values().tolist() == [
        1.0, 7.0, 8.0]
    k = KeyedJaggedTensor.empty(is_weighted=True)
    assert k.keys() == [] and k.stride() == 0 and k.weights().numel() == 0
    src = KeyedJaggedTensor(["a", "b"], torch.arange(3), torch.rand(3), lengths=torch.tensor([1, 0, 1, 1]))
    like = KeyedJaggedTensor.empty_like(src)
    assert like.keys() == [] and like.stride() == 2 and like.values().dtype == torch.int64
    assert like.weights().dtype == torch.float32 and like.lengths().numel() == 0


def test_torchrecs_accessors_that_do_not_compute():
    kjt = KeyedJaggedTensor(["a", "b", "a"], torch.arange(6), torch.rand(6),
                            offsets=torch.tensor([0, 1, 3, 3, 4, 6, 6]))
    assert kjt.lengths_or_none() is None  # made from offsets: lengths once asked for (TorchRec's)
    assert torch.equal(kjt.lengths(), torch.tensor([1, 2, 0, 1, 2, 0]))
    assert torch.equal(kjt.lengths_or_none(), torch.tensor([1, 2, 0, 1, 2, 0]))
    assert torch.equal(kjt.offsets_or_none(), torch.tensor([0, 1, 3, 3, 4, 6, 6]))
    assert KeyedJaggedTensor(["a"], torch.arange(2), lengths=torch.tensor([2])).offsets_or_none() is None
    assert kjt.stride_per_key() == [2, 2, 2] and not kjt.variable_stride_per_key()
    assert kjt.inverse_indices_or_none() is None
    assert kjt.lengths_offset_per_key() == [0, 2, 4, 6]
    assert kjt.index_per_key() == {"a": 2, "b": 1}  # a repeated key: its last position
    assert kjt.unsync().length_per_key_or_none() is None and kjt.offset_per_key_or_none() is None
    assert kjt.sync().length_per_key_or_none() == [3, 1, 2] and kjt.offset_per_key_or_none() == [0, 3, 4, 6]
    # values (6 x int64) + weights (6 x fp32) + lengths (6 x int64) + offsets (7 x int64)
    assert kjt.size_in_bytes() == 6 * 8 + 6 * 4 + 6 * 8 + 7 * 8
    lazy = kjt.to_dict(compute_offsets=False)["b"]
    assert lazy.offsets_or_none() is None and torch.equal(lazy.offsets(), torch.tensor([0, 0, 1]))
    assert kjt.to_dict()["b"].offsets_or_none() is not None


def test_record_stream_reaches_every_tensor():
    """TrainPipeline reads batches on other streams than the copy's: every tensor of a batch,
    a VBE batch's inverse indices too, is recorded (one missed could be reused by the next
    copy while a kernel still reads it)."""
    inverse = torch.tensor([[0, 1, 0]])
    kjt = KeyedJaggedTensor(["a"], torch.arange(3), torch.rand(3), lengths=torch.tensor([1, 2]),
                            stride_per_key_per_rank=[[2]], inverse_indices=(["a"], inverse))
    kjt.offsets()
    calls = []
    with mock.patch.object(torch.Tensor, "record_stream", lambda t, stream: calls.append((id(t), stream))):
        kjt.record_stream("side")
    parts = (kjt.values(), kjt.weights(), kjt.lengths(), kjt.offsets(), inverse)
    assert sorted(calls) == sorted((id(t), "side") for t in parts)
    assert kjt.size_in_bytes() == 3 * 8 + 3 * 4 + 2 * 8 + 3 * 8  # the batch's own data: not the inverse indices


def test_padded_dense_views_of_a_jagged_tensor():
    jt = JaggedTensor(torch.tensor([5, 6, 7, 8]), weights=torch.tensor([0.5, 1.5, 2.5, 3.5]),
                      lengths=torch.tensor([2, 0, 1, 1]))
    assert torch.equal(jt.to_padded_dense(), torch.tensor([[5, 6], [0, 0], [7, 0], [8, 0]]))
    assert torch.equal(jt.to_padded_dense(desired_length=1, padding_value=-1), torch.tensor([[5], [-1], [7], [8]]))
    assert torch.equal(jt.to_padded_dense_weights(3, 9.0),
                       torch.tensor([[0.5, 1.5, 9.0], [9.0, 9.0, 9.0], [2.5, 9.0, 9.0], [3.5, 9.0, 9.0]]))
    assert [w.tolist() for w in jt.to_dense_weights()] == [[0.5, 1.5], [], [2.5], [3.5]]
    plain = JaggedTensor(torch.arange(6).view(3, 2), lengths=torch.tensor([0, 3]))  # rows of values
    assert plain.to_dense_weights() is None and plain.to_padded_dense_weights() is None
    assert torch.equal(plain.to_padded_dense(2), torch.tensor([[[0, 0], [0, 0]], [[0, 1], [2, 3]]]))


def test_string_forms_are_torchrecs():
    jt = JaggedTensor(torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 0, 1]))
    assert str(jt) == "JaggedTensor({\n    [[1.0, 2.0], [], [3.0]]\n})\n"
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), weights=torch.tensor([0.5, 1.0, 2.0]),
                            lengths=torch.tensor([1, 1, 0, 1]))
    assert str(kjt) == ('KeyedJaggedTensor({\n    "a": {\n        "values": [[1], [2]],\n        "weights": '
                        '[[0.5], [1.0]]\n    },\n    "b": {\n        "values": [[], [3]],\n        "weights": '
                        '[[], [2.0]]\n    }\n})\n')
    assert str(KeyedJaggedTensor([], torch.tensor([]))) == "KeyedJaggedTensor()\n"  # no lengths: no bags
    kt = KeyedTensor(["x", "y"], [1, 2], torch.tensor([[1.0, 2.0, 3.0]]))
    assert str(kt) == 'KeyedTensor({\n    "x": [[1.0]],\n    "y": [[2.0, 3.0]]\n})\n'
    with pytest.raises(ValueError, match="needs lengths or offsets"):
        KeyedJaggedTensor(["a"], torch.tensor([1]))


def test_variable_batch_size_per_key():
    """TorchRec's VBE: key "a" has 3 samples (2 from rank 0, 1 from rank 1), key "b" 1; the
    per-key slicing, split, permute, concat, moves and round trips follow each key's own count."""
    lengths = torch.tensor([1, 0, 2, 3])
    values, weights = torch.arange(6), torch.rand(6)
    inverse = (["a", "b"], torch.tensor([[0, 1, 2, 2], [0, 0, 0, 0]]))
    kjt = KeyedJaggedTensor(["a", "b"], values, weights, lengths=lengths, stride_per_key_per_rank=[[2, 1], [1]],
                            inverse_indices=inverse)
    assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [3, 1]
    assert kjt.stride_per_key_per_rank() == [[2, 1], [1]] and kjt.stride() == 4  # the inverse indices' batch
    assert kjt.lengths_offset_per_key() == [0, 3, 4] and kjt.length_per_key() == [3, 3]
    assert kjt.inverse_indices() is inverse
    d = kjt.to_dict()
    assert torch.equal(d["a"].lengths(), torch.tensor([1, 0, 2])) and torch.equal(d["b"].values(), values[3:])
    assert torch.equal(d["b"].weights(), weights[3:])
    a, b = kjt.split([1, 1])
    assert a.stride_per_key_per_rank() == [[2, 1]] and torch.equal(b.lengths(), torch.tensor([3]))
    p = kjt.permute([1, 0])
    assert p.stride_per_key() == [1, 3] and torch.equal(p.values(), torch.cat([values[3:], values[:3]]))
    both = KeyedJaggedTensor.concat([a, b])
    assert both.stride_per_key() == [3, 1] and torch.equal(both.values(), values)
    assert torch.equal(KeyedJaggedTensor.from_jt_dict(d).lengths(), lengths)
    assert KeyedJaggedTensor.from_jt_dict(d).stride_per_key() == [3, 1]
    pinned = kjt.pin_memory() if torch.cuda.is_available() else kjt
    assert pinned.stride_per_key_per_rank() == [[2, 1], [1]] and pinned.inverse_indices_or_none() is not None
    without = KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[2, 1], [1]])
    assert without.stride() == 3  # the largest key's
    with pytest.raises(ValueError, match="stride_per_key_per_rank has 1 rows for 2 keys"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[4]])
    with pytest.raises(ValueError, match="gives the keys"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(ValueError, match=r"feature 'b': lengths\[3\] \(sample 0\) = -1"):
        KeyedJaggedTensor(["a", "b"], values, lengths=torch.tensor([1, 0, 2, -1]), stride_per_key_per_rank=[[3], [1]])
    # a collection pools it (tests/nn/test_collection.py); without inverse indices it cannot
    ebc = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(10, 4, "t", feature_names=["a", "b"])])
    assert ebc(kjt).values().shape == (4, 8)
    with pytest.raises(ValueError, match="needs inverse_indices"):
        ebc(without)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_jagged_tensor_to(device):
    jt = JaggedTensor(torch.tensor([0.5, 1.0, 1.5]), torch.tensor([5.0, 10.0, 15.0]),
                      offsets=torch.tensor([0, 2, 2, 3]))
    moved = jt.to(device)
    assert moved.values().device.type == device
    for a, b in ((jt.values(), moved.values()), (jt.weights(), moved.weights()), (jt.lengths(), moved.lengths()),
                 (jt.offsets(), moved.offsets())):
        assert torch.equal(a, b.cpu())
