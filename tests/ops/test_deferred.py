"""bounds_check="deferred", the default: no host read per call, a bad batch harmless, its error
raised later. Kernel guards run here under the interpreter; the whole path on the GPU."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import embfuse
from embfuse.ops.bags import backward_inputs
from embfuse.ops.collection import Plan, collection_forward
from embfuse.ops.embedding import embedding_forward
from embfuse.ops import tuning
from embfuse.ops.embedding_bag import embedding_bag_forward, embedding_bag_reference, table_backward_inputs
from embfuse.ops import check_kernels, deferred
from embfuse.ops.deferred import check_errors, device_log
from embfuse.ops.validate import _ids_flags_reference, validate_bags, validate_ids
from tests.conftest import KERNEL_DEVICE, requires_kernels

BAD = torch.tensor([1, 2], dtype=torch.int32)  # a failed check's status: flags, ticket


def _bad(device):
    return BAD.to(device)


@requires_kernels
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_forward_kernels_read_nothing_of_a_bad_batch(mode):
    dev = KERNEL_DEVICE
    w = torch.randn(6, 8, device=dev)
    ids = torch.tensor([0, 5, 99, -7, 3], device=dev)  # out of range: would fault if read
    offsets = torch.tensor([0, 2, 9, 1], device=dev)  # past the end, then decreasing
    out, max_ids = embedding_bag_forward(w, ids, offsets, None, mode, -1, status=_bad(dev))
    assert torch.equal(out, torch.zeros_like(out))
    if mode == 2:
        assert bool((max_ids == -1).all())
    assert torch.equal(embedding_forward(w, ids, status=_bad(dev)), torch.zeros(5, 8, device=dev))
    plan = Plan([(6, 8), (4, 8)], [(0, "sum", 0), (1, "mean", 8)], dev)
    out = collection_forward(w.reshape(-1).repeat(2)[:80], ids, torch.tensor([0, 2, 9, 1, 5], device=dev), None,
                             plan.meta, 2, 16, 8, 8, status=_bad(dev))
    assert torch.equal(out, torch.zeros_like(out))


@requires_kernels
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_good_status_pools_as_no_status(mode):
    """The other side of the guard: a passed check (flags 0) leaves every bag as it is."""
    dev, good = KERNEL_DEVICE, torch.tensor([0, 2], dtype=torch.int32, device=KERNEL_DEVICE)
    w = torch.randn(6, 8, device=dev)
    ids, offsets = torch.tensor([0, 5, 2, 1, 3, 4], device=dev), torch.tensor([0, 2, 2, 5], device=dev)
    assert torch.equal(embedding_bag_forward(w, ids, offsets, None, mode, -1, status=good)[0],
                       embedding_bag_forward(w, ids, offsets, None, mode, -1)[0])
    assert torch.equal(embedding_forward(w, ids, status=good), embedding_forward(w, ids))
    plan = Plan([(6, 8), (4, 8)], [(0, "sum", 0), (1, "mean", 8)], dev)
    table = torch.randn(80, device=dev)
    run = lambda **kw: collection_forward(table, ids, torch.tensor([0, 2, 2, 4, 5], device=dev), None, plan.meta,
                                          2, 16, 8, 8, **kw)
    assert torch.equal(run(status=good), run()) and run().abs().sum() > 0


@requires_kernels
def test_backward_inputs_of_a_bad_batch_name_no_row():
    """Every position gets row -1 and a bag in range, whatever the offsets (they may not cover
    the input): the reduction then reads and writes nothing."""
    dev = KERNEL_DEVICE
    ids = torch.tensor([0, 5, 99, -7, 3, 1, 1], device=dev)
    for offsets in ([0, 2, 9, 1], [0, 0, 0, 0], [3, 1, 2, 7]):
        off = torch.tensor(offsets, device=dev)
        keys, bag, scale = table_backward_inputs(ids, off, None, 1, -1, 6, 4, kernel=True, status=_bad(dev))
        assert bool((keys == -1).all()) and bool(((bag >= 0) & (bag < 3)).all())
        plan = Plan([(6, 8), (4, 8)], [(0, "sum", 0), (1, "mean", 8)], dev)
        keys, bag, _ = backward_inputs(ids, torch.tensor(offsets + [7], device=dev), None, plan.meta, 2,
                                       status=_bad(dev), kernel=True)
        assert bool((keys == -1).all()) and bool(((bag >= 0) & (bag < 4)).all())


@requires_kernels
@pytest.mark.parametrize("mode", [0, 1, 2])
@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(-2, 7), max_size=30), cuts=st.lists(st.integers(-1, 32), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.int32, torch.int64]), padding_idx=st.integers(-1, 5), weighted=st.booleans(),
       fresh=st.booleans())
def test_a_check_folded_into_the_lookup_launch(mode, ids, cuts, dtype, padding_idx, weighted, fresh):
    """A small batch's check runs as the first programs of the pooling launch (several of them
    here): the flags are the check kernel's, a good batch pools what the reference pools
    (padding and per-sample weights too), a bad one pools nothing and is reported later. Also
    with a status of its own (`fresh`: a fused lookup's, which its backward reads)."""
    dev = KERNEL_DEVICE
    w = torch.randn(6, 8, device=dev)
    ids_t = torch.tensor(ids, dtype=dtype, device=dev)
    off_t = torch.tensor(cuts + [len(ids)], dtype=dtype, device=dev)
    psw = torch.rand(len(ids), device=dev) + 0.5 if weighted and mode == 0 else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "FOLD_BLOCK", 4)
        *_, check = validate_bags(ids_t, off_t, 6, psw, kernel=True, fresh=fresh, fold=True)
        assert check.pending is not None
        out, _ = embedding_bag_forward(w, ids_t, off_t, psw, mode, padding_idx, check=check)
    assert check.pending is None
    expected = _ids_flags_reference(ids_t, off_t, 6)
    assert int(check.status[0]) == expected
    if expected:
        assert torch.equal(out, torch.zeros_like(out))
        with pytest.raises((IndexError, ValueError)):
            check_errors()
    else:
        check_errors()
        torch.testing.assert_close(out, embedding_bag_reference(w, ids_t, off_t, psw, mode, padding_idx)[0])


@requires_kernels
@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(-2, 7), min_size=1, max_size=30), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_a_check_folded_into_the_gather_launch(ids, dtype):
    """As above, for plain ids (embedding): the check's programs first in the gather's launch."""
    dev = KERNEL_DEVICE
    w = torch.randn(6, 8, device=dev)
    ids_t = torch.tensor(ids, dtype=dtype, device=dev)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "FOLD_BLOCK", 4)
        _, check = validate_ids(ids_t, 6, kernel=True, fresh=False, fold=True)
        assert check.pending is not None
        out = embedding_forward(w, ids_t, check=check)
    assert check.pending is None
    expected = _ids_flags_reference(ids_t, None, 6)
    assert int(check.status[0]) == expected
    if expected:
        assert torch.equal(out, torch.zeros_like(out))
        with pytest.raises(IndexError):
            check_errors()
    else:
        check_errors()
        torch.testing.assert_close(out, w[ids_t.long()])


def _collection(device, optimizer=None, **kw):
    tables = [embfuse.EmbeddingBagConfig(50, 8, "user", feature_names=["uid"]),
              embfuse.EmbeddingBagConfig(30, 16, "item", feature_names=["iid"], pooling="mean")]
    return embfuse.EmbeddingBagCollection(tables, device=device, optimizer=optimizer, **kw)


def _kjt(device, bad_id=False, bad_length=False):
    lengths = torch.tensor([2, 1, 3, 1, 0, 2], device=device)
    values = torch.tensor([1, 4, 49, 7, 2, 3, 29, 0, 5], device=device)
    if bad_id:
        values[6] = 30  # item has 30 rows
    if bad_length:
        lengths[1] = -1
        lengths[2] = 4
    return embfuse.KeyedJaggedTensor(["uid", "iid"], values, lengths=lengths, stride=3)


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("trace", ["fake", "make_fx"])
def test_a_device_log_made_under_tracing_holds_real_tensors(trace, monkeypatch):
    """A process whose first call is traced (torch.export on a GPU: fake, proxy and functional
    modes) makes its device log there: the log's tensors are real ones, whose ring the host reads
    (a fake ring has no host view: `.numpy()` raised, and export failed)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    monkeypatch.setattr(deferred, "_LOGS", {})
    logs = []
    if trace == "fake":
        with FakeTensorMode():
            logs.append(device_log("cpu"))
    else:
        make_fx(lambda x: logs.append(device_log("cpu")) or x + 1, tracing_mode="fake")(torch.ones(2))
    log = logs[0]
    assert not any(isinstance(t, FakeTensor) for t in (log.ring, log.status, log.scratch, *log.graph_rows))
    assert log.host.shape == (2 * log.RING,) and device_log("cpu") is log


@pytest.mark.gpu
def test_default_forward_and_fused_step_never_synchronise():
    dev = "cuda"
    ebc = _collection(dev, embfuse.optim.Adam(lr=0.1))
    bag = embfuse.nn.EmbeddingBag(40, 8, mode="mean", device=dev, optimizer=embfuse.optim.SGD(lr=0.1))
    w = torch.randn(40, 8, device=dev, requires_grad=True)
    kjt = _kjt(dev)
    ids = torch.randint(0, 40, (16, 4), device=dev)
    flat, offsets = ids.reshape(-1), torch.arange(0, 65, 4, device=dev)
    # a variable batch per feature, as a loader's .to() gives it (per-key counts known)
    vbe = embfuse.KeyedJaggedTensor(["uid", "iid"], kjt.values()[:7], lengths=kjt.lengths()[:5], length_per_key=[6, 1],
                                    stride_per_key_per_rank=[[3], [2]],
                                    inverse_indices=(["uid", "iid"], torch.tensor([[0, 1, 2], [1, 1, 0]], device=dev)))

    # batches past the folds' limits (a check launch of its own) and past NARROW_IDS (int32 ids)
    wide = torch.randn(40, tuning.NARROW_DIM, device=dev)
    many = torch.randint(0, 40, (tuning.FOLD_GATHER_IDS + 1,), device=dev)
    bags = torch.randint(0, 40, (tuning.FOLD_IDS // 64 + 1, 64), device=dev)
    narrow = torch.randint(0, 40, (tuning.NARROW_IDS // 64 + 1, 64), device=dev)

    def step():
        ebc(kjt).values().square().sum().backward()
        ebc(vbe).values().square().sum().backward()
        bag(ids).sum().backward()
        embfuse.embedding_bag(flat, w, offsets, mode="sum").sum().backward()
        with torch.no_grad():
            embfuse.embedding_bag(ids, w)
            embfuse.embedding(ids, w)
            ebc(kjt)
            embfuse.embedding(many, w)
            embfuse.embedding_bag(bags, w)
            embfuse.embedding_bag(narrow, wide)

    step()  # plans, caches, compiled kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check_errors()


@pytest.mark.gpu
def test_small_lookups_fold_their_check_into_their_launch():
    """A small eager lookup's check runs inside its lookup's launch: no check kernel of its own,
    for a plain, a pooled and a fused pooled lookup (whose status is its own: the backward reads it)."""
    dev = "cuda"
    bag = embfuse.nn.EmbeddingBag(40, 8, mode="sum", device=dev, optimizer=embfuse.optim.SGD(lr=0.1))
    w = torch.randn(40, 8, device=dev)
    ids = torch.randint(0, 40, (16, 4), device=dev)
    calls = {"fused nn.EmbeddingBag": lambda: bag(ids), "embedding_bag": lambda: embfuse.embedding_bag(ids, w),
             "embedding": lambda: embfuse.embedding(ids, w)}
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert any("checked_kernel" in k for k in kernels), (name, kernels)
        assert not any("check_ids" in k for k in kernels), (name, kernels)
    check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [embfuse.optim.SGD(lr=0.1, weight_decay=0.01), embfuse.optim.Adam(lr=0.1),
                                  embfuse.optim.RowWiseAdagrad(lr=0.1)])
@pytest.mark.parametrize("bad", ["id", "length"])
def test_deferred_bad_batch_changes_nothing_and_is_reported(rule, bad):
    dev = "cuda"
    ebc = _collection(dev, rule)
    ebc(_kjt(dev)).values().sum().backward()
    check_errors()
    before = _state(ebc)
    out = ebc(_kjt(dev, bad_id=bad == "id", bad_length=bad == "length"))  # no error here
    out.values().sum().backward()
    assert torch.equal(out.values(), torch.zeros_like(out.values()))
    with pytest.raises((IndexError, ValueError), match="feature 'iid': values\\[6\\] = 30" if bad == "id" else
                       "lengths\\[1\\] \\(sample 1\\) = -1 is negative") as e:
        check_errors()
    assert isinstance(e.value, RuntimeError) and "deferred" in str(e.value)
    _same(_state(ebc), before)  # weights, state and the step count
    fresh = _collection(dev, rule)
    fresh.load_state_dict(before)
    for m in (ebc, fresh):
        m(_kjt(dev)).values().square().sum().backward()
    _same(_state(ebc), _state(fresh))
    check_errors()


@pytest.mark.gpu
def test_deferred_error_comes_at_a_later_call_without_waiting():
    dev = "cuda"
    w = torch.randn(10, 4, device=dev)
    embfuse.embedding_bag(torch.tensor([1, 12], device=dev), w, torch.tensor([0], device=dev))
    torch.cuda.synchronize()  # the GPU has checked it: the next call reports it
    with pytest.raises(IndexError, match=r"input\[1\] = 12 is out of range"):
        embfuse.embedding(torch.tensor([1], device=dev), w)
    check_errors()


@pytest.mark.gpu
def test_single_table_bad_batch_gradient_is_zero_and_dense_grad_safe():
    dev = "cuda"
    w = torch.randn(10, 4, device=dev, requires_grad=True)
    for sparse in (False, True, "rowwise"):
        out = embfuse.embedding_bag(torch.tensor([1, 12, 3], device=dev), w, torch.tensor([0, 1], device=dev),
                                    mode="sum", sparse=sparse, per_sample_weights=torch.rand(3, device=dev))
        out.sum().backward()
        g = w.grad.to_dense() if w.grad.is_sparse else w.grad
        assert torch.equal(g, torch.zeros_like(g))
        w.grad = None
        with pytest.raises(IndexError):
            check_errors()
    out = embfuse.embedding(torch.tensor([[1, -3]], device=dev), w)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w.grad))
    with pytest.raises(IndexError, match=r"input\[0, 1\] = -3"):
        check_errors()


@requires_kernels
def test_a_graphs_check_counts_its_bad_replays_and_a_good_replay_hides_none(monkeypatch):
    """A check captured into a CUDA graph runs again at every replay with the same ring slot. The
    ring word counts the bad replays, so a good replay after a bad one hides nothing, and the host
    reports each bad replay once. Its undo hooks run once a bad replay only where the host counted
    the replays (embfuse.fx.capture). (Interpreter: the check's kernel launched as a replay would.)"""
    log = device_log(KERNEL_DEVICE)
    log.poll()
    monkeypatch.setattr(deferred, "tracing", lambda: True)  # a graph's slot, as under a capture
    check = log.start(lambda: None, "the test's", fresh=False)  # (finds nothing now: the message says what the GPU saw)
    monkeypatch.undo()
    undone = []
    check.undo.append(lambda: undone.append(1))
    ids = torch.tensor([1, 2, 3], device=KERNEL_DEVICE)

    def replay(second):
        ids[1] = second
        check.status.zero_()
        check_kernels.launch_ids_check(log, check, ids, None, 5)

    replay(7)
    replay(2)
    with pytest.raises(embfuse.BadIdError, match=r"deferred: 1 replay\(s\) of the CUDA graph that captured"):
        log.poll()
    log.poll()  # (reported once)
    replay(9)
    replay(-1)
    replay(4)
    with pytest.raises(embfuse.BadIdError, match=r"#\d+ had an out-of-range id \[deferred: 2 replay\(s\)"):
        log.poll()
    assert undone == []  # a raw graph's replays count no step: nothing to take back
    check.replays_counted = True
    replay(5)
    replay(5)
    with pytest.raises(embfuse.BadIdError, match=r"deferred: 2 replay\(s\)"):
        log.poll()
    assert undone == [1, 1]
    log.next_graph_slot = check.slot  # (as after RING more graph checks): the new check takes the slot over
    monkeypatch.setattr(deferred, "tracing", lambda: True)
    again = log.start(lambda: None, "the test's", fresh=False)
    assert list(log.graph_checks.values()).count(again) == 1 and check not in log.graph_checks.values()
    log.poll()  # (the old check's count went with it)


@pytest.mark.gpu
def test_cuda_graph_replay_of_a_bad_batch_is_reported_at_the_next_check():
    dev = "cuda"
    w = torch.randn(10, 4, device=dev)
    ids = torch.randint(0, 10, (8, 3), device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        embfuse.embedding_bag(ids, w, mode="sum")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = embfuse.embedding_bag(ids, w, mode="sum")
    g.replay()
    check_errors()
    ref = out.clone()
    good = ids[2, 1].clone()
    ids[2, 1] = 10
    g.replay()
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(IndexError, match="out of range"):
        check_errors()
    ids[2, 1] = good
    g.replay()
    check_errors()  # good again
    assert torch.equal(out, ref)
    ids[2, 1] = -1
    g.replay()
    ids[2, 1] = good
    g.replay()  # (a good replay before the host looks hides nothing)
    with pytest.raises(IndexError, match=r"out-of-range id \[deferred: 1 replay\(s\) of the CUDA graph"):
        check_errors()
    assert torch.equal(out, ref)
    assert len(device_log(dev).graph_checks) >= 1


@pytest.mark.gpu
def test_compiled_lookup_is_checked():
    dev = "cuda"
    torch._dynamo.reset()
    w = torch.randn(10, 4, device=dev)
    f = torch.compile(lambda i: embfuse.embedding_bag(i, w, mode="sum") * 2, fullgraph=True)
    ok = torch.randint(0, 10, (8, 3), device=dev)
    torch.testing.assert_close(f(ok), 2 * torch.nn.functional.embedding_bag(ok, w, mode="sum"))
    check_errors()
    bad = ok.clone()
    bad[1, 1] = 11
    assert torch.equal(f(bad), torch.zeros(8, 4, device=dev))
    with pytest.raises(IndexError, match=r"input\[1, 1\] = 11"):
        check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [1, 4])
def test_a_compiled_collection_is_checked_with_several_blocks_a_program(monkeypatch, chunks):
    """A keyed batch's check traced with one block of values a program and with several (the form
    that eager launches hold to tuning.CHECK_MAXNREG registers, an option a traced launch does not
    take): the eager result, and a bad id reported at the next check point."""
    dev = "cuda"
    torch._dynamo.reset()
    monkeypatch.setattr(tuning, "check_chunks", lambda n: chunks)
    ebc = _collection(dev)
    f = torch.compile(lambda k: ebc(k).values(), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(f(_kjt(dev)), ebc(_kjt(dev)).values())
        check_errors()
        out = f(_kjt(dev, bad_id=True))
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(IndexError, match="feature 'iid': values\\[6\\] = 30"):
        check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("last", [False, True])
def test_compiled_lookup_takes_torchs_offsets(last):
    """A compiled lookup without gradients given 1-D ids and torch's offsets (B starts, or B + 1
    with include_last_offset), which the eager call hands to the kernel as given: torch's result,
    and a last offset past the ids reported at the next check point."""
    dev = "cuda"
    torch._dynamo.reset()
    w = torch.randn(10, 4, device=dev)
    ids = torch.randint(0, 10, (9,), device=dev)
    offsets = torch.tensor([0, 2, 2, 7] + [9] * last, device=dev)
    f = torch.compile(lambda i, o: embfuse.embedding_bag(i, w, o, include_last_offset=last) * 2, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(f(ids, offsets), 2 * torch.nn.functional.embedding_bag(
            ids, w, offsets, include_last_offset=last))
        check_errors()
        bad = offsets.clone()
        bad[-1] = 10
        f(ids, bad)
    with pytest.raises(embfuse.BadBatchError, match=f"offsets\\[{3 + last}\\] = 10 runs past the end"):
        check_errors()
