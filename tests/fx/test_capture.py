"""embfuse.fx.capture: an optimized model's step replayed on batches of changing bag lengths
gives what the optimized model gives when called on each batch (forward outputs, losses, every
table and dense parameter after training), rejects what a graph cannot replay at the call with
the state unchanged, and reports a bad id found inside the graph by the first call after the
GPU has run it."""

import copy

import pytest
import torch
import torch.nn.functional as F

import embfuse
import embfuse.fx
from embfuse.bench.eager import EagerModel, eager_batch
from embfuse.ops.deferred import device_log
from tests.conftest import DEVICES
from tests.fx.test_optimize import Mixed, _inputs

SIZES = [100, 50, 200, 30]


def _batches(sizes, n, B, L, seed=1, weights=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = _inputs(sizes, B, L, g) if weights else eager_batch(sizes, B, L, g)
        out.append((*batch, torch.rand(B, 1, generator=g).round()))
    return out


def _step(opt):
    def step(model, *args):
        *inputs, target = args
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(*inputs), target)
        loss.backward()
        opt.step()
        return loss
    return step


def _pair(base, example, lr=0.1):
    """Two optimized copies of `base` (fused SGD on the tables) and a torch SGD with momentum for each
    (state made at its first step: the capture's warm-up must not keep it)."""
    models = [embfuse.fx.optimize(copy.deepcopy(base), example, optimizer=embfuse.optim.SGD(lr=lr)) for _ in range(2)]
    return [(m, torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)) for m in models]


def _tol(device):
    # on a GPU the pooling launch shape follows the value count, padding included (sparse/padded.py)
    return dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graph", [True, False])  # (False: the staged step run eagerly, the same staging)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_training_steps_match_the_model_called_batch_by_batch(device, graph):
    base = EagerModel(SIZES, dim=8, hidden=(16,), device=device)
    batches = _batches(SIZES, 5, B=6, L=3)
    target_on = [(i, o, t.to(device)) for i, o, t in batches]  # a device extra
    capacity = max(sum(i.numel() for i in b[0]) for b in batches)
    (fast, opt), (plain, plain_opt) = _pair(base, batches[0][:2])
    forward = embfuse.fx.capture(fast, batches[0][:2], capacity=capacity, graph=graph)
    with torch.no_grad():
        for ids, offsets, _ in batches:
            torch.testing.assert_close(forward(ids, offsets), plain(ids, offsets), **_tol(device))
    train = embfuse.fx.capture(fast, target_on[0], _step(opt), capacity=capacity, optimizers=[opt], graph=graph)
    for ids, offsets, target in target_on:
        loss = train(ids, offsets, target)
        torch.testing.assert_close(loss, _step(plain_opt)(plain, ids, offsets, target), **_tol(device))
    for (name, a), b in zip(fast.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name, **_tol(device))


@pytest.mark.parametrize("device,dense_on", [(d, "host") for d in DEVICES] + [(d, d) for d in DEVICES if d != "cpu"])
def test_weighted_features_and_a_dense_input_take_their_parts_of_the_buffer(device, dense_on):
    """The dense input on the host takes a part of the buffer; one already on the GPU, a tensor of its own."""
    sizes, dims = [40, 60, 25], [4, 8, 4]
    base = Mixed(sizes, dims, ["sum", "mean", "sum"], [True, False, True], device)
    g = torch.Generator().manual_seed(3)
    on = "cpu" if dense_on == "host" else dense_on
    batches = [(*_inputs(sizes, 5, 4, g), torch.randn(5, 3, generator=g).to(on),
                torch.rand(5, 1, generator=g).round()) for _ in range(4)]
    (fast, opt), (plain, plain_opt) = _pair(base, batches[0][:4])
    assert sum(isinstance(m, embfuse.fx.passes.LookupBatch) for m in fast.modules()) == 2  # weighted, not
    capacity = max(sum(i.numel() for i in b[0]) for b in batches)
    train = embfuse.fx.capture(fast, batches[0], _step(opt), capacity=capacity, optimizers=[opt])  # host target
    for batch in batches:
        torch.testing.assert_close(train(*batch), _step(plain_opt)(plain, *batch[:-1], batch[-1].to(device)),
                                   **_tol(device))
    for (name, a), b in zip(fast.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name, **_tol(device))
    ids, offsets, weights, dense, target = batches[0]
    moved = dense.cpu() if dense_on != "host" else dense.to(device)
    if moved.device != dense.device:
        before = {k: v.clone() for k, v in fast.state_dict().items()}
        with pytest.raises(ValueError, match=f"captured for torch.float32 \\(5, 3\\) on {dense.device}, got "):
            train(ids, offsets, weights, moved, target)
        assert all(torch.equal(v, before[k]) for k, v in fast.state_dict().items())


@pytest.mark.parametrize("device", DEVICES)
def test_what_a_graph_cannot_replay_is_refused_at_the_call_and_changes_nothing(device):
    base = EagerModel(SIZES, dim=8, hidden=(16,), device=device)
    batches = _batches(SIZES, 2, B=6, L=3)
    (fast, opt), _ = _pair(base, batches[0][:2])
    n = sum(i.numel() for i in batches[0][0])
    train = embfuse.fx.capture(fast, batches[0], _step(opt), capacity=n, optimizers=[opt])
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    ids, offsets, target = batches[0]
    more = [torch.cat([i, i.new_zeros(1)]) for i in ids]
    with pytest.raises(ValueError, match=f"{n + len(ids)} ids, past the captured capacity {n}"):
        train(more, offsets, target)
    with pytest.raises(ValueError, match="5 samples, the captured graph 6"):
        train(ids, [o[:5] for o in offsets], target)
    with pytest.raises(ValueError, match="argument 2: captured for torch.float32 \\(6, 1\\)"):
        train(ids, offsets, target[:3])
    bad = list(offsets)
    bad[2] = bad[2].flip(0)
    with pytest.raises(embfuse.BadBatchError, match="embs.2"):
        train(ids, bad, target)
    with pytest.raises(TypeError, match="model inputs"):
        train(ids, offsets)
    for k, v in fast.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_int32_capture_refuses_int64_ids(device):
    base = EagerModel(SIZES, dim=8, hidden=(16,), device=device)
    ids, offsets, _ = _batches(SIZES, 1, B=4, L=2)[0]
    small = ([i.int() for i in ids], [o.int() for o in offsets])
    fast = embfuse.fx.optimize(copy.deepcopy(base), small)
    forward = embfuse.fx.capture(fast, small)
    with torch.no_grad():
        forward(*small)
        with pytest.raises(TypeError, match="int64"):
            forward(ids, offsets)


def test_inputs_read_elsewhere_and_plain_models_are_refused_at_capture():
    class ReadsShape(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(10, 4)

        def forward(self, ids, offsets):
            return self.emb(ids, offsets) * ids.shape[0]

    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    fast = embfuse.fx.optimize(ReadsShape(), (ids, offsets))
    with pytest.raises(ValueError, match="input 'ids' is also read by"):
        embfuse.fx.capture(fast, (ids, offsets))
    with pytest.raises(TypeError, match="GraphModule"):
        embfuse.fx.capture(ReadsShape(), (ids, offsets))


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_id_is_reported_and_its_batch_changes_no_table(device):
    base = EagerModel(SIZES, dim=8, hidden=(16,), device=device)
    batches = _batches(SIZES, 3, B=6, L=3)
    (fast, opt), _ = _pair(base, batches[0][:2])
    capacity = max(sum(i.numel() for i in b[0]) for b in batches)
    train = embfuse.fx.capture(fast, batches[0], _step(opt), capacity=capacity, optimizers=[opt])
    train(*batches[0])
    weights = next(m for m in fast.modules() if isinstance(m, embfuse.fx.passes.LookupBatch)).collection.weights
    tables = weights.detach().clone()
    ids, offsets, target = batches[1]
    ids = list(ids)
    ids[1] = ids[1].clone()
    ids[1][0] = SIZES[1]  # one past the table
    if device == "cpu":  # the reference path checks at once
        with pytest.raises(embfuse.BadIdError, match="embs.1"):
            train(ids, offsets, target)
    else:  # the graph's check finds it on the device; the next call once the GPU has run it reports it
        train(ids, offsets, target)
        torch.cuda.synchronize()  # (a call never waits: on a busy GPU the report may come a call later)
        with pytest.raises(embfuse.BadIdError, match="embs.1"):
            train(*batches[2])
    assert torch.equal(weights.detach(), tables)
    train(*batches[2])
    assert not torch.equal(weights.detach(), tables)


@pytest.mark.gpu
def test_adam_replays_as_called_batch_by_batch_and_a_bad_batch_counts_no_step(monkeypatch):
    """Adam's bias corrections follow the GPU's count of steps inside the graph: the tables, their
    state and the step count after replays, with bad batches among them (they change nothing and
    count no step, on the GPU and on the host), are those of the good batches called one by one.
    Two bad replays and a good one before the host looks are reported together, and each takes its
    step back. (The dense layers do not train: a bad batch still trains them, on its zero pooled
    rows.)"""
    base = EagerModel(SIZES, dim=8, hidden=(16,), device="cuda")
    batches = [(i, o, t.cuda()) for i, o, t in _batches(SIZES, 6, B=6, L=3)]
    capacity = max(sum(i.numel() for i in b[0]) for b in batches)
    fast, plain = [embfuse.fx.optimize(copy.deepcopy(base), batches[0][:2], optimizer=embfuse.optim.Adam(lr=0.05))
                   for _ in range(2)]
    dense = torch.optim.SGD(fast.parameters(), lr=0.0)
    step = _step(dense)
    train = embfuse.fx.capture(fast, batches[0], step, capacity=capacity, optimizers=[dense])
    ids, offsets, target = batches[3]
    bad = [i.clone() for i in ids]
    bad[1][0] = SIZES[1]  # one past the table
    for k, batch in enumerate(batches):
        if k == 3:
            train(bad, offsets, target)
            torch.cuda.synchronize()
            with pytest.raises(embfuse.BadIdError, match="embs.1"):
                train(*batch)
        if k == 4:  # (the host looks only after all three replays)
            with monkeypatch.context() as m:
                m.setattr(type(device_log("cuda")), "poll", lambda log: None)
                train(bad, offsets, target)
                train(bad, offsets, target)
                torch.testing.assert_close(train(*batch), step(plain, *batch), rtol=1e-5, atol=1e-6)
            torch.cuda.synchronize()
            with pytest.raises(embfuse.BadIdError, match=r"deferred: 2 replay\(s\) of the CUDA graph"):
                train(*batches[5])
            continue
        torch.testing.assert_close(train(*batch), step(plain, *batch), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(fast.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name, rtol=1e-5, atol=1e-6)
    assert int(fast.state_dict()[next(k for k in fast.state_dict() if k.endswith("optimizer_step"))]) == 6


def test_the_stale_stream_switch_is_on_only_while_capturing():
    import sys

    override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if override is None:
        pytest.skip("this torch has no set_override_stale_capture_stream")
    joined = sys.modules["embfuse.fx.capture"]._stale_streams_joined
    for before in (False, True):
        override(before)
        with joined():
            assert torch._C._override_stale_capture_stream()
        assert torch._C._override_stale_capture_stream() == before
    override(False)
