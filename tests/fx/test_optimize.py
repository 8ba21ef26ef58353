"""embfuse.fx.optimize and its passes against the eager model they rewrite: outputs and gradients
within fp32 tolerance of torch's own (fresh random inputs), the state_dict's keys and shapes, the
batched tables trained by a fused optimizer as torch.optim trains the eager ones, bad inputs
named by feature, and clean refusals."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import embfuse
import embfuse.fx
from embfuse.bench.eager import EagerModel, eager_batch
from embfuse.fx.passes import LookupBatch, RowView
from embfuse.fx.passes.lookups import _on_device
from embfuse.fx.staging import copy_to_device
from tests.conftest import DEVICES

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 models (a collection stores fp32/fp16/bf16): the order of additions


class Mixed(nn.Module):
    """Mixed widths and poolings, weighted features (sum), a dense input moved on its own, and
    per-feature chains straight after the lookups (no split)."""

    def __init__(self, sizes, dims, modes, weighted, device):
        super().__init__()
        self.embs = nn.ModuleDict({f"f{k}": nn.EmbeddingBag(n, d, mode=m, device=device)
                                   for k, (n, d, m) in enumerate(zip(sizes, dims, modes))})
        self.weighted = weighted
        self.dense = nn.Linear(3, 4, device=device)
        self.top = nn.Linear(sum(dims) + 4, 1, device=device)

    def forward(self, ids, offsets, weights, dense):
        dev = self.top.weight.device
        pooled = []
        for k, emb in enumerate(self.embs.values()):
            w = weights[k].to(dev) if self.weighted[k] else None
            pooled.append(emb(ids[k].to(dev), offsets[k].to(dev), per_sample_weights=w))
        x = torch.cat(pooled + [self.dense(dense.to(dev))], dim=1)
        return self.top(torch.relu(x))


def _inputs(sizes, B, L, g):
    ids, offsets = eager_batch(sizes, B, L, g)
    weights = [torch.rand(i.numel(), generator=g) + 0.5 for i in ids]
    return ids, offsets, weights


def _table_grads(model, fast):
    """(eager, fast) gradient of every table, dense."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.EmbeddingBag):
            batch = next(b for b in fast.modules() if isinstance(b, LookupBatch) and name in b.names)
            flat = batch.collection.weights.grad
            view = batch.collection.table_weights()[batch.names.index(name)]
            g = flat.view(-1)[view.storage_offset() - batch.collection.weights.storage_offset():][:view.numel()]
            out.append((m.weight.grad.to_dense() if m.weight.grad.is_sparse else m.weight.grad, g.view_as(view)))
    return out


def _grad(fast, name):
    """The gradient of the original parameter `name` in `fast`: its own, or its row of a FusedChain's stack."""
    try:
        return fast.get_parameter(name).grad
    except AttributeError:
        path, _, attr = name.rpartition(".")
        view = fast.get_submodule(path)
        assert isinstance(view, RowView), name
        return getattr(view._owner[0], f"{attr}_{view._op}").grad[view._index]


def _check_grads(model, fast):
    for (name, p) in model.named_parameters():
        if "embs" not in name:
            torch.testing.assert_close(_grad(fast, name), p.grad, **TOL)
    for eager, ours in _table_grads(model, fast):
        torch.testing.assert_close(ours, eager, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 5, 64])
@pytest.mark.parametrize("mode,affine", [("mean", True), ("sum", False)])
def test_eager_model(device, N, mode, affine):
    g = torch.Generator().manual_seed(N)
    sizes = [int(s) for s in torch.randint(5, 200, (N,), generator=g)]
    model = EagerModel(sizes, 4, mode=mode, hidden=(8,), affine=affine, device=device)
    ids, offsets = eager_batch(sizes, 6, 3, g)
    fast = embfuse.fx.optimize(model, (ids, offsets))
    assert any(r.startswith("batched") for r in fast.embfuse_report)
    assert N == 1 or any(r.startswith("fused") for r in fast.embfuse_report), fast.embfuse_report
    assert sum(isinstance(m, LookupBatch) for m in fast.modules()) == 1
    expected, actual = model(ids, offsets), fast(ids, offsets)
    torch.testing.assert_close(actual, expected, **TOL)
    with torch.no_grad():  # inference: the chain in the lookup's epilogue (PooledChain) on a GPU
        torch.testing.assert_close(fast(ids, offsets), expected, **TOL)
    expected.square().sum().backward()
    actual.square().sum().backward()
    _check_grads(model, fast)
    # same keys and shapes; the originals' tables reachable under their names
    assert {k: v.shape for k, v in fast.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    torch.testing.assert_close(fast.get_submodule("embs.0").weight, model.embs[0].weight)
    if affine and N > 1:
        torch.testing.assert_close(fast.get_submodule(f"norms.{N - 1}").bias, model.norms[N - 1].bias)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_widths_weights_and_dense_copies(device):
    g = torch.Generator().manual_seed(1)
    sizes, dims = [30, 70, 20, 90], [3, 8, 5, 8]
    modes, weighted = ["sum", "mean", "sum", "sum"], [True, False, False, True]
    model = Mixed(sizes, dims, modes, weighted, device)
    ids, offsets, weights = _inputs(sizes, 5, 4, g)
    dense = torch.randn(5, 3, generator=g)
    args = (ids, offsets, weights, dense)
    fast = embfuse.fx.optimize(model, args)
    batches = [m for m in fast.modules() if isinstance(m, LookupBatch)]
    assert sorted(len(b.names) for b in batches) == [2, 2]  # weighted and unweighted features
    expected, actual = model(*args), fast(*args)
    torch.testing.assert_close(actual, expected, **TOL)
    expected.sum().backward()
    actual.sum().backward()
    _check_grads(model, fast)


@pytest.mark.parametrize("device", DEVICES)
def test_training_with_a_fused_optimizer_matches_torch_optim(device):
    g = torch.Generator().manual_seed(2)
    sizes = [40, 60, 50]
    model = EagerModel(sizes, 4, hidden=(8,), device=device)
    ids, offsets = eager_batch(sizes, 6, 3, g)
    fast = embfuse.fx.optimize(model, (ids, offsets), optimizer=embfuse.optim.SGD(lr=0.1))
    eager_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.1)  # the tables' grads stay None: fused
    for step in range(3):
        ids, offsets = eager_batch(sizes, 6, 3, g)
        for m, opt in ((model, eager_opt), (fast, fast_opt)):
            opt.zero_grad()
            m(ids, offsets).square().mean().backward()
            opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[k], v, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_of_the_eager_model(device):
    sizes = [30, 40]
    model = EagerModel(sizes, 4, hidden=(8,), device=device)
    ids, offsets = eager_batch(sizes, 4, 2)
    fast = embfuse.fx.optimize(model, (ids, offsets), optimizer=embfuse.optim.Adagrad(lr=0.1))
    other = EagerModel(sizes, 4, hidden=(8,), device=device)  # fresh weights
    fast.load_state_dict(other.state_dict())  # strict: the optimizer state keeps its current value
    torch.testing.assert_close(fast(ids, offsets), other(ids, offsets), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast.get_submodule("embs.1").weight, other.embs[1].weight, rtol=0, atol=0)
    # optimize copied the model: training the fast one leaves the original alone
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast(ids, offsets).sum().backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("device", DEVICES)
def test_bad_ids_and_offsets_name_the_feature_and_change_nothing(device):
    sizes = [30, 40, 50]
    model = EagerModel(sizes, 4, hidden=(8,), device=device)
    ids, offsets = eager_batch(sizes, 4, 3)
    fast = embfuse.fx.optimize(model, (ids, offsets), optimizer=embfuse.optim.Adam(lr=0.1))
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    bad = [i.clone() for i in ids]
    bad[1][0] = 40
    with pytest.raises(embfuse.BadIdError, match="embs.1"):
        fast(bad, offsets).sum().backward()
        embfuse.check_errors()
    shifted = [o.clone() for o in offsets]
    shifted[2][0] = 1
    with pytest.raises(embfuse.BadBatchError, match="embs.2"):
        fast(ids, shifted).sum().backward()
        embfuse.check_errors()
    after = fast.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "embs" in k or "optimizer" in k)
    fast(ids, offsets)  # still usable


@pytest.mark.parametrize("device", DEVICES)
def test_first_offset_not_zero_on_the_device_path(device):
    """Device inputs take the device route (no host read): a feature whose offsets[0] is not 0
    gets global offsets the collection's check refuses, instead of pooling its neighbour's ids."""
    sizes = [30, 40, 20]
    ids, offsets = eager_batch(sizes, 4, 3)
    ids, offsets = [i.to(device) for i in ids], [o.to(device) for o in offsets]
    n = sum(i.numel() for i in ids)
    for f, shift in ((1, 1), (2, -1), (0, 2)):
        bad = list(offsets)
        bad[f] = offsets[f] + shift
        _, offs, _ = _on_device(ids, bad, None, 4, device)
        offs = offs.cpu()
        assert offs[0] != 0 or (offs[1:] < offs[:-1]).any() or offs[-1] != n
    _, offs, _ = _on_device(ids, offsets, None, 4, device)
    assert torch.equal(offs.cpu(), torch.cat([o.cpu() + sum(i.numel() for i in ids[:k]) for k, o in enumerate(offsets)]
                                             + [torch.tensor([n])]))
    if device == "cuda":
        model = EagerModel(sizes, 4, hidden=(8,), device=device)
        batch = LookupBatch(["a", "b", "c"], list(model.embs), False)
        bad = list(offsets)
        bad[1] = offsets[1] + 1
        with pytest.raises(embfuse.BadBatchError):
            batch(tuple(ids), tuple(bad), (None,) * 3)
            embfuse.check_errors()


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 4)

    def forward(self, ids, offsets):
        x = self.emb(ids, offsets)
        return x * 2 if x.sum() > 0 else x


class MaxPooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(10, 4, mode="max")
        self.b = nn.EmbeddingBag(10, 4)

    def forward(self, ids, offsets):
        return torch.cat([self.a(ids, offsets), self.b(ids, offsets)], 1)


def test_refusals_are_clean():
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    model = Branchy()
    with pytest.warns(UserWarning, match="returned unchanged: TraceError"):
        assert embfuse.fx.optimize(model) is model
    dense = nn.Sequential(nn.Linear(3, 3))
    with pytest.warns(UserWarning, match="nothing to rewrite"):
        assert embfuse.fx.optimize(dense) is dense
    model = MaxPooled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = embfuse.fx.optimize(model)
    assert "left a: mode='max' is not batched" in " ".join(fast.embfuse_report)
    torch.testing.assert_close(fast(ids, offsets), model(ids, offsets))
    with pytest.raises(ValueError, match="unknown passes"):
        embfuse.fx.optimize(model, passes=["nope"])


class Chains(nn.Module):
    """split -> chain -> cat with functional ops, a GELU module and an unmatched chain."""

    def __init__(self, N, D, same=True):
        super().__init__()
        self.N, self.D, self.same = N, D, same
        self.w = nn.ParameterList(nn.Parameter(torch.rand(D) + 0.5) for _ in range(N))
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        parts = x.split(self.D, dim=1)
        outs = [self.act(F.layer_norm(p, (self.D,), self.w[k], None, 1e-3)).sigmoid() for k, p in enumerate(parts)]
        if not self.same:
            outs[-1] = torch.relu(parts[-1])
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("same", [True, False])
def test_horizontal_fusion_alone(same):
    model = Chains(5, 3, same)
    x = torch.randn(7, 15, requires_grad=True)
    gm = embfuse.fx.passes.fuse_horizontal(embfuse.fx.trace_model(model, (x,)))
    fused = any(n.target is embfuse.fx.passes.horizontal.as_blocks for n in gm.graph.nodes)
    assert fused == same
    expected, actual = model(x), gm(x)
    torch.testing.assert_close(actual, expected, **TOL)
    (ge,) = torch.autograd.grad(expected.sum(), x)
    (ga,) = torch.autograd.grad(actual.sum(), x)
    torch.testing.assert_close(ga, ge, **TOL)
    with pytest.raises(ValueError, match="fused chains expect"):
        if same:
            gm(torch.randn(7, 14))
        else:
            raise ValueError("fused chains expect (nothing was fused)")



class ChainsBeside(nn.Module):
    """Two tensors' chains in one cat with a dense part between and around them (DLRM's cat of
    the dense output and the pooled features): each run fused, the rest left in the cat."""

    def __init__(self, D):
        super().__init__()
        self.D = D
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(3))
        with torch.no_grad():
            for norm in self.norms:
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x, y, dense):
        first = [torch.tanh(n(p)) for n, p in zip(self.norms, x.split(self.D, dim=1))]
        second = [torch.relu(p) for p in y.split(self.D, dim=1)]
        return torch.cat([dense] + first + [dense.sigmoid()] + second, dim=1)


def test_horizontal_fusion_of_runs_inside_a_larger_cat():
    model = ChainsBeside(4)
    args = [torch.randn(5, 12, requires_grad=True), torch.randn(5, 8, requires_grad=True), torch.randn(5, 3)]
    report = []
    gm = embfuse.fx.passes.fuse_horizontal(embfuse.fx.trace_model(model, args), report)
    assert report == ["fused 3 chains of layer_norm -> tanh over 3 x 4 into one",
                      "fused 2 chains of relu over 2 x 4 into one"]
    (cat,) = [n for n in gm.graph.nodes if n.target is torch.cat]
    assert len(cat.args[0]) == 4  # dense, the first run, the sigmoid, the second run
    expected, actual = model(*args), gm(*args)
    torch.testing.assert_close(actual, expected, **TOL)
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, args[:2], g), torch.autograd.grad(expected, args[:2], g),
                               **TOL)


class TwoWidths(nn.Module):
    """Features of widths 4 and 8 (one batched lookup), LayerNorm -> tanh each, one cat."""

    def __init__(self, device):
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(30, d, mode="mean", device=device) for d in (4, 4, 8, 8))
        self.norms = nn.ModuleList(nn.LayerNorm(d, device=device) for d in (4, 4, 8, 8))
        self.top = nn.Linear(24, 1, device=device)

    def forward(self, ids, offsets):
        pooled = [torch.tanh(n(e(i, o))) for e, n, i, o in zip(self.embs, self.norms, ids, offsets)]
        return self.top(torch.cat(pooled, dim=1))


@pytest.mark.parametrize("device", DEVICES)
def test_runs_over_part_of_a_lookups_output_are_fused(device):
    """A batched lookup of two widths: each width's run of chains fused on its columns."""
    model = TwoWidths(device)
    g = torch.Generator().manual_seed(3)
    ids, offsets = eager_batch([30] * 4, 5, 3, g)
    ids, offsets = [i.to(device) for i in ids], [o.to(device) for o in offsets]
    fast = embfuse.fx.optimize(model, (ids, offsets))
    assert [r for r in fast.embfuse_report if r.startswith("fused")] == [
        "fused 2 chains of layer_norm -> tanh over 2 x 4 into one",
        "fused 2 chains of layer_norm -> tanh over 2 x 8 into one"]
    expected, actual = model(ids, offsets), fast(ids, offsets)
    torch.testing.assert_close(actual, expected, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, offsets), expected, **TOL)
    expected.square().sum().backward()
    actual.square().sum().backward()
    _check_grads(model, fast)

def test_copy_to_device_keeps_every_tensor():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    parts = [torch.arange(5), torch.rand(2, 3), torch.tensor([True, False]), torch.empty(0, dtype=torch.int32),
             torch.rand(3, requires_grad=True)]
    moved = copy_to_device(parts, dev)
    for a, b in zip(parts, moved):
        assert b.device.type == dev and b.dtype == a.dtype and b.shape == a.shape
        torch.testing.assert_close(b.cpu(), a.detach())
    assert moved[-1].requires_grad


@pytest.mark.gpu
def test_one_copy_and_no_sync_on_the_gpu():
    """The optimized eager model on the GPU: host inputs cross in two copies (the batch's, the
    rest's), and a forward plus a fused training step run under sync-debug "error"."""
    sizes = [100] * 8
    model = Mixed(sizes, [4] * 8, ["sum"] * 8, [False] * 8, "cuda")
    g = torch.Generator().manual_seed(3)
    ids, offsets, weights = _inputs(sizes, 16, 4, g)
    args = (ids, offsets, weights, torch.randn(16, 3))
    fast = embfuse.fx.optimize(model, args, optimizer=embfuse.optim.SGD(lr=0.1))
    fast(*args)  # first call: the collection's plan moves to the device once
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fast(*args)
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) <= 2, [e.name for e in copies]
    torch.testing.assert_close(fast(*args), model(*args), **TOL)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast(*args).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    embfuse.check_errors()


def test_compiled_training_equals_eager_optimize():
    """torch.compile(fullgraph=True) of an optimized model with a fused optimizer: the batched
    lookup and its update are ops of the graph; training gives the same tables."""
    sizes = [30, 40]
    model = EagerModel(sizes, 4, hidden=(8,))
    ids, offsets = eager_batch(sizes, 4, 2)
    plain = embfuse.fx.optimize(model, (ids, offsets), optimizer=embfuse.optim.SGD(lr=0.1))
    compiled = embfuse.fx.optimize(model, (ids, offsets), optimizer=embfuse.optim.SGD(lr=0.1))
    run = torch.compile(compiled, fullgraph=True)
    for _ in range(2):
        plain(ids, offsets).sum().backward()
        run(ids, offsets).sum().backward()
    torch.testing.assert_close(compiled.get_submodule("embs.1").weight, plain.get_submodule("embs.1").weight, **TOL)



@pytest.mark.parametrize("device", DEVICES)
def test_compiled_inference_keeps_the_pooled_chain_in_the_graph(device):
    """The lookup with LayerNorm + tanh in its epilogue (PooledChain) under
    torch.compile(fullgraph=True) and no_grad: the eager model's output."""
    sizes = [30, 40, 25]
    model = EagerModel(sizes, 4, hidden=(8,), device=device)
    ids, offsets = eager_batch(sizes, 5, 3)
    fast = embfuse.fx.optimize(model, (ids, offsets))
    assert any("pooling kernel" in r for r in fast.embfuse_report), fast.embfuse_report
    run = torch.compile(fast, fullgraph=True)
    with torch.no_grad():
        for batch in ((ids, offsets), eager_batch(sizes, 5, 3, torch.Generator().manual_seed(7))):
            torch.testing.assert_close(run(*batch), model(*batch), **TOL)

def test_copy_all_spreads_large_copies_over_threads():
    from embfuse.fx.staging import copy_all

    srcs = [torch.randint(0, 1 << 40, (n,)) for n in (300_000, 1, 0, 250_000, 70_000)]
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.int64)
    starts = torch.tensor([0] + [s.numel() for s in srcs]).cumsum(0).tolist()
    copy_all([(dst[a:b], s) for a, b, s in zip(starts, starts[1:], srcs)])
    assert torch.equal(dst, torch.cat(srcs))


class PerFeature(nn.Module):
    """What torch.compile sees of the seed model's chain: LayerNorm modules and tanh over a split."""

    def __init__(self, N, D):
        super().__init__()
        self.D = D
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))
        with torch.no_grad():
            for n in self.norms:
                n.weight.uniform_(0.5, 1.5)
                n.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        parts = torch.split(x, self.D, dim=1)
        return torch.cat([torch.tanh(n(p)) for n, p in zip(self.norms, parts)], dim=1)


def test_inductor_pre_grad_pass():
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    model = PerFeature(4, 8)
    x = torch.randn(5, 32, requires_grad=True)
    fusion = embfuse.fx.passes.HorizontalFusion()
    assert fusion.uuid() == embfuse.fx.passes.HorizontalFusion().uuid()
    with inductor.patch(pre_grad_custom_pass=fusion, force_disable_caches=True):  # (a cached graph skips passes)
        compiled = torch.compile(model, fullgraph=True)
        actual = compiled(x)
    assert fusion.fused == 1
    expected = model(x)
    torch.testing.assert_close(actual, expected, **TOL)
    (ga,) = torch.autograd.grad(actual.sum(), x)
    (ge,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(ga, ge, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [embfuse.optim.SGD(lr=0.1), embfuse.optim.Adam(lr=0.1),
                                  embfuse.optim.Adagrad(lr=0.1, lr_decay=0.5)], ids=["sgd", "adam", "adagrad-lr-decay"])
def test_whole_optimized_training_step_captured_in_a_cuda_graph(rule):
    """Fixed-structure batches already on the GPU (the same bag lengths every step, new ids): the
    optimized model's whole step (batched lookup with its deferred check, fused chain, MLP, loss,
    backward with the fused table update, torch.optim.SGD on the rest) is captured once and
    replayed; it trains as the same steps run eagerly do. Rules whose hyper-parameters change
    every step (Adam's bias corrections, lr_decay) take them from the GPU's count of steps, which
    each replay advances (the host's count, in the state_dict, is not)."""
    sizes = [300, 500, 200]
    model = EagerModel(sizes, 8, hidden=(16,), device="cuda")
    g = torch.Generator().manual_seed(5)
    ids, offsets = eager_batch(sizes, 32, 4, g)
    static_ids = [i.cuda() for i in ids]
    static_offsets = [o.cuda() for o in offsets]
    target = torch.rand(32, 1, device="cuda")

    def make():
        fast = embfuse.fx.optimize(model, (ids, offsets), optimizer=rule)
        return fast, torch.optim.SGD(fast.parameters(), lr=0.1)

    def step(fast, opt, i, o):
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(fast(i, o), target)
        loss.backward()
        opt.step()
        return loss

    captured, opt = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps (kernels compiled, the plan cached)
        for _ in range(2):
            step(captured, opt, static_ids, static_offsets)
    torch.cuda.current_stream().wait_stream(side)
    reference, ref_opt = make()
    reference.load_state_dict(captured.state_dict())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(captured, opt, static_ids, static_offsets)
    for _ in range(3):
        new = [torch.randint(0, n, (i.numel(),), generator=g) for n, i in zip(sizes, ids)]
        for s, v in zip(static_ids, new):
            s.copy_(v)
        graph.replay()
        loss = step(reference, ref_opt, [v.cuda() for v in new], static_offsets)
        torch.testing.assert_close(static_loss, loss, **TOL)
    for k, v in reference.state_dict().items():
        if not k.endswith("optimizer_step"):  # (replays do not advance the host's count)
            torch.testing.assert_close(captured.state_dict()[k], v, **TOL)
    embfuse.check_errors()
    if rule.per_step():  # such a rule's capture needs a step outside the graph first: it says so
        fresh = embfuse.fx.optimize(model, (ids, offsets), optimizer=rule)
        with torch.no_grad():
            fresh(static_ids, static_offsets)
        with pytest.raises(RuntimeError, match="run a training step outside the CUDA graph before capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                fresh(static_ids, static_offsets).sum().backward()


class Sequences(nn.Module):
    """nn.Embedding lookups of history sequences (B, L) and a candidate (B,), per-feature tables."""

    def __init__(self, device):
        super().__init__()
        self.history = nn.Embedding(50, 6, device=device)
        self.candidate = nn.Embedding(30, 6, device=device)
        self.other = nn.Embedding(20, 4, device=device)  # another width: its own batch
        self.padded = nn.Embedding(20, 6, padding_idx=0, device=device)  # left as it is
        self.top = nn.Linear(6 + 6 + 4 + 6, 1, device=device)

    def forward(self, hist, cand, other, padded):
        dev = self.top.weight.device
        h = self.history(hist.to(dev)).mean(1)
        c = self.candidate(cand.to(dev))
        o = self.other(other.to(dev))
        p = self.padded(padded.to(dev)).sum(1)
        return self.top(torch.cat([h, c, o, p], 1))


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_lookups_are_batched_by_width(device):
    g = torch.Generator().manual_seed(9)
    model = Sequences(device)
    args = (torch.randint(0, 50, (5, 7), generator=g), torch.randint(0, 30, (5,), generator=g),
            torch.randint(0, 20, (5,), generator=g), torch.randint(0, 20, (5, 3), generator=g))
    fast = embfuse.fx.optimize(model, args, optimizer=embfuse.optim.SGD(lr=0.1))
    report = " ".join(fast.embfuse_report)
    assert "batched 2 Embedding lookups" in report and "batched 1 Embedding lookups" in report
    assert "left padded: padding_idx=0" in report
    expected, actual = model(*args), fast(*args)
    torch.testing.assert_close(actual, expected, **TOL)
    assert {k: v.shape for k, v in fast.state_dict().items() if "optimizer" not in k} == {
        k: v.shape for k, v in model.state_dict().items()}
    expected.sum().backward()
    actual.sum().backward()  # the fused SGD updates the batched tables; torch's are updated by hand
    with torch.no_grad():
        for name in ("history", "candidate", "other"):
            torch.testing.assert_close(fast.get_submodule(name).weight,
                                       getattr(model, name).weight - 0.1 * getattr(model, name).weight.grad, **TOL)
    fast.load_state_dict(model.state_dict())
    torch.testing.assert_close(fast.get_submodule("candidate").weight, model.candidate.weight, rtol=0, atol=0)


class Dependent(nn.Module):
    """The second lookup's ids come from the first lookup's output: they cannot share a batch."""

    def __init__(self):
        super().__init__()
        self.a = nn.EmbeddingBag(10, 4, mode="sum")
        self.b = nn.EmbeddingBag(10, 4, mode="sum")
        self.c = nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True)

    def forward(self, ids, offsets, offsets_c):
        x = self.a(ids, offsets)
        derived = (x.abs().sum(1) * 1000).long() % 10
        y = self.b(derived, offsets)
        z = self.c(ids, offsets_c)
        return x + y + z


def test_dependent_lookups_get_their_own_batches_and_unbatchable_ones_stay():
    model = Dependent()
    args = torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2]), torch.tensor([0, 2, 2, 3])
    fast = embfuse.fx.optimize(model, args)
    report = " ".join(fast.embfuse_report)
    assert report.count("batched 1 EmbeddingBag") == 2, report
    assert "left c: include_last_offset=True" in report
    torch.testing.assert_close(fast(*args), model(*args), **TOL)


class Moves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, y, z):
        a = x.to("cpu")
        b = y.to(device=self.lin.weight.device)
        c = z.to(torch.float64)  # a dtype change: not a move, left alone
        return self.lin(a + b).sum() + c.sum()


def test_combine_copies_takes_device_moves_only():
    model = Moves()
    args = (torch.randn(2, 3), torch.randn(2, 3), torch.randn(4))
    gm = embfuse.fx.passes.combine_copies(embfuse.fx.trace_model(model, args))
    combined = [n for n in gm.graph.nodes if n.target is copy_to_device]
    assert len(combined) == 2, gm.code  # "cpu" and the weight's device: two targets, a copy each
    assert any(n.op == "call_method" and n.target == "to" for n in gm.graph.nodes)  # the dtype change
    torch.testing.assert_close(gm(*args), model(*args))


class DictInputs(nn.Module):
    """A batch as a dict of per-feature tensors, as data loaders often give it."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.embs = nn.ModuleDict({n: nn.EmbeddingBag(40, 4, mode="mean") for n in names})

    def forward(self, batch):
        return torch.cat([self.embs[n](batch[n]["ids"], batch[n]["offsets"]) for n in self.names], 1)


def test_dict_batches_trace_and_batch():
    names = ["user", "item", "genre"]
    model = DictInputs(names)
    ids, offsets = eager_batch([40] * 3, 5, 3)
    batch = {n: {"ids": i, "offsets": o} for n, i, o in zip(names, ids, offsets)}
    fast = embfuse.fx.optimize(model, (batch,))
    assert any(r.startswith("batched 3") for r in fast.embfuse_report)
    torch.testing.assert_close(fast(batch), model(batch), **TOL)


def test_compiled_embedding_batches_train_as_eager():
    """The plain-lookup batches under torch.compile(fullgraph=True) with a fused optimizer (and
    an nn.Embedding left alone beside them, trained by its gradient)."""
    g = torch.Generator().manual_seed(9)
    model = Sequences("cpu")
    args = (torch.randint(0, 50, (5, 7), generator=g), torch.randint(0, 30, (5,), generator=g),
            torch.randint(0, 20, (5,), generator=g), torch.randint(0, 20, (5, 3), generator=g))
    plain = embfuse.fx.optimize(model, args, optimizer=embfuse.optim.Adagrad(lr=0.1))
    compiled = embfuse.fx.optimize(model, args, optimizer=embfuse.optim.Adagrad(lr=0.1))
    run = torch.compile(compiled, fullgraph=True)
    for _ in range(2):
        plain(*args).sum().backward()
        run(*args).sum().backward()
    for name in ("history", "candidate", "other"):
        torch.testing.assert_close(compiled.get_submodule(name).weight, plain.get_submodule(name).weight, **TOL)
    assert not torch.equal(plain.get_submodule("history").weight, model.history.weight)
    assert plain.get_submodule("padded").weight.grad is not None
    torch.testing.assert_close(compiled.get_submodule("padded").weight.grad, plain.get_submodule("padded").weight.grad,
                               **TOL)


def test_opcheck_of_the_staging_ops():
    from embfuse.fx.passes.lookups import _stage_op
    from embfuse.fx.staging import _staged_copy_op

    ids = [torch.tensor([1, 2, 3]), torch.tensor([[4, 5], [6, 7]])]
    torch.library.opcheck(_stage_op, ("a\tb", ids, [torch.tensor([0, 2]), None], [], 2, torch.device("cpu")))
    torch.library.opcheck(_stage_op, ("a\tb", ids, [torch.tensor([0, 2]), None], [torch.rand(3), torch.rand(4)], 2,
                                      torch.device("cpu")))
    torch.library.opcheck(_staged_copy_op, (ids, torch.device("cpu")))
