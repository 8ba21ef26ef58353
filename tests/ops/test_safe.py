"""TensorFlow's safe rules over a keyed batch (ops/safe.py): the kernel (interpreted in CI)
against the torch reference, and the reference against the rules written out bag by bag."""

from unittest import mock

import pytest
import torch

from embfuse.ops.safe import safe_bags, safe_bags_reference, safe_rules
from tests.conftest import KERNEL_DEVICE, requires_kernels

# (drops ids < 0, drops weights <= 0, default id): a plain feature, the three TF combinations
FEATURES = [(False, False, None), (True, True, 2), (True, False, None), (True, False, 0), (True, True, None)]


def batch(B, device, weighted, max_len=5, index_dtype=torch.int64, features=FEATURES):
    F = len(features)
    lengths = torch.randint(0, max_len + 1, (F * B,))
    lengths[1] = 0  # an empty bag of the plain feature
    lengths[B] = 0  # and of one with a default
    n = int(lengths.sum())
    feats = torch.arange(F).repeat_interleave(B).repeat_interleave(lengths)
    values = torch.randint(0, 7, (n,))
    drops = torch.tensor([d for d, _, _ in features])[feats]
    values = torch.where(drops & (torch.rand(n) < 0.3), -torch.randint(1, 4, (n,)), values)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    psw = None
    if weighted:
        psw = torch.rand(n) + 0.1
        psw = torch.where(torch.rand(n) < 0.3, -psw, psw)
        psw[torch.rand(n) < 0.1] = 0.0
        psw = psw.to(device)
    return values.to(device, index_dtype), offsets.to(device, index_dtype), psw


def by_hand(values, offsets, psw, B):
    """The rules bag by bag: (values, offsets, weights) as lists."""
    out_v, out_w, out_off = [], [], [0]
    for g in range(offsets.numel() - 1):
        drop_neg, drop_w, default = FEATURES[g // B]
        kept = 0
        for p in range(int(offsets[g]), int(offsets[g + 1])):
            v, w = int(values[p]), 1.0 if psw is None else float(psw[p])
            keep = not (drop_neg and v < 0) and not (drop_w and w <= 0)
            kept += keep
            out_v.append(v if keep else -1)
            out_w.append(w if keep else 0.0)
        if default is not None:
            out_v.append(default if kept == 0 else -1)
            out_w.append(float(kept == 0))
        out_off.append(len(out_v))
    return out_v, out_off, out_w


@pytest.mark.parametrize("weighted", [False, True])
def test_reference_is_the_rules_bag_by_bag(weighted):
    B = 4
    values, offsets, psw = batch(B, "cpu", weighted)
    rules = safe_rules(FEATURES, "cpu")
    assert rules.defaults == 2
    v, o, w = safe_bags_reference(values, offsets, psw, rules.table, B, 2 * B, torch.float64)
    want_v, want_off, want_w = by_hand(values, offsets, None if psw is None else psw.double(), B)
    assert v.tolist() == want_v and o.tolist() == want_off
    # (without weights none come out: each entry weighs 1, a SKIPPED one nothing, read from the ids)
    assert w.tolist() == want_w if weighted else w is None


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_matches_the_reference(weighted, index_dtype):
    B = 6
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=40, index_dtype=index_dtype)  # bags > a block
    rules = safe_rules(FEATURES, KERNEL_DEVICE)
    got = safe_bags(values, offsets, psw, rules, B, kernel=True)
    want = safe_bags(values, offsets, psw, rules, B, kernel=False)
    assert_same(got, want)
    assert got[0].dtype == index_dtype and got[1].dtype == index_dtype


def assert_same(got, want):
    """Two passes' (values, offsets, weights or None) bitwise equal."""
    assert (got[2] is None) == (want[2] is None)
    for a, b in zip(got, want):
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b))


@requires_kernels
@pytest.mark.parametrize("kernel", [True, False])
def test_a_bad_batch_comes_out_as_empty_bags_within_bounds(kernel):
    """A status that says bad: nothing of the (garbage) offsets is followed; every bag but one
    is empty, the sizes are those of a good batch."""
    B = 3
    values, offsets, psw = batch(B, KERNEL_DEVICE, True)
    offsets[2] = 10**9  # would run far past the values
    rules = safe_rules(FEATURES, KERNEL_DEVICE)
    status = torch.tensor([2, 0], dtype=torch.int32, device=KERNEL_DEVICE)
    v, o, w = safe_bags(values, offsets, psw, rules, B, status=status, kernel=kernel)
    n = values.numel() + B * rules.defaults
    assert v.numel() == w.numel() == n and o.numel() == offsets.numel()
    assert int(o[-1]) == n and bool((o[:-1] <= n).all()) and bool((o[:-1] >= 0).all())


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck_and_compile(weighted):
    """The pass is a registered op (fake kernel, schema) that torch.compile traces whole."""
    B = 4
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted)
    rules = safe_rules(FEATURES, KERNEL_DEVICE)
    status = torch.zeros(2, dtype=torch.int32, device=KERNEL_DEVICE)
    torch.library.opcheck(torch.ops.embfuse.safe_bags,
                          (values, offsets, psw, status, rules.table, B, B * rules.defaults, torch.float32))
    compiled = torch.compile(lambda v, o, w: safe_bags(v, o, w, rules, B, kernel=True), fullgraph=True)
    assert_same(compiled(values, offsets, psw), safe_bags(values, offsets, psw, rules, B, kernel=False))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("check", ["good", "bad", None])
def test_rules_that_only_drop_negative_ids_write_nothing(compiled, weighted, check):
    """TensorFlow's sum (and an unweighted mean or sqrtn) without a default id drops ids < 0 and
    nothing else. The kernels of a batch that skips pass over every id < 0, so the ids and offsets
    go on as they came, a bad batch's too (its status stops it), and the pass over bags is not
    run: the reference's batch but for the ids < 0 it writes SKIPPED. Only weights are written, 0
    at each id < 0."""
    B = 40
    features = [(False, False, None), (True, False, None), (True, False, None)]
    values, offsets, psw = batch(B, KERNEL_DEVICE, weighted, max_len=40, features=features)
    values[values < 0] *= 1000  # (not only the -1 the reference writes)
    rules = safe_rules(features, KERNEL_DEVICE)
    if check == "bad":
        offsets[2] = 10**9  # (an offset past the end)
    status = None if check is None else torch.tensor([0 if check == "good" else 2, 0], dtype=torch.int32,
                                                     device=KERNEL_DEVICE)

    def run(v, o, w, s):
        return safe_bags(v, o, w, rules, B, status=s)
    with mock.patch("embfuse.ops.safe.safe_bags_kernel", side_effect=AssertionError("the pass ran")), \
            mock.patch("embfuse.ops.safe._safe_bags_torch", side_effect=AssertionError("the pass ran")):
        got = (torch.compile(run, fullgraph=True) if compiled else run)(values, offsets, psw, status)
    if not compiled:
        assert got[0] is values and got[1] is offsets
    assert_same(got, (values, offsets, None if psw is None else torch.where(values < 0, 0, psw)))
    if check != "bad":
        want = safe_bags_reference(values, offsets, psw, rules.table, B, 0)
        assert_same((got[0].clamp(min=-1), *got[1:]), (want[0], want[1].to(offsets.dtype), want[2]))
