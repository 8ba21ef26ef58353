"""embfuse.tf.safe_embedding_lookup_sparse against the same function composed of torch ops the way
TensorFlow's graph runs it (prune, fill empty rows, unique, gather, weight, segment sums, divide,
zero the empty rows) and against embfuse's own lookups of the same bags (issue 21's targets):
26 features x B16384, one table of 1M x 128 each, bags of 1-20 ids, some ids -1, weighted mean.
Forward + backward, median us (CUDA events through triton's do_bench), and kernel launches a call
(torch.profiler). Rows marked "dense grads" leave dense gradients (26 x 1M x 128) in .grad, as a
functional call on a plain tensor must; "fused SGD" rows train in the backward instead (no dense
gradient). Per feature: embfuse.tf's functions and SafeEmbeddingBag; all 26 at once: one
EmbeddingBagCollection whose tables say combiner="mean" (TensorFlow's rules, its batch made by
embfuse.tf.keyed_batch from the 26 sparse tensors inside the timed step); "same bags" rows look up
the batch pruned beforehand with plain tables (the same bytes). Every lookup reads one set of
tables (views of one buffer). One device call:

    PYTHONPATH=src python3 benchmarks/tf/safe_lookup.py [batch]
    PYTHONPATH=src python3 benchmarks/tf/safe_lookup.py --smoke    (CPU, small: outputs only)
"""

import sys

import torch

import embfuse

SMOKE = "--smoke" in sys.argv
args = [a for a in sys.argv[1:] if not a.startswith("--")]
B = int(args[0]) if args else (64 if SMOKE else 16384)
F, ROWS, D, dev = (26, 1000, 16, "cpu") if SMOKE else (26, 1_000_000, 128, "cuda")
torch.manual_seed(0)
KEYS = [f"f{f}" for f in range(F)]


def collection(**how):
    """26 tables, one a feature; built on the meta device (its buffer is assigned after)."""
    cfg = [embfuse.EmbeddingBagConfig(ROWS, D, f"t{f}", feature_names=[k], **how) for f, k in enumerate(KEYS)]
    return embfuse.EmbeddingBagCollection(cfg, is_weighted=True, device="meta")


ebc_tf, ebc_plain = collection(combiner="mean"), collection(pooling="wmean")
buffer = torch.nn.Parameter(torch.randn(F * ROWS * D, device=dev))
ebc_tf.weights = ebc_plain.weights = buffer
tables = [w.detach().requires_grad_() for w in ebc_tf.table_weights()]  # leaves sharing the buffer
batches = []
for f in range(F):
    lengths = torch.randint(1, 21, (B,), device=dev)
    lengths[::17] = 0  # some empty rows
    n = int(lengths.sum())
    rows = torch.repeat_interleave(torch.arange(B, device=dev), lengths)
    cols = torch.arange(n, device=dev) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    ids = torch.randint(0, ROWS, (n,), device=dev)
    ids[::50] = -1
    w = torch.rand(n, device=dev) + 0.1
    idx = torch.stack([rows, cols])
    # row-major with unique indices: TensorFlow's canonical SparseTensor, declared coalesced
    batches.append((torch.sparse_coo_tensor(idx, ids, (B, 20), is_coalesced=True),
                    torch.sparse_coo_tensor(idx, w, (B, 20), is_coalesced=True),
                    rows, ids, w, lengths))
sparse_ids = {k: b[0] for k, b in zip(KEYS, batches)}
sparse_w = {k: b[1] for k, b in zip(KEYS, batches)}


def composed(table, sp_ids, sp_w):
    """TensorFlow's graph for safe_embedding_lookup_sparse(combiner="mean"), op by op."""
    rows, ids, w = sp_ids._indices()[0], sp_ids._values(), sp_w._values()
    keep = (ids >= 0) & (w > 0)
    rows, ids, w = rows[keep], ids[keep], w[keep]
    empty = torch.ones(B, dtype=torch.bool, device=dev).index_fill(0, rows, False)
    filled = empty.nonzero()[:, 0]
    rows, ids = torch.cat([rows, filled]), torch.cat([ids, torch.zeros_like(filled)])
    w = torch.cat([w, torch.ones(filled.numel(), device=dev)])
    uniq, inv = torch.unique(ids, return_inverse=True)
    e = table[uniq][inv] * w[:, None]
    s = torch.zeros(B, D, device=dev).index_add(0, rows, e)
    total = torch.zeros(B, device=dev).index_add(0, rows, w)
    out = torch.where(total[:, None] != 0, s / torch.where(total != 0, total, 1)[:, None], 0)
    return torch.where(empty[:, None], 0, out)


def embfuse_tf(table, sp_ids, sp_w):
    return embfuse.tf.safe_embedding_lookup_sparse(table, sp_ids, sp_w, combiner="mean")


def step(fn):
    def run():
        outs = [fn(t, b[0], b[1]) for t, b in zip(tables, batches)]
        torch.cat(outs, 1).sum().backward()
    return run


pruned = []
for rows, ids, w, lengths in ((b[2], b[3], b[4], b[5]) for b in batches):
    keep = ids >= 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                         torch.cumsum(torch.bincount(rows[keep], minlength=B), 0)])
    pruned.append((ids[keep], offsets, w[keep]))
pruned_kjt = embfuse.KeyedJaggedTensor(KEYS, torch.cat([i for i, _, _ in pruned]), torch.cat([w for _, _, w in pruned]),
                                       lengths=torch.cat([o[1:] - o[:-1] for _, o, _ in pruned]), stride=B)


def bag_step():
    outs = [embfuse.embedding_bag(i, t, o, mode="wmean", per_sample_weights=w, include_last_offset=True)
            for t, (i, o, w) in zip(tables, pruned)]
    torch.cat(outs, 1).sum().backward()


def tf_collection_step():
    ebc_tf(embfuse.tf.keyed_batch(sparse_ids, sparse_w)).values().sum().backward()


def plain_collection_step():
    ebc_plain(pruned_kjt).values().sum().backward()


def sharing(module, table):
    """`module` (built with one row) made to look up `table` in place, its fused SGD rebuilt."""
    module.weight = torch.nn.Parameter(table.detach())
    module.num_embeddings = table.shape[0]
    module.set_optimizer(embfuse.optim.SGD(lr=1e-3))
    return module


safe_modules = []
for t in tables:
    m = embfuse.tf.SafeEmbeddingBag(1, D, "mean", device=dev)
    sharing(m.bag, t)
    safe_modules.append(m)
bag_modules = [sharing(embfuse.nn.EmbeddingBag(1, D, mode="wmean", include_last_offset=True, device=dev), t)
               for t in tables]


def fused_safe_step():
    torch.cat([m(b[0], b[1]) for m, b in zip(safe_modules, batches)], 1).sum().backward()


def fused_bag_step():
    torch.cat([m(i, o, per_sample_weights=w) for m, (i, o, w) in zip(bag_modules, pruned)], 1).sum().backward()


with torch.no_grad():
    ref = torch.cat([composed(t, b[0], b[1]) for t, b in zip(tables, batches)], 1)
    for name, got in (
            ("SafeEmbeddingBag", torch.cat([m(b[0], b[1]) for m, b in zip(safe_modules, batches)], 1)),
            ("embfuse.tf", torch.cat([embfuse_tf(t, b[0], b[1]) for t, b in zip(tables, batches)], 1)),
            ("collection, combiner=mean", ebc_tf(embfuse.tf.keyed_batch(sparse_ids, sparse_w)).values()),
            ("collection, same bags", ebc_plain(pruned_kjt).values())):
        print(f"max |{name} - composed|", float((ref - got).abs().max()), flush=True)
if SMOKE:
    sys.exit(0)

from triton.testing import do_bench  # noqa: E402


def clear_grads():
    for t in tables + [buffer]:
        t.grad = None


rows = [("composed torch (TF's graph), dense grads", step(composed)), ("embfuse.tf, dense grads", step(embfuse_tf)),
        ("embfuse.embedding_bag, same bags, dense grads", bag_step),
        ("collection, combiner=mean, from 26 sparse tensors, dense grads", tf_collection_step),
        ("collection, same bags, dense grads", plain_collection_step),
        ("embfuse.tf.SafeEmbeddingBag, fused SGD", fused_safe_step),
        ("embfuse.nn.EmbeddingBag, same bags, fused SGD", fused_bag_step),
        ("collection, combiner=mean, from 26 sparse tensors, fused SGD", tf_collection_step),
        ("collection, same bags, fused SGD", plain_collection_step)]
for i, (name, run) in enumerate(rows):
    if i == 5:  # the fused rows: the collections train in the backward from now on
        clear_grads()
        for ebc in (ebc_tf, ebc_plain):
            ebc.set_optimizer(embfuse.optim.SGD(lr=1e-3))
    run()
    us = do_bench(run, warmup=3, rep=50, return_mode="median") * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{name}: forward + backward {us:.0f} us, {launches} kernels", flush=True)
    clear_grads()
embfuse.check_errors()
