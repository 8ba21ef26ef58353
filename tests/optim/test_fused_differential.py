"""Differential trials of fused training against torch: random tables, bags (empty ones, repeated
ids, padding_idx, per-sample weights), input forms, pooling modes and optimizers, a few steps of
embfuse.nn.EmbeddingBag with a fused optimizer (fp32, fp16 and bf16 tables) against
torch.nn.EmbeddingBag in float64 stepped by torch.optim on its gradient. Weights are compared
after every step, optimizer state after the last; collections likewise, table by table.

SGD and Adagrad without weight decay leave a row with no gradient as it is, so torch's dense
step is their oracle. The other cases (weight decay, row-wise Adagrad, Adam: embfuse applies each
rule to the touched rows only) take `Lazy`, the rules by hand on torch's sparse gradient. (torch's
SparseAdam is lazy too but adds eps before the second bias correction, not after it as Adam and
embfuse do.)"""

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import embfuse
from tests.conftest import DEVICES
from tests.tf.test_lookup import sparse
from tests.tolerances import TOL, assert_close


@st.composite
def trainings(draw, opt):
    """One table's training: its size, pooling, padding_idx, input form, weights or not, one to
    three batches (lengths, ids), the optimizer's hyper-parameters and a seed for the values."""
    rows, D = draw(st.integers(1, 12)), draw(st.sampled_from([1, 3, 8]))
    # (fused optimizers take no max pooling; sqrtn and wmean are TensorFlow's combiners)
    mode = draw(st.sampled_from(["sum", "mean", "sqrtn", "wmean"]))
    padding_idx = draw(st.one_of(st.none(), st.integers(-rows, rows - 1)))
    form = draw(st.sampled_from(["2d", "starts", "last"]))
    weighted = mode != "mean" and draw(st.booleans())
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        if form == "2d":
            B, L = draw(st.integers(1, 5)), draw(st.integers(1, 4))
            lengths = [L] * B
        else:
            lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5))
        ids = draw(st.lists(st.integers(0, rows - 1), min_size=sum(lengths), max_size=sum(lengths)))
        steps.append((lengths, ids))
    hyper = dict(lr=draw(st.sampled_from([0.5, 0.05])), weight_decay=draw(st.sampled_from([0.0, 0.1])))
    if opt == "adagrad":
        hyper.update(lr_decay=draw(st.sampled_from([0.0, 0.1])))
    if opt in ("adagrad", "rowwise"):
        hyper.update(initial_accumulator_value=draw(st.sampled_from([0.0, 0.1])))
    if opt != "sgd":  # (a large eps shows where the rule adds it)
        hyper.update(eps=draw(st.sampled_from([1e-10 if opt != "adam" else 1e-8, 0.1])))
    return rows, D, mode, padding_idx, form, weighted, steps, hyper, draw(st.integers(0, 2**16))


class Lazy:
    """The documented rules (embfuse.optim.rules: torch.optim's and FBGEMM's formulas) applied by
    hand, in float64, to the rows of torch's sparse gradient but `padding_idx`: weight decay and
    state change only on the rows a batch touches."""

    def __init__(self, opt, weight, padding_idx, lr, weight_decay=0.0, lr_decay=0.0, initial_accumulator_value=0.0,
                 eps=0.0):
        self.opt, self.weight, self.padding_idx, self.steps = opt, weight, padding_idx, 0
        self.lr, self.wd, self.lr_decay, self.eps = lr, weight_decay, lr_decay, eps
        rows = weight.shape[0]
        self.state = {"adam": {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight)},
                      "rowwise": {"sum": torch.full((rows,), float(initial_accumulator_value), dtype=weight.dtype)},
                      "adagrad": {"sum": torch.full_like(weight, initial_accumulator_value)},
                      "sgd": {}}[opt]

    def zero_grad(self):
        self.weight.grad = None

    @torch.no_grad()
    def step(self):
        self.steps += 1
        grad = self.weight.grad.coalesce()
        rows, g = grad.indices()[0], grad.values()
        if self.padding_idx is not None:
            keep = rows != self.padding_idx % self.weight.shape[0]
            rows, g = rows[keep], g[keep]
        w, st, t = self.weight[rows], self.state, self.steps
        g = g + self.wd * w
        if self.opt == "sgd":
            w = w - self.lr * g
        elif self.opt == "adagrad":
            s = st["sum"][rows] + g * g
            w = w - self.lr / (1 + (t - 1) * self.lr_decay) * g / (s.sqrt() + self.eps)
            st["sum"][rows] = s
        elif self.opt == "rowwise":
            s = st["sum"][rows] + (g * g).mean(dim=1)
            w = w - self.lr * g / (s.sqrt() + self.eps)[:, None]
            st["sum"][rows] = s
        else:  # torch.optim.Adam's rule, default betas
            m = st["exp_avg"][rows].lerp(g, 0.1)
            v = st["exp_avg_sq"][rows] * 0.999 + 0.001 * g * g
            w = w - self.lr / (1 - 0.9 ** t) * m / (v.sqrt() / (1 - 0.999 ** t) ** 0.5 + self.eps)
            st["exp_avg"][rows], st["exp_avg_sq"][rows] = m, v
        self.weight[rows] = w


def _torch_optimizer(opt, weight, padding_idx, hyper):
    """torch.optim itself where its dense step is lazy already (no weight decay), else Lazy."""
    if opt == "sgd" and not hyper.get("weight_decay"):
        return torch.optim.SGD([weight], **hyper)
    if opt == "adagrad" and not hyper.get("weight_decay"):
        return torch.optim.Adagrad([weight], **hyper)
    return Lazy(opt, weight, padding_idx, **hyper)


def _ours_optimizer(opt, hyper):
    return {"sgd": embfuse.optim.SGD, "adagrad": embfuse.optim.Adagrad, "rowwise": embfuse.optim.RowWiseAdagrad,
            "adam": embfuse.optim.Adam}[opt](**hyper)


def _close(ours, theirs, dtype, reduction, steps, scale=0.0):
    """assert_close; for fp16 / bf16 tables, an ulp of the largest value seen (`scale`) a step:
    the table and the oracle each round a step's result, a result near a rounding boundary can go
    either way, and a later step that cancels most of the value keeps that ulp."""
    if dtype == torch.float32:
        return assert_close(ours, theirs, dtype, reduction=reduction)
    rtol, atol = TOL[dtype]
    scale = max(scale, float(theirs.abs().max()) if theirs.numel() else 0.0)
    torch.testing.assert_close(ours.double().cpu(), theirs.double().cpu(), rtol=rtol * steps,
                               atol=(atol * reduction + rtol * scale) * steps)


def _combined(lengths, ids, weights, mode, padding_idx, rows):
    """sqrtn / wmean (ops/bags.py) as the per-sample weights of a sum: each id's weight over its
    bag's norm (the root of the sum of squared weights, or their sum, over the ids not padding;
    0 where the norm is 0)."""
    pad, out, at = None if padding_idx is None else padding_idx % rows, [], 0
    for n in lengths:
        kept = [w for w, i in zip(weights[at:at + n], ids[at:at + n]) if i != pad]
        norm = sum(w * w for w in kept) ** 0.5 if mode == "sqrtn" else sum(kept)
        out += [w / norm if norm else 0.0 for w in weights[at:at + n]]
        at += n
    return out


def _batch(lengths, ids, form, device):
    x = torch.tensor(ids, dtype=torch.long, device=device)
    starts = torch.tensor([0] + lengths, device=device).cumsum(0)
    if form == "2d":
        return x.view(len(lengths), lengths[0]), None
    return x, (starts if form == "last" else starts[:-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fused_training_agrees_with_torch_optim(device, dtype, opt, data):
    """fp16 / bf16 tables: the oracle rounds its weights to the table's dtype after each step, as
    the table stores them (embfuse's state stays fp32); the inputs are given in that dtype."""
    rows, D, mode, padding_idx, form, weighted, steps, hyper, seed = data.draw(trainings(opt))
    gen = torch.Generator().manual_seed(seed)
    kw = dict(mode=mode, padding_idx=padding_idx, include_last_offset=form == "last")
    combined = mode in ("sqrtn", "wmean")  # (torch pools them as sums of _combined's weights)
    theirs = torch.nn.EmbeddingBag(rows, D, sparse=True, dtype=torch.float64, **dict(kw, mode="sum") if combined
                                   else kw)
    ours = embfuse.nn.EmbeddingBag(rows, D, device=device, dtype=dtype, optimizer=_ours_optimizer(opt, hyper), **kw)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(rows, D, dtype=torch.float64, generator=gen).to(dtype))
        ours.weight.copy_(theirs.weight)
    topt = _torch_optimizer(opt, theirs.weight, padding_idx, hyper)
    if isinstance(topt, torch.optim.Optimizer):  # (its dense step: a dense gradient)
        theirs.sparse = False
    most, scale = 1, float(theirs.weight.detach().abs().max())
    for done, (lengths, ids) in enumerate(steps, 1):
        x, offsets = _batch(lengths, ids, form, "cpu")
        psw = torch.randn(x.shape, dtype=torch.float64, generator=gen) if weighted else None
        if psw is not None and mode == "wmean":  # (positive: a sum of weights near 0 is ill-conditioned)
            psw = psw.abs() + 0.1
        psw = None if psw is None else psw.to(dtype)
        theirs_psw = None if psw is None else psw.double()
        if combined:
            weights = [1.0] * len(ids) if psw is None else psw.double().reshape(-1).tolist()
            theirs_psw = torch.tensor(_combined(lengths, ids, weights, mode, padding_idx, rows),
                                      dtype=torch.float64).view(x.shape)
        g = torch.randn(len(lengths), D, dtype=torch.float64, generator=gen).to(dtype)
        topt.zero_grad()
        theirs(x, offsets, per_sample_weights=theirs_psw).backward(g.double())
        # a touched element whose gradient cancels to 0 (weights w and -w in one bag, likely in
        # bf16) takes a full step from fp32's rounding residue under Adagrad from zero state or
        # Adam (g / sqrt(g^2)): either answer is right, so such cases are not drawn
        grad = theirs.weight.grad.to_dense() if theirs.weight.grad.is_sparse else theirs.weight.grad
        touched = sorted({i for i in ids} - {None if padding_idx is None else padding_idx % rows})
        assume(bool((grad[touched].abs() > 1e-6).all()))
        topt.step()
        with torch.no_grad():
            theirs.weight.copy_(theirs.weight.to(dtype))
        scale = max(scale, float(theirs.weight.detach().abs().max()))
        ours(x.to(device), None if offsets is None else offsets.to(device),
             per_sample_weights=None if psw is None else psw.to(device)).backward(g.to(device))
        assert ours.weight.grad is None
        most = max(most, len(ids) + 1)
        _close(ours.weight.detach(), theirs.weight.detach(), dtype, most, done, scale)
    state = topt.state if isinstance(topt, Lazy) else topt.state[theirs.weight]
    if opt in ("adagrad", "rowwise"):
        _close(ours.optimizer_sum, state["sum"], dtype, most, len(steps))
    if opt == "adam":
        _close(ours.optimizer_exp_avg, state["exp_avg"], dtype, most, len(steps))
        _close(ours.optimizer_exp_avg_sq, state["exp_avg_sq"], dtype, most, len(steps))


@st.composite
def collection_trainings(draw, opt):
    """Tables of mixed sizes and widths, each read by one or two features; a few keyed batches."""
    tables = [(draw(st.integers(1, 10)), draw(st.sampled_from([1, 4, 8])), draw(st.sampled_from(["sum", "mean"])),
               draw(st.integers(1, 2))) for _ in range(draw(st.integers(1, 3)))]
    weighted = all(pooling == "sum" for _, _, pooling, _ in tables) and draw(st.booleans())
    features = [(t, rows) for t, (rows, _, _, n) in enumerate(tables) for _ in range(n)]
    B = draw(st.integers(1, 4))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        lengths = [[draw(st.integers(0, 4)) for _ in range(B)] for _ in features]
        ids = [draw(st.lists(st.integers(0, rows - 1), min_size=sum(ls), max_size=sum(ls)))
               for (_, rows), ls in zip(features, lengths)]
        steps.append((lengths, ids))
    hyper = dict(lr=draw(st.sampled_from([0.5, 0.05])), weight_decay=draw(st.sampled_from([0.0, 0.1])))
    if opt == "adagrad":
        hyper.update(lr_decay=draw(st.sampled_from([0.0, 0.1])))
    if opt != "sgd":
        hyper.update(eps=draw(st.sampled_from([1e-10 if opt != "adam" else 1e-8, 0.1])))
    return tables, weighted, B, steps, hyper, draw(st.integers(0, 2**16))


def _twins(ours, configs, opt, hyper, gen, oracle=_torch_optimizer):
    """For the collection `ours` of `configs`: one float64 table a table (a leaf, random, copied
    into ours) and its `oracle` optimizer; whether the oracles take sparse gradients; the batch's
    keys (every table's features in order) and each key's table."""
    theirs = [torch.randn(c.num_embeddings, c.embedding_dim, dtype=torch.float64, generator=gen).requires_grad_()
              for c in configs]
    with torch.no_grad():
        for w, t in zip(ours.table_weights(), theirs):
            w.copy_(t)
    topts = [oracle(opt, t, None, hyper) for t in theirs]
    keys = [f for c in configs for f in c.feature_names]
    table_of = [t for t, c in enumerate(configs) for _ in c.feature_names]
    return theirs, topts, not isinstance(topts[0], torch.optim.Optimizer), keys, table_of


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_fused_collection_training_agrees_with_torch_optim(device, opt, data):
    """The same for an EmbeddingBagCollection (one flat buffer, tables of mixed widths, features
    sharing a table) against one float64 table and optimizer a table, pooled by F.embedding_bag."""
    tables, weighted, B, steps, hyper, seed = data.draw(collection_trainings(opt))
    gen = torch.Generator().manual_seed(seed)
    configs = [embfuse.EmbeddingBagConfig(rows, D, f"t{t}", feature_names=[f"t{t}f{k}" for k in range(n)],
                                          pooling=pooling) for t, (rows, D, pooling, n) in enumerate(tables)]
    ours = embfuse.EmbeddingBagCollection(configs, is_weighted=weighted, device=device,
                                          optimizer=_ours_optimizer(opt, hyper))
    theirs, topts, sparse, keys, table_of = _twins(ours, configs, opt, hyper, gen)
    most = 1
    for lengths, ids in steps:
        flat = torch.tensor([i for f in ids for i in f], dtype=torch.long)
        psw = torch.randn(flat.numel(), dtype=torch.float64, generator=gen) if weighted else None
        pooled, at = [], 0
        for t, ls, f_ids in zip(table_of, lengths, ids):
            x = flat[at:at + len(f_ids)]
            starts = torch.tensor([0] + ls[:-1]).cumsum(0)
            pooled.append(torch.nn.functional.embedding_bag(
                x, theirs[t], starts, mode=tables[t][2], sparse=sparse,
                per_sample_weights=None if psw is None else psw[at:at + len(f_ids)]))
            at += len(f_ids)
        g = torch.randn(B, sum(p.shape[1] for p in pooled), dtype=torch.float64, generator=gen)
        for o in topts:
            o.zero_grad()
        torch.cat(pooled, 1).backward(g)
        for o in topts:  # (every table steps: a collection's step count is one a backward)
            o.step()
        kjt = embfuse.KeyedJaggedTensor(keys, flat.to(device), None if psw is None else psw.float().to(device),
                                        lengths=torch.tensor([n for ls in lengths for n in ls], device=device),
                                        stride=B)
        ours(kjt).values().backward(g.float().to(device))
        most = max(most, flat.numel() + 1)
        for w, t in zip(ours.table_weights(), theirs):
            assert_close(w.detach(), t.detach(), torch.float32, reduction=most)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_fused_gather_training_agrees_with_torch_optim(device, opt, data):
    """The same for embfuse.nn.Embedding (no pooling: each id's row is an output row) with ids of
    any shape, repeated ids and padding_idx, against torch.nn.Embedding."""
    rows, D, _, padding_idx, _, _, steps, hyper, seed = data.draw(trainings(opt))
    gen = torch.Generator().manual_seed(seed)
    theirs = torch.nn.Embedding(rows, D, padding_idx=padding_idx, sparse=True, dtype=torch.float64)
    ours = embfuse.nn.Embedding(rows, D, padding_idx=padding_idx, device=device,
                                optimizer=_ours_optimizer(opt, hyper))
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(rows, D, dtype=torch.float64, generator=gen))
        ours.weight.copy_(theirs.weight)
    topt = _torch_optimizer(opt, theirs.weight, padding_idx, hyper)
    if isinstance(topt, torch.optim.Optimizer):
        theirs.sparse = False
    for lengths, ids in steps:
        x = torch.tensor(ids, dtype=torch.long).view(len(lengths), -1) if ids and len(set(lengths)) == 1 else \
            torch.tensor(ids, dtype=torch.long)
        g = torch.randn(*x.shape, D, dtype=torch.float64, generator=gen)
        topt.zero_grad()
        theirs(x).backward(g)
        topt.step()
        ours(x.to(device)).backward(g.float().to(device))
        assert_close(ours.weight.detach(), theirs.weight.detach(), torch.float32, reduction=len(ids) + 1)


@st.composite
def tf_trainings(draw, opt):
    """TensorFlow-style tables (combiner, default id) and sparse batches: B rows of up to 3
    entries, ids < 0 among them, weights <= 0 too when weighted."""
    tables = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(1, 8))
        tables.append((rows, draw(st.sampled_from([1, 4])), draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                       draw(st.one_of(st.none(), st.integers(0, rows - 1)))))
    weighted, B = draw(st.booleans()), draw(st.integers(1, 4))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        batch = []
        for rows, *_ in tables:
            entries = [((b, k), draw(st.integers(-1, rows - 1)), draw(st.sampled_from([-0.5, 0.0, 0.7, 1.3])))
                       for b in range(B) for k in range(draw(st.integers(0, 3)))]
            batch.append(entries)
        steps.append(batch)
    hyper = dict(lr=draw(st.sampled_from([0.5, 0.05])), weight_decay=draw(st.sampled_from([0.0, 0.1])))
    if opt != "sgd":
        hyper.update(eps=draw(st.sampled_from([1e-10 if opt != "adam" else 1e-8, 0.1])))
    return tables, weighted, B, steps, hyper, draw(st.integers(0, 2**16))


def _tf_touched(entries, rows, combiner, default_id, weighted, B):
    """The rows a TensorFlow lookup of `entries` reads: ids >= 0 (with weights > 0 when weighted
    and the combiner is not sum), and the default id for a row left without one."""
    kept = [(b, i) for (b, _), i, w in entries if i >= 0 and (w > 0 or not weighted or combiner == "sum")]
    touched = {i for _, i in kept}
    if default_id is not None and len({b for b, _ in kept}) < B:
        touched.add(default_id)
    return sorted(touched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_fused_tensorflow_collection_training_agrees(device, opt, data):
    """A collection of TensorFlow-style tables (combiner=, default_id=: ids < 0 and, for mean and
    sqrtn, weights <= 0 dropped; empty rows given the default id) trained with a fused optimizer,
    against safe_embedding_lookup_sparse in float64, autograd's gradient and the rules on the rows
    that lookup reads. Both sides share the safe pass (ops/safe.py), whose TensorFlow semantics
    tests/tf checks against TensorFlow itself: this checks the fused update of such tables (the
    default id's row included). The sparse batch is built on the CPU and moved."""
    from embfuse.tf import keyed_batch, safe_embedding_lookup_sparse

    tables, weighted, B, steps, hyper, seed = data.draw(tf_trainings(opt))
    gen = torch.Generator().manual_seed(seed)
    configs = [embfuse.EmbeddingBagConfig(rows, D, f"t{t}", feature_names=[f"f{t}"], combiner=c, default_id=d)
               for t, (rows, D, c, d) in enumerate(tables)]
    ours = embfuse.EmbeddingBagCollection(configs, is_weighted=weighted, device=device,
                                          optimizer=_ours_optimizer(opt, hyper))
    theirs, topts, *_ = _twins(ours, configs, opt, hyper, gen, oracle=lambda o, t, p, h: Lazy(o, t, p, **h))
    for batch in steps:
        ids, weights = {}, {}
        for t, entries in enumerate(batch):
            ids[f"f{t}"] = sparse([(at, i) for at, i, _ in entries], (B, 4))
            weights[f"f{t}"] = sparse([(at, w) for at, _, w in entries], (B, 4), dtype=torch.float64)
        outs = [safe_embedding_lookup_sparse(theirs[t], ids[f"f{t}"], weights[f"f{t}"] if weighted else None, c, d)
                for t, (_, _, c, d) in enumerate(tables)]
        g = torch.randn(B, sum(o.shape[1] for o in outs), dtype=torch.float64, generator=gen)
        for t in theirs:
            t.grad = None
        torch.cat(outs, 1).backward(g)
        for t, ((rows, _, c, d), o) in enumerate(zip(tables, topts)):
            touched = torch.tensor(_tf_touched(batch[t], rows, c, d, weighted, B), dtype=torch.long)
            dense = theirs[t].grad
            assume(bool((dense[touched].abs() > 1e-6).all()))  # (see test_fused_training_agrees_with_torch_optim)
            theirs[t].grad = torch.sparse_coo_tensor(touched[None], dense[touched], dense.shape, check_invariants=True)
            o.step()
        kjt = keyed_batch(ids, {k: v.float() for k, v in weights.items()} if weighted else None).to(device)
        ours(kjt).values().backward(g.float().to(device))
        for w, t in zip(ours.table_weights(), theirs):
            assert_close(w.detach(), t.detach(), torch.float32, reduction=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise", "adam"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_fused_unpooled_collection_training_agrees(device, opt, data):
    """The same for TorchRec's EmbeddingCollection (unpooled: one row an id, tables of one width,
    one or two features a table) against F.embedding over one float64 table a table."""
    tables, _, B, steps, hyper, seed = data.draw(collection_trainings(opt))
    D = tables[0][1]
    gen = torch.Generator().manual_seed(seed)
    configs = [embfuse.EmbeddingConfig(rows, D, f"t{t}", feature_names=[f"t{t}f{k}" for k in range(n)])
               for t, (rows, _, _, n) in enumerate(tables)]
    ours = embfuse.EmbeddingCollection(configs, device=device, optimizer=_ours_optimizer(opt, hyper))
    theirs, topts, sparse, keys, table_of = _twins(ours, configs, opt, hyper, gen)
    for lengths, ids in steps:
        gs = [torch.randn(len(f_ids), D, dtype=torch.float64, generator=gen) for f_ids in ids]
        for o in topts:
            o.zero_grad()
        loss = sum((torch.nn.functional.embedding(torch.tensor(f_ids, dtype=torch.long), theirs[t], sparse=sparse)
                    * g).sum() for t, f_ids, g in zip(table_of, ids, gs))
        loss.backward()
        for o in topts:  # (every table steps: a collection's step count is one a backward)
            o.step()
        flat = torch.tensor([i for f in ids for i in f], dtype=torch.long, device=device)
        kjt = embfuse.KeyedJaggedTensor(keys, flat, lengths=torch.tensor([n for ls in lengths for n in ls],
                                                                         device=device), stride=B)
        out = ours(kjt)
        sum((out[k].values() * g.float().to(device)).sum() for k, g in zip(keys, gs)).backward()
        for w, t in zip(ours.table_weights(), theirs):
            assert_close(w.detach(), t.detach(), torch.float32, reduction=flat.numel() + 1)
