import unittest.mock
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import embfuse
from embfuse.ops import tuning
from embfuse.ops.check_kernels import BAD_ID, BAD_OFFSETS
from embfuse.ops.deferred import check_errors
from embfuse.ops.validate import _ids_flags_reference, validate_bags
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels

N = 10


def _weight(device):
    return torch.randn(N, 4, device=device, requires_grad=True)


BAD_BAG_INPUTS = [
    # (ids, offsets, kwargs, exception, message fragment)
    ([1, 2, 10], [0, 1], {}, IndexError, "input[2] = 10 is out of range for a table of 10 rows"),
    ([1, -1, 3], [0, 1], {}, IndexError, "input[1] = -1 is out of range"),
    ([1, 2, 3], [1, 2], {}, ValueError, "offsets[0] must be 0, got 1"),
    ([1, 2, 3], [0, 2, 1], {}, ValueError, "offsets[1] = 2 > offsets[2] = 1"),
    ([1, 2, 3], [0, 2, 4], {"include_last_offset": True}, ValueError, "offsets[2] = 4 runs past the end"),
    ([1, 2, 3], [0, 5], {}, ValueError, "offsets[1] = 5 runs past the end of the input"),
    ([1, 2, 3], [0, 1], {"mode": "mean", "per_sample_weights": [1.0, 2.0, 3.0]}, ValueError,
     "only supported for mode='sum'"),
    ([1, 2, 3], [0, 1], {"mode": "sum", "per_sample_weights": [1.0, 2.0]}, ValueError,
     "per_sample_weights must have the same shape as the input"),
    ([1, 2, 3], [0, 1], {"mode": "sum", "per_sample_weights": [1, 2, 3]}, TypeError, "must be floating point"),
    ([1, 2, 3], None, {}, ValueError, "offsets has to be a 1-D tensor when input is 1-D"),
    ([1, 2, 3], [0, 1], {"mode": "median"}, ValueError, "mode has to be one of"),
    ([1, 2, 3], [0, 1], {"mode": "max", "scale_grad_by_freq": True}, ValueError, "frequency"),
    ([1, 2, 3], [0, 1], {"padding_idx": 10}, ValueError, "padding_idx must be within"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids,offsets,kwargs,exc,msg", BAD_BAG_INPUTS)
def test_bad_bag_input_raises_and_loses_nothing(device, ids, offsets, kwargs, exc, msg):
    w = _weight(device)
    before = w.detach().clone()
    kwargs = dict(kwargs)
    if "per_sample_weights" in kwargs:
        kwargs["per_sample_weights"] = torch.tensor(kwargs["per_sample_weights"], device=device)
    off = torch.tensor(offsets, device=device) if offsets is not None else None
    with pytest.raises(exc, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        embfuse.embedding_bag(torch.tensor(ids, device=device), w, off, max_norm=0.5, **kwargs)
    assert torch.equal(w.detach(), before)  # max_norm would have written: the check came first
    # the next good call computes the right thing (on a GPU: the context survived, nothing faulted)
    ids, off = torch.tensor([1, 2], device=device), torch.tensor([0], device=device)
    torch.testing.assert_close(embfuse.embedding_bag(ids, w, off), F.embedding_bag(ids, w, off))
    if device == "cuda":
        torch.cuda.synchronize()
        embfuse.check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_dtypes_and_shapes(device):
    w = _weight(device)
    with pytest.raises(TypeError, match="input must be int32 or int64, got torch.float32"):
        embfuse.embedding_bag(torch.tensor([1.0], device=device), w, torch.tensor([0], device=device))
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        embfuse.embedding_bag(torch.tensor([1], device=device), w, torch.tensor([0.0], device=device))
    with pytest.raises(TypeError, match="weight must be float32"):
        embfuse.embedding_bag(torch.tensor([1], device=device), w.detach().long(), torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="offsets has to be None if input is 2-D"):
        embfuse.embedding_bag(torch.ones(2, 2, dtype=torch.long, device=device), w, torch.tensor([0], device=device))
    with pytest.raises(TypeError, match="must be int32 or int64"):
        embfuse.embedding(torch.tensor([0.5], device=device), w)
    with pytest.raises(IndexError, match=r"features\[1, 0\] = 12 is out of range"):
        embfuse.embedding_bag(torch.tensor([[1, 2], [12, 0]], device=device), w, name="features")
        embfuse.check_errors()  # (deferred on a GPU)
    with pytest.raises(IndexError, match=r"input\[0, 1\] = 10 is out of range"):
        embfuse.embedding(torch.tensor([[1, 10]], device=device), w)
        embfuse.check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_skip_mode_drops_bad_ids_with_a_warning(device):
    w = _weight(device)
    ids = torch.tensor([1, 12, 3, -4, 5, 6], device=device)
    offsets = torch.tensor([0, 2, 4], device=device)
    with pytest.warns(UserWarning, match=r"skipped 2 out-of-range id\(s\); first: input\[1\] = 12"):
        out = embfuse.embedding_bag(ids, w, offsets, mode="mean", bounds_check="skip")
    ref = F.embedding_bag(torch.tensor([1, 3, 5, 6], device=device), w, torch.tensor([0, 1, 2], device=device),
                          mode="mean")
    torch.testing.assert_close(out, ref)
    with pytest.warns(UserWarning):
        rows = embfuse.embedding(torch.tensor([2, 99], device=device), w, bounds_check="skip")
    torch.testing.assert_close(rows, torch.stack([w[2], torch.zeros_like(w[2])]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # valid input: no warning
        embfuse.embedding_bag(ids.clamp(0, N - 1), w, offsets, bounds_check="skip")


def test_bad_bounds_check_mode():
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        embfuse.embedding_bag(torch.tensor([1]), _weight("cpu"), torch.tensor([0]), bounds_check="maybe")


@requires_kernels
@pytest.mark.parametrize("fault,message", [
    ("id", r"input\[9\] = 99"), ("decrease", r"offsets\[8\] = 7 > offsets\[9\] = 6"),
    ("past", r"offsets\[11\] = 11 runs past the end"), (None, None)])
def test_check_reads_ids_and_offsets_in_every_block(fault, message):
    """Blocks of 4: ids and offsets (more offsets than ids: empty bags) spread over programs; a
    fault only a later program holds is found."""
    ids = torch.arange(10, device=KERNEL_DEVICE) % N
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 8, 10], device=KERNEL_DEVICE)
    if fault == "id":
        ids[9] = 99
    elif fault == "decrease":
        offsets[9] = 6
    elif fault == "past":
        offsets[11] = 11
    with unittest.mock.patch.object(tuning, "IDS_CHECK_BLOCK", 4):
        validate_bags(ids, offsets, N, kernel=True, fresh=True)
    if fault is None:
        check_errors()
        return
    with pytest.raises((IndexError, ValueError), match=message):
        check_errors()


@requires_kernels
@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(-3, N + 3), max_size=40),
    cuts=st.lists(st.integers(-2, 45), min_size=1, max_size=8),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    clamp_last=st.booleans(),
    block=st.sampled_from([4, tuning.IDS_CHECK_BLOCK]),
    narrow=st.booleans(),
)
@example(ids=[0], cuts=[0], index_dtype=torch.int32, clamp_last=True, block=4, narrow=False)  # a lone offset
def test_kernel_flags_agree_with_torch_check(ids, cuts, index_dtype, clamp_last, block, narrow):
    """The check kernel's deferred flags and the torch-op check agree on any input, and the
    deferred error is the one the torch-op check raises at once; with `clamp_last` the last
    offset reads as at least the id count (include_last_offset's offsets as given). A block of
    4 ids spreads ids and offsets over several programs. With `narrow` the check also writes int64
    ids as the int32 ids the lookup reads."""
    ids_t = torch.tensor(ids, dtype=index_dtype, device=KERNEL_DEVICE)
    off_t = torch.tensor(cuts, dtype=index_dtype, device=KERNEL_DEVICE)
    expected = _ids_flags_reference(ids_t, off_t, N, clamp_last)
    bad_ids = any(not 0 <= i < N for i in ids)
    # (a lone offset holds no bag, so clamp_last leaves it as given: clamp_last_offset)
    ends = cuts[:-1] + [max(cuts[-1], len(ids))] if clamp_last and len(cuts) > 1 else cuts
    bad_off = ends[0] != 0 or ends[-1] > len(ids) or any(b < a for a, b in zip(ends, ends[1:]))
    assert expected == BAD_ID * bad_ids + BAD_OFFSETS * bad_off
    with unittest.mock.patch.object(tuning, "IDS_CHECK_BLOCK", block):
        read, *_, check = validate_bags(ids_t, off_t, N, kernel=True, fresh=True, clamp_last=clamp_last,
                                        narrow=narrow)
    assert int(check.status[0]) == expected
    assert read.dtype == (torch.int32 if narrow else index_dtype)
    assert torch.equal(read.long(), ids_t.long())  # (a bad lane's id too: these fit in int32)
    if not expected:
        check_errors()
        assert check.bad is False
        return
    with pytest.raises((IndexError, ValueError)) as deferred:
        check_errors()
    with pytest.raises((IndexError, ValueError)) as at_once:
        validate_bags(ids_t, off_t, N, kernel=False, bounds_check="sync", clamp_last=clamp_last)
    assert str(deferred.value).startswith(str(at_once.value))
    assert isinstance(deferred.value, RuntimeError) and isinstance(at_once.value, RuntimeError)
    assert check.bad is True


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), F=st.integers(1, 6), B=st.integers(1, 4), block=st.sampled_from([4, tuning.CHECK_BLOCK]),
       features=st.sampled_from([2, tuning.CHECK_FEATURES]))
def test_collection_check_kernel_agrees_with_torch_check(dtype, data, F, B, block, features):
    """The check kernel of a keyed batch flags what the torch-op check flags, on any lengths and
    ids (int64 and int32), bad offsets included. With `narrow` it also writes int64 values as the
    int32 values the pooling reads. Blocks of 4 values lie mostly inside one feature (the
    kernel's one-limit branch); of CHECK_BLOCK, across all of them. Feature starts are counted 2
    at a time (several rounds) or all at once. Offsets have at most one fault, ids at most one id
    at or past an edge of its feature's table, so that one decides."""
    import itertools

    from embfuse.ops.bags import bag_of_value
    from embfuse.ops.collection import Plan
    from embfuse.ops.validate import _collection_flags_reference, validate_collection

    rows = data.draw(st.lists(st.integers(1, 9), min_size=F, max_size=F))
    plan = Plan([(r, 4) for r in rows], [(f, "sum", 4 * f) for f in range(F)], KERNEL_DEVICE)
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=F * B, max_size=F * B))
    fault = data.draw(st.sampled_from([None, None, "negative length", "values short", "values long"]))
    if fault == "negative length":
        lengths[data.draw(st.integers(0, F * B - 1))] = -1
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=dtype)
    n = max(0, int(offsets[-1]) + {"values short": -1, "values long": 1}.get(fault, 0))
    values = data.draw(st.lists(st.integers(0, min(rows) - 1), min_size=n, max_size=n))
    if n and data.draw(st.booleans()):
        at = data.draw(st.integers(0, n - 1))
        f = min(F - 1, max(0, int(bag_of_value(offsets, n)[at]) // B))
        values[at] = data.draw(st.sampled_from([-1, rows[f] - 1, rows[f], 10 ** 6]))
    values, offsets = torch.tensor(values, dtype=dtype, device=KERNEL_DEVICE), offsets.to(KERNEL_DEVICE)
    expected = _collection_flags_reference(values, offsets, plan.limits, B)
    keys = [f"f{i}" for i in range(F)]
    narrow = data.draw(st.booleans())
    with unittest.mock.patch.object(tuning, "CHECK_BLOCK", block), \
            unittest.mock.patch.object(tuning, "CHECK_FEATURES", features):
        read, *_, check = validate_collection(values, offsets, None, plan.limits, B, keys, keys, kernel=True,
                                              narrow=narrow)
    assert read.dtype == (torch.int32 if narrow else dtype)
    assert torch.equal(read.long(), values.long())  # (bad values too: these fit in int32)
    got = int(check.status[0])
    # bad offsets are flagged by both; ids are compared only when the offsets are good
    assert bool(got & BAD_OFFSETS) == bool(expected & BAD_OFFSETS)
    if not expected & BAD_OFFSETS:
        assert got == expected
    with pytest.raises((IndexError, ValueError)) if expected else warnings.catch_warnings():
        check_errors()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), F=st.integers(1, 5), B=st.integers(1, 4), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_a_keyed_batchs_check_by_each_features_extremes_flags_what_every_value_does(data, F, B, dtype):
    """The torch-op check of a keyed batch of many ids a feature (RUN_CHECK_IDS; here every
    batch) reads each feature's smallest and largest id; it flags a bad id exactly where in_range,
    which compares every value with its feature's limit, finds one. Limits < 0: features whose
    ids < 0 are allowed (TensorFlow's safe rules); empty features too."""
    import itertools

    from embfuse.ops import validate

    limits = data.draw(st.lists(st.sampled_from([1, 5, 9, -1, -9]), min_size=F, max_size=F))
    lengths = data.draw(st.lists(st.integers(0, 4), min_size=F * B, max_size=F * B))
    feature = [g // B for g, length in enumerate(lengths) for _ in range(length)]
    # good ids of each value's feature, then at most one at or past an edge of its table
    values = [data.draw(st.integers(-2 if limits[f] < 0 else 0, abs(limits[f]) - 1)) for f in feature]
    if values and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(values) - 1))
        edge = abs(limits[feature[at]])
        values[at] = data.draw(st.sampled_from([-2, -1, 0, edge - 1, edge, edge + 3]))
    limits, values = torch.tensor(limits), torch.tensor(values, dtype=dtype)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    every = BAD_ID if not bool(validate.in_range(values, limits, B, offsets).all()) else 0
    with unittest.mock.patch.object(validate, "RUN_CHECK_IDS", 0):
        assert validate._collection_flags_reference(values, offsets, limits, B) == every


def test_a_keyed_batchs_check_by_each_features_extremes_reads_a_feature_of_one_id():
    """The same for a feature holding one id, out of range, beside one of good ids."""
    from embfuse.ops import validate

    values, offsets, limits = torch.tensor([5, 0, 8, 3]), torch.tensor([0, 1, 1, 3, 4]), torch.tensor([5, 9])
    with unittest.mock.patch.object(validate, "RUN_CHECK_IDS", 0):
        assert validate._collection_flags_reference(values, offsets, limits, 2) == BAD_ID
        assert validate._collection_flags_reference(values.clamp(max=4), offsets, limits, 2) == 0


def test_errors_are_catchable_as_torch_raises_them():
    """Code written for torch catches its exception classes and matches its wording: the same
    inputs raise exceptions of those classes here (besides ValueError / TypeError), with the
    phrases torch's own tests look for (issue 17 item 16)."""
    w = torch.randn(4, 3)
    ids, off = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    cases = [
        (lambda: F.embedding_bag(ids, w, off, padding_idx=7), RuntimeError, "padding_idx must be within the number"),
        (lambda: F.embedding(ids, torch.tensor(1.0)), RuntimeError, "'weight' must be 2-D"),
        (lambda: F.embedding_bag(ids, torch.zeros(2, 2, 2), off), ValueError, "weight has to be a 2D Tensor"),
        (lambda: F.embedding_bag(ids.view(1, 1, 3), w), (ValueError, RuntimeError), "input has to be 1D or 2D Tensor"),
        (lambda: F.embedding_bag(ids, w, off.view(1, 2)), (ValueError, RuntimeError), "offsets has to be a 1D Tensor"),
        (lambda: F.embedding_bag(ids, w, off, mode="mean", per_sample_weights=torch.rand(3)), NotImplementedError,
         "only supported for mode='sum'"),
        (lambda: F.embedding_bag(ids, w, off, mode="sum", per_sample_weights=torch.rand(2)), ValueError,
         "same shape as the input"),
        (lambda: F.embedding_bag(ids, w, off, mode="sum", per_sample_weights=torch.rand(3).double()), RuntimeError,
         "have the same type as"),
    ]
    for call, exc, phrase in cases:
        with pytest.raises(exc, match=phrase):  # torch
            call()
        with pytest.raises(exc, match=phrase):  # embfuse, same call
            with _swapped():
                call()


class _swapped:
    """F.embedding / F.embedding_bag replaced by embfuse's inside the block."""

    def __enter__(self):
        self.saved = F.embedding, F.embedding_bag
        F.embedding, F.embedding_bag = embfuse.embedding, embfuse.embedding_bag

    def __exit__(self, *exc):
        F.embedding, F.embedding_bag = self.saved


def test_every_tensor_argument_is_on_the_weights_device():
    """per_sample_weights and offsets on another device are refused, named (issue 17 item 2: with
    per_sample_weights on the meta device the op returned uninitialised memory); skip mode's
    zero rows are +0.0 (item 10)."""
    w = torch.randn(10, 4)
    ids, off = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="per_sample_weights is on meta but weight is on cpu"):
        embfuse.embedding_bag(ids, w, off, mode="sum", per_sample_weights=meta)
    with pytest.raises(ValueError, match="offsets is on meta but weight is on cpu"):
        embfuse.embedding_bag(ids, w, off.to("meta"), bounds_check="off")
    with pytest.warns(UserWarning):
        rows = embfuse.embedding(torch.tensor([99]), -w.abs() - 1, bounds_check="skip")
    assert torch.equal(rows, torch.zeros(1, 4)) and not torch.signbit(rows).any()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_unchecked_offsets_never_take_the_cpu_past_the_ids(mode):
    """bounds_check="off" on the CPU: offsets past the ids, negative or decreasing pool the ids
    that exist (torch's CPU kernel, given them, reads past the end of the ids)."""
    w, ids = torch.randn(10, 4, dtype=torch.float64), torch.tensor([1, 2, 3, 4, 5])
    for offsets, cut in (([0, 2, 9], [0, 2, 5]), ([0, -2, 3], [0, 0, 3]), ([0, 4, 1], [0, 4, 4])):
        got = embfuse.embedding_bag(ids, w, torch.tensor(offsets), mode=mode, bounds_check="off")
        want = torch.nn.functional.embedding_bag(ids, w, torch.tensor(cut), mode=mode)
        assert torch.equal(got, want), offsets


def test_skip_warnings_point_at_the_callers_line():
    """A skip-mode warning names the line that called embfuse, also through a module's forward
    (issue 17 item 10), not a line inside embfuse or torch."""
    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", bounds_check="skip")
    ebc = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(10, 4, "t", feature_names=["f"])],
                                         bounds_check="skip")
    kjt = embfuse.KeyedJaggedTensor(["f"], torch.tensor([1, 12]), lengths=torch.tensor([2]))
    for call in (lambda: m(torch.tensor([[1, 12]])), lambda: ebc(kjt),
                 lambda: embfuse.embedding(torch.tensor([12]), torch.randn(10, 4), bounds_check="skip")):
        with pytest.warns(UserWarning, match="skipped 1 out-of-range") as record:
            call()
        assert record[0].filename == __file__


@requires_kernels
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_collection_check_over_several_blocks_a_program(monkeypatch, chunks):
    """Blocks of 1024 values, several a program: features that start inside a block and one that
    spans blocks, a bad id in the last block of a program and one in a feature's first value;
    every block's verdict reaches the status, and a good batch passes."""
    from embfuse.ops import tuning
    from embfuse.ops.collection import Plan
    from embfuse.ops.validate import validate_collection

    monkeypatch.setattr(tuning, "check_chunks", lambda n: chunks)
    rows = [50, 3, 7000, 20]
    plan = Plan([(r, 4) for r in rows], [(f, "sum", 4 * f) for f in range(4)], KERNEL_DEVICE)
    B = 3
    lengths = torch.tensor([100, 0, 900, 1, 1, 1, 2500, 1000, 1, 0, 10, 700])
    values = torch.cat([torch.randint(0, rows[g // B], (int(n),)) for g, n in enumerate(lengths)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    keys = [f"f{i}" for i in range(4)]
    args = (offsets.to(KERNEL_DEVICE), None, plan.limits, B, keys, keys)
    *_, check = validate_collection(values.to(KERNEL_DEVICE), *args, kernel=True)
    assert int(check.status[0]) == 0
    check_errors()
    for at, value in ((2047, 7000), (1000, 3), (999, 50), (4000, -1), (int(offsets[9]), 20)):
        bad = values.clone()
        bad[at] = value
        *_, check = validate_collection(bad.to(KERNEL_DEVICE), *args, kernel=True)
        assert int(check.status[0]) == BAD_ID, at
        with pytest.raises(IndexError):
            check_errors()


@requires_kernels
def test_int32_ids_of_a_table_past_their_range_all_pass():
    """A table of more rows than int32 holds every int32 id, the largest included, also in a
    block of ids that lies inside one feature."""
    from embfuse.ops.collection import Plan
    from embfuse.ops.validate import validate_collection

    plan = Plan([(2**31 + 5, 4), (10, 4)], [(0, "sum", 0), (1, "sum", 4)], KERNEL_DEVICE)
    # feature a fills the first block of 1024 ids (one limit for the block), b starts in the next
    values = torch.full((1101,), 2**31 - 1, dtype=torch.int32, device=KERNEL_DEVICE)
    values[-1] = 9
    offsets = torch.tensor([0, 1100, 1101], dtype=torch.int32, device=KERNEL_DEVICE)
    *_, check = validate_collection(values, offsets, None, plan.limits, 1, ["a", "b"], ["a", "b"], kernel=True)
    assert int(check.status[0]) == 0
    values[-1] = 10
    *_, check = validate_collection(values, offsets, None, plan.limits, 1, ["a", "b"], ["a", "b"], kernel=True)
    assert int(check.status[0]) == BAD_ID
    with pytest.raises(IndexError, match="feature 'b'"):
        check_errors()


@requires_kernels
def test_strided_ids_and_values_are_checked_where_they_lie():
    """A column of a bigger tensor (stride 2): the check reads the column, not the memory after
    its first element (it once read [1, 0, 2] here and passed 99)."""
    from embfuse.ops.collection import Plan
    from embfuse.ops.validate import validate_collection, validate_ids

    column = torch.tensor([[1, 0], [2, 0], [99, 0]], device=KERNEL_DEVICE)[:, 0]
    _, check = validate_ids(column, N, kernel=True)
    assert int(check.status[0]) == BAD_ID
    with pytest.raises(IndexError, match="input\\[2\\] = 99"):
        check_errors()
    plan = Plan([(N, 4)], [(0, "sum", 0)], KERNEL_DEVICE)
    offsets = torch.tensor([0, 1, 3], device=KERNEL_DEVICE)
    values, *_, check = validate_collection(column, offsets, None, plan.limits, 2, ["f"], ["t"], kernel=True)
    assert values.is_contiguous() and int(check.status[0]) == BAD_ID
    with pytest.raises(IndexError, match="values\\[2\\] = 99"):
        check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_a_strided_input_looks_up_its_own_ids(device):
    w = _weight(device)
    grid = torch.tensor([[1, 9], [2, 0], [7, 0]], device=device)
    torch.testing.assert_close(embfuse.embedding(grid[:, 0], w), F.embedding(grid[:, 0], w))
    torch.testing.assert_close(embfuse.embedding_bag(grid[:, 0], w, torch.tensor([0, 2], device=device)),
                               F.embedding_bag(grid[:, 0], w, torch.tensor([0, 2], device=device)))
    kjt = embfuse.KeyedJaggedTensor(["f"], grid[:, 0], lengths=torch.tensor([1, 2], device=device))
    ebc = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(N, 4, "t", feature_names=["f"])], device=device)
    table = ebc.embedding_weight("t")
    expected = torch.stack([table[1], table[2] + table[7]])
    torch.testing.assert_close(ebc(kjt).values(), expected)
    if device == "cuda":
        embfuse.check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_a_transposed_table_is_read_as_torch_reads_it(device):
    """A table whose rows are not contiguous (stride (1, N)): the kernels read rows in order,
    so such a table takes the torch-op path; a fused optimizer, which writes rows in place,
    refuses it by name."""
    w = torch.randn(4, N, device=device).t().requires_grad_()
    ids = torch.tensor([[1, 7], [3, 3]], device=device)
    torch.testing.assert_close(embfuse.embedding_bag(ids, w, mode="sum"), F.embedding_bag(ids, w, mode="sum"))
    torch.testing.assert_close(embfuse.embedding(ids, w), F.embedding(ids, w))
    embfuse.embedding_bag(ids, w, mode="mean").sum().backward()
    expected = torch.autograd.grad(F.embedding_bag(ids, w, mode="mean").sum(), w)[0]
    torch.testing.assert_close(w.grad, expected)
    bag = embfuse.nn.EmbeddingBag(N, 4, mode="sum", device=device, optimizer=embfuse.optim.SGD(lr=0.1))
    bag.weight.data = torch.randn(4, N, device=device).t()
    with pytest.raises(ValueError, match=r"needs a contiguous table, got strides \(1, 10\) for shape \(10, 4\)"):
        bag(ids)
    if device == "cuda":
        embfuse.check_errors()
