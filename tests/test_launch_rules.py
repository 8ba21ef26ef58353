"""Random public calls on the GPU at the shapes where the launch rules (ops/tuning.py) split, with
each rule's bound pushed to one side or the other, against float64 torch on the CPU: outputs,
gradients and fused updates of embedding, embedding_bag, nn.EmbeddingBag and the collection, and
bad batches that must raise the documented error and change no weight or optimizer state.

Half-precision and long-bag sums differ from float64 by rounding that grows with repeated rows
(a hot row summed 2000 times in fp32), beyond what the tolerance table's atol scaled by the bag
length allows; such results are held to twice the error of torch's own result in the same dtype
on the same device. About 1650 such trials in session 40 found no error of embfuse's
(benchmarks/NOTES.md, "Random calls at the launch rules' bounds")."""

import random

import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from embfuse.ops import tuning
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.tolerances import TOL, assert_close

DIMS = [1, 2, 3, 4, 5, 8, 16, 31, 32, 33, 64, 100, 128, 129, 200, 256, 257, 384, 512, 1000]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HUGE = 1 << 40


def push_rules(r: random.Random, monkeypatch) -> None:
    """Each bound at its default, or pushed so that every call takes one side of it."""
    if r.random() < 0.4:
        monkeypatch.setattr(tuning, "NARROW_IDS", -1)
        monkeypatch.setattr(tuning, "NARROW_DIM", 0)
    if r.random() < 0.3:
        monkeypatch.setattr(tuning, "SPREAD", {4: tuning.Spread(HUGE, 1, 0), 2: tuning.Spread(HUGE, 1, 0)})
        monkeypatch.setattr(tuning, "FOLDED_BAGS", r.choice([HUGE, tuning.FOLDED_BAGS]))
    if r.random() < 0.3:
        fold = r.choice([0, HUGE])
        monkeypatch.setattr(tuning, "FOLD_IDS", fold)
        monkeypatch.setattr(tuning, "FOLD_GATHER_IDS", fold)
    if r.random() < 0.3:
        monkeypatch.setattr(tuning, "SMALL_LEVEL", r.choice([0, HUGE]))
    if r.random() < 0.3:  # (at least the last level's tile: segments.launch)
        monkeypatch.setattr(tuning, "TREE_LEVEL", r.choice([64, HUGE]))
    if r.random() < 0.2:
        monkeypatch.setattr(tuning, "WEIGHTED_UNROLL", (r.choice([0, HUGE]), 4))


def close(name, actual, expected, dtype, reduction, peer=None):
    """Within the tolerance table, or no further from float64 than twice torch's `peer` is."""
    if peer is None:
        assert_close(actual.detach(), expected.detach(), dtype, reduction)
        return
    rtol, atol = TOL[dtype]
    ours, exact = actual.detach().double().cpu(), expected.detach().double().cpu()
    err = (ours - exact).abs()
    allowed = 2 * (peer.detach().double().cpu() - exact).abs() + rtol * exact.abs() + atol * max(1, reduction)
    assert (err <= allowed).all(), f"{name}: {int((err > allowed).sum())} of {err.numel()} past twice torch's error"


def torch_peer(fn):
    """fn(), or None where torch refuses it on the GPU (bf16 max backward; an empty embedding
    backward with scale_grad_by_freq: 'invalid argument' in torch 2.11)."""
    try:
        out = fn()
    except (RuntimeError, NotImplementedError):
        return None
    return True if out is None else out


def bag_lengths(r, B):
    kind = r.choice(["fixed", "uniform", "long", "powerlaw", "empty"])
    if kind == "fixed":
        return kind, [r.choice([1, 2, 7, 8, 64, 150, 300])] * B
    if kind == "uniform":
        top = r.choice([1, 4, 16, 64, 150])
        return kind, [r.randint(0, top) for _ in range(B)]
    if kind == "long":
        return kind, [r.randint(60, 400) for _ in range(B)]
    if kind == "powerlaw":
        return kind, [min(2000, int(r.paretovariate(1.2))) for _ in range(B)]
    return kind, [0] * B


def random_ids(r, n, rows, gen):
    if r.random() < 0.5:
        return torch.randint(0, rows, (n,), generator=gen)
    ranks = torch.distributions.Pareto(1.0, 1.05).sample((n,)).long() - 1  # a few hot rows
    return ranks.clamp(max=rows - 1)


def randn(shape, dtype, gen):
    """Random values as stored in `dtype`, in float64."""
    return torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype).double()


def call_embedding_bag(r, gen):
    rows, D = r.choice([1, 7, 1000, 100_000, 3_000_000]), r.choice(DIMS)
    D = 32 if rows * D > 60_000_000 else D
    dtype, index_dtype = r.choice(DTYPES), r.choice([torch.int32, torch.int64])
    B = r.choice([0, 1, 3, 64, 500, 1024, 2048, 5000, 20000])
    kind, lengths = bag_lengths(r, B)
    while sum(lengths) * D > 50_000_000:
        lengths = [n // 2 for n in lengths]
    n, mode = sum(lengths), r.choice(["sum", "mean", "max"])
    fixed = kind == "fixed" and B > 0 and r.random() < 0.5
    kw = dict(mode=mode, include_last_offset=not fixed and r.random() < 0.3,
              padding_idx=r.choice([None, None, 0, rows - 1]) if rows > 1 else None)
    grad = r.random() < 0.5
    w = randn((rows, D), dtype, gen)
    ids = random_ids(r, n, rows, gen)
    starts = torch.tensor([0] + lengths).cumsum(0)
    x = ids.view(B, lengths[0]) if fixed else ids
    offsets = None if fixed else starts if kw["include_last_offset"] else starts[:-1]
    psw = randn(x.shape, dtype, gen).abs() + 0.5 if mode == "sum" and r.random() < 0.4 else None

    def on_gpu(index_dtype):
        weight = w.to("cuda", dtype).requires_grad_(grad)
        off = None if offsets is None else offsets.to("cuda", index_dtype)
        return weight, (x.to("cuda", index_dtype), weight, off), None if psw is None else psw.to("cuda", dtype)

    weight, args, psw_gpu = on_gpu(index_dtype)
    out = embfuse.embedding_bag(*args, per_sample_weights=psw_gpu, bounds_check=r.choice(
        ["deferred", "deferred", "sync", "skip", "off"]), **kw)
    exact_w = w.clone().requires_grad_(grad)
    exact = F.embedding_bag(x, exact_w, offsets, per_sample_weights=psw, **kw)
    peer_w, peer_args, peer_psw = on_gpu(torch.int64)
    peer = torch_peer(lambda: F.embedding_bag(*peer_args, per_sample_weights=peer_psw, **kw))
    close("forward", out, exact, dtype, max(lengths, default=1), peer)
    if grad:
        g = randn(exact.shape, dtype, gen)
        out.backward(g.to("cuda", dtype))
        exact.backward(g)
        if peer is not None and torch_peer(lambda: peer.backward(g.to("cuda", dtype))) is None:
            peer = None
        hottest = int(torch.bincount(ids).max()) if n else 1
        close("weight grad", weight.grad, exact_w.grad, dtype, 4 * hottest, None if peer is None else peer_w.grad)
    embfuse.check_errors()


def call_embedding(r, gen):
    rows, D = r.choice([1, 7, 1000, 100_000]), r.choice(DIMS)
    dtype, index_dtype = r.choice(DTYPES), r.choice([torch.int32, torch.int64])
    shape = r.choice([(0,), (1,), (100,), (4096,), (65536,), (300_000,), (64, 50), (2048, 26)])
    pad = r.choice([None, None, 0, rows - 1]) if rows > 1 else None
    grad = r.random() < 0.6
    freq = grad and r.random() < 0.3
    w = randn((rows, D), dtype, gen)
    ids = random_ids(r, shape[0] * (shape[1] if len(shape) > 1 else 1), rows, gen).view(shape)
    weight = w.to("cuda", dtype).requires_grad_(grad)
    out = embfuse.embedding(ids.to("cuda", index_dtype), weight, padding_idx=pad, scale_grad_by_freq=freq,
                            bounds_check=r.choice(["deferred", "deferred", "sync", "off"]))
    exact_w = w.clone().requires_grad_(grad)
    exact = F.embedding(ids, exact_w, padding_idx=pad, scale_grad_by_freq=freq)
    close("forward", out, exact, dtype, 1)
    if grad:
        g = randn(exact.shape, dtype, gen)
        out.backward(g.to("cuda", dtype))
        exact.backward(g)
        peer_w = w.to("cuda", dtype).requires_grad_()
        peer = torch_peer(lambda: F.embedding(ids.cuda(), peer_w, padding_idx=pad, scale_grad_by_freq=freq))
        if peer is not None and torch_peer(lambda: peer.backward(g.to("cuda", dtype))) is None:
            peer = None
        hottest = int(torch.bincount(ids.reshape(-1)).max()) if ids.numel() else 1
        close("weight grad", weight.grad, exact_w.grad, dtype, 4 * hottest, None if peer is None else peer_w.grad)
    embfuse.check_errors()


def random_optimizer(r):
    return r.choice([SGD(lr=0.1), SGD(lr=0.1, weight_decay=0.01), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1),
                     RowWiseAdagrad(lr=0.1, weight_decay=0.01), Adam(lr=0.05)])


def same_start(gpu, exact, gen):
    """The exact module's table and state := the GPU module's; state away from 0 (a first Adagrad or
    Adam step is lr * g / (|g| + eps): a gradient that cancels to about 0 makes it anything in +-lr)."""
    with torch.no_grad():
        for k, v in gpu._fused.state.items():
            if v.is_floating_point():
                v.copy_(torch.rand(v.shape, dtype=torch.float64, generator=gen) * 0.9 + 0.1)
    sync(gpu, exact)


def sync(gpu, exact):
    """The exact module's tables and optimizer state := the GPU module's."""
    with torch.no_grad():
        for mine, theirs in zip(gpu.parameters(), exact.parameters()):
            theirs.copy_(mine)
        for k, v in (gpu._fused.state.items() if gpu._fused is not None else ()):
            exact._fused.state[k].copy_(v)


def bad_batch_changes_nothing(module, call, what):
    """`call` (a bad batch's forward and fused backward) raises naming `what`; nothing changed."""
    before = [p.detach().clone() for p in module.parameters()]
    state = {k: v.clone() for k, v in module._fused.state.items()} if module._fused is not None else {}
    with pytest.raises(IndexError) as raised:
        call()
        embfuse.check_errors()
    assert all(str(part) in str(raised.value) for part in what), (str(raised.value), what)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert all(torch.equal(module._fused.state[k], v) for k, v in state.items())


def call_fused_embedding_bag(r, gen):
    rows, D, dtype = r.choice([7, 1000, 100_000]), r.choice(DIMS), r.choice(DTYPES)
    B = r.choice([1, 64, 1024, 5000])
    _, lengths = bag_lengths(r, B)
    while sum(lengths) * D > 20_000_000:
        lengths = [n // 2 for n in lengths]
    n, mode = sum(lengths), r.choice(["sum", "mean"])
    weighted = mode == "sum" and r.random() < 0.4
    check, opt = r.choice(["deferred", "sync", "off"]), random_optimizer(r)
    gpu = embfuse.nn.EmbeddingBag(rows, D, mode=mode, optimizer=opt, bounds_check=check, dtype=dtype, device="cuda")
    exact = embfuse.nn.EmbeddingBag(rows, D, mode=mode, optimizer=opt, dtype=torch.float64)
    same_start(gpu, exact, gen)
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    for step in range(2 if dtype == torch.float32 else 1):
        ids = random_ids(r, n, rows, gen)
        psw = randn(n, dtype, gen).abs() + 0.5 if weighted else None
        g = randn((B, D), dtype, gen)
        gpu_args = (offsets.cuda(), None if psw is None else psw.to("cuda", dtype))
        if check != "off" and n and r.random() < 0.3:
            at, bad = r.randrange(n), ids.clone()
            bad[at] = r.choice([rows, rows + 5, -1])
            bad_batch_changes_nothing(gpu, lambda: gpu(bad.cuda(), *gpu_args).backward(g.to("cuda", dtype)),
                                      (at, int(bad[at])))
        out = gpu(ids.cuda(), *gpu_args)
        out.backward(g.to("cuda", dtype))
        exact_out = exact(ids, offsets, psw)
        exact_out.backward(g)
        close("fused forward", out, exact_out, dtype, max(lengths, default=1))
        close("fused weights", gpu.weight, exact.weight, dtype, 8 * (int(torch.bincount(ids).max()) if n else 1))
        sync(gpu, exact)  # each step from the same table: a hot row's fp32 sum is further off than a row's
    embfuse.check_errors()


def call_collection(r, gen):
    dtype = r.choice(DTYPES)
    tables, keys, rows_of = [], [], {}
    for t in range(r.choice([1, 2, 4, 8, 26])):
        D = r.choice([4, 8, 16, 32, 64, 128, 256] if r.random() < 0.8 else DIMS)
        rows = max(3, min(r.choice([3, 100, 10_000, 500_000]), 4_000_000 // D))
        features = [f"f{t}"] + ([f"g{t}"] if r.random() < 0.2 else [])
        tables.append(EmbeddingBagConfig(rows, D, f"t{t}", dtype, features, pooling=r.choice(["sum", "mean"])))
        keys += features
        rows_of.update(dict.fromkeys(features, rows))
    weighted, opt = r.random() < 0.3, random_optimizer(r) if r.random() < 0.6 else None
    B = r.choice([1, 16, 128, 512, 2048, 16384 if len(tables) <= 4 else 2048])
    lens = [n for _ in keys for n in bag_lengths(r, B)[1]]
    while sum(lens) * max(t.embedding_dim for t in tables) > 20_000_000:
        lens = [n // 2 for n in lens]
    check = r.choice(["deferred", "deferred", "sync", "off"])
    gpu = EmbeddingBagCollection(tables, is_weighted=weighted, device="cuda", optimizer=opt, bounds_check=check)
    exact = EmbeddingBagCollection([EmbeddingBagConfig(t.num_embeddings, t.embedding_dim, t.name, torch.float64,
                                                       t.feature_names, pooling=t.pooling) for t in tables],
                                   is_weighted=weighted, optimizer=opt)
    with torch.no_grad():
        gpu.weights.copy_(randn(gpu.weights.shape, dtype, gen))
    if opt is None:
        sync(gpu, exact)
    else:
        same_start(gpu, exact, gen)
    lengths = torch.tensor(lens)
    per_key = lengths.view(len(keys), B).sum(1)
    values = torch.cat([random_ids(r, int(c), rows_of[k], gen) for k, c in zip(keys, per_key)])
    psw = randn(values.numel(), dtype, gen).abs() + 0.5 if weighted else None

    def batch(values):
        return KeyedJaggedTensor(keys, values, None if psw is None else psw.float(), lengths=lengths).to("cuda")

    if check != "off" and values.numel() and r.random() < 0.3:
        at, bad = r.randrange(values.numel()), values.clone()
        feature = keys[int(torch.searchsorted(per_key.cumsum(0), at, right=True))]
        bad[at] = r.choice([rows_of[feature], -1])

        def bad_call():
            out = gpu(batch(bad)).values()
            if opt is not None:
                out.backward(torch.ones_like(out))

        bad_batch_changes_nothing(gpu, bad_call, (feature, int(bad[at])))
    out, exact_out = gpu(batch(values)).values(), exact(KeyedJaggedTensor(keys, values, psw, lengths=lengths)).values()
    close("collection forward", out, exact_out, dtype, max(lens, default=1))
    if opt is not None:
        g = randn(exact_out.shape, dtype, gen)
        out.backward(g.to("cuda", dtype))
        exact_out.backward(g)
        hottest = int(torch.bincount(values).max()) if values.numel() else 1
        close("collection fused weights", gpu.weights, exact.weights, dtype, 8 * hottest)
    embfuse.check_errors()


CALLS = [call_embedding_bag, call_embedding, call_fused_embedding_bag, call_collection]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_random_calls_at_the_launch_rules_bounds(seed, monkeypatch):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(8):
        call = r.choice(CALLS)
        with monkeypatch.context() as m:
            push_rules(r, m)
            try:
                call(r, gen)
            except Exception as e:
                raise AssertionError(f"seed {seed}, trial {trial}: {call.__name__}") from e
