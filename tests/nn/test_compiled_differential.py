"""Differential trials of torch.compile(fullgraph=True) against eager calls on the CPU, where a
compiled lookup traces into the pure-torch references and Inductor generates C++ for them:
random single-table bags (every mode, input form, padding_idx, per-sample weights with or
without a gradient), gathers, collections, EmbeddingCollections and collections of
TensorFlow-style tables, without a fused optimizer or with one of four. Three steps each; the
outputs, gradients and state after them must agree. Inductor's caches are off: a graph found
in them is not compiled again (session 51 of benchmarks/NOTES.md: a fault hidden that way).
The fused lookups are opaque ops of the graph, so their cases check the graph around them."""

import torch
from hypothesis import given, settings, strategies as st

import embfuse
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad

OPTIMIZERS = [None, lambda: SGD(lr=0.1), lambda: Adagrad(lr=0.1, weight_decay=0.01), lambda: RowWiseAdagrad(lr=0.1),
              lambda: Adam(lr=0.05, weight_decay=0.1)]


def _bag(rnd, rows, D, dtype, opt):
    mode = rnd.choice(["sum", "mean", "sqrtn", "wmean"] + (["max"] if opt is None else []))
    form = rnd.choice(["2d", "starts", "last"])
    pad = rnd.choice([None, rnd.randint(-rows, rows - 1)])
    weighted = mode in ("sum", "sqrtn", "wmean") and rnd.random() < 0.6
    psw_grad = weighted and opt is None and mode == "sum" and rnd.random() < 0.5

    def make():
        return embfuse.nn.EmbeddingBag(rows, D, mode=mode, padding_idx=pad, include_last_offset=form == "last",
                                       dtype=dtype, optimizer=opt() if opt else None)

    def batch(g):
        if form == "2d":
            B, L = (int(x) for x in torch.randint(1, 5, (2,), generator=g))
            ids, offsets = torch.randint(0, rows, (B, L), generator=g), None
        else:
            lengths = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
            ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
            ends = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            offsets = ends if form == "last" else ends[:-1]
        w = (torch.rand(ids.shape, generator=g) + 0.1).to(dtype) if weighted else None
        return ids, offsets, w.requires_grad_() if psw_grad else w
    return make, batch


def _gather(rnd, rows, D, dtype, opt):
    pad = rnd.choice([None, rnd.randint(-rows, rows - 1)])
    shape = rnd.choice([(5,), (2, 3), (2, 2, 2), (0,)])

    def make():
        return embfuse.nn.Embedding(rows, D, padding_idx=pad, dtype=dtype, optimizer=opt() if opt else None)

    return make, lambda g: (torch.randint(0, rows, shape, generator=g),)


def _collection(rnd, kind, opt):
    T, B = rnd.randint(1, 3), rnd.randint(1, 4)
    sizes, widths = [rnd.randint(1, 20) for _ in range(T)], [rnd.choice([1, 4, 8]) for _ in range(T)]
    weighted = kind != "ec" and rnd.random() < 0.5

    def config(t):
        common = dict(num_embeddings=sizes[t], name=f"t{t}", feature_names=[f"f{t}"])
        if kind == "ec":
            return embfuse.EmbeddingConfig(embedding_dim=widths[0], **common)
        if kind == "tf":
            return embfuse.EmbeddingBagConfig(embedding_dim=widths[t], combiner=rnd.choice(["sum", "mean", "sqrtn"]),
                                              default_id=rnd.choice([None, 0]), **common)
        return embfuse.EmbeddingBagConfig(embedding_dim=widths[t], pooling=rnd.choice(["sum", "mean"]), **common)

    configs = [config(t) for t in range(T)]

    def make():
        o = opt() if opt else None
        if kind == "ec":
            return embfuse.EmbeddingCollection(configs, optimizer=o)
        return embfuse.EmbeddingBagCollection(configs, is_weighted=weighted, optimizer=o)

    def batch(g):
        lengths = torch.randint(0, 4, (T * B,), generator=g)
        low = -1 if kind == "tf" else 0  # (TensorFlow's rules drop ids < 0, and weights <= 0 under mean, sqrtn)
        values = torch.cat([torch.randint(low, sizes[t], (int(lengths[t * B:(t + 1) * B].sum()),), generator=g)
                            for t in range(T)])
        w = torch.rand(values.numel(), generator=g) - (0.2 if kind == "tf" else -0.1) if weighted else None
        return (embfuse.KeyedJaggedTensor([f"f{t}" for t in range(T)], values, w, lengths=lengths),)
    return make, batch


class _Loss(torch.nn.Module):
    """The module's output as one tensor, and a loss that weighs each element differently."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        out = self.module(*args)
        if isinstance(out, dict):  # EmbeddingCollection: feature -> JaggedTensor
            out = torch.cat([out[k].values() for k in sorted(out)])
        elif not isinstance(out, torch.Tensor):  # KeyedTensor
            out = out.values()
        scale = torch.arange(1, out.numel() + 1, device=out.device, dtype=torch.float32).view(out.shape)
        return out, (out.float() * scale).sum()


def _run(make, batch, compiled, seed, fused):
    """Outputs, gradients (the per-sample weights', and without a fused optimizer the
    parameters') and state_dict after three steps."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = _Loss(make())
    step = torch.compile(model, fullgraph=True) if compiled else model
    g = torch.Generator().manual_seed(seed + 1)
    outs, grads = [], []
    with torch._inductor.config.patch(force_disable_caches=True):
        for _ in range(3):
            inputs = batch(g)
            out, loss = step(*inputs)
            outs.append(out.detach().clone())
            if out.numel():
                loss.backward()
            grads += [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            for p in [] if fused else model.parameters():
                if p.grad is not None:
                    grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                    p.grad = None
    embfuse.check_errors()
    return outs, grads, {k: v.clone() for k, v in model.state_dict().items()}


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_compiled_training_agrees_with_eager_on_the_cpu(data):
    rnd = data.draw(st.randoms(use_true_random=False))
    kind = rnd.choice(["bag", "gather", "ebc", "ec", "tf"])
    opt = rnd.choice(OPTIMIZERS)
    dtype = rnd.choice([torch.float32, torch.bfloat16]) if kind in ("bag", "gather") else torch.float32
    rows, D = rnd.randint(1, 30), rnd.choice([1, 4, 33])
    make, batch = (_bag(rnd, rows, D, dtype, opt) if kind == "bag" else _gather(rnd, rows, D, dtype, opt)
                   if kind == "gather" else _collection(rnd, kind, opt))
    seed = rnd.randint(0, 2**16)
    eager, compiled = (_run(make, batch, c, seed, opt is not None) for c in (False, True))
    # (Inductor may fuse and order the loss's arithmetic differently: rounding apart)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for kind_of, ours, theirs in zip(("output", "gradient", "state"), compiled, eager):
        if isinstance(ours, dict):
            ours, theirs = list(ours.values()), [theirs[k] for k in ours]
        assert len(ours) == len(theirs), kind_of
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{kind_of}: {m}")
