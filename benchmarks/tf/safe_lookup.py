"""embfuse.tf.safe_embedding_lookup_sparse against the same function composed of torch ops the way
TensorFlow's graph runs it (prune, fill empty rows, unique, gather, weight, segment sums, divide,
zero the empty rows) and against embfuse.embedding_bag on the same bags (issue 21's targets):
26 features x B16384, one table of 1M x 128 each, bags of 1-20 ids, some ids -1, weighted mean.
Forward + backward, median us (CUDA events through triton's do_bench), and kernel launches a call
(torch.profiler). The first three rows leave dense gradients (26 x 1M x 128) in .grad, as a
functional call on a plain tensor must; the last two train in the backward instead (fused SGD,
no dense gradient): embfuse.tf.SafeEmbeddingBag, and embfuse.nn.EmbeddingBag on the same bags.
One device call:

    PYTHONPATH=src python3 benchmarks/tf/safe_lookup.py [batch]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
F, ROWS, D, dev = 26, 1_000_000, 128, "cuda"
torch.manual_seed(0)
tables = [torch.randn(ROWS, D, device=dev, requires_grad=True) for _ in range(F)]
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


def bag_step():
    outs = [embfuse.embedding_bag(i, t, o, mode="sum", per_sample_weights=w, include_last_offset=True)
            for t, (i, o, w) in zip(tables, pruned)]
    torch.cat(outs, 1).sum().backward()


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
bag_modules = [sharing(embfuse.nn.EmbeddingBag(1, D, mode="sum", include_last_offset=True, device=dev), t)
               for t in tables]


def fused_safe_step():
    torch.cat([m(b[0], b[1]) for m, b in zip(safe_modules, batches)], 1).sum().backward()


def fused_bag_step():
    torch.cat([m(i, o, per_sample_weights=w) for m, (i, o, w) in zip(bag_modules, pruned)], 1).sum().backward()


ref = torch.cat([composed(t, b[0], b[1]) for t, b in zip(tables, batches)], 1)
with torch.no_grad():
    fused = torch.cat([m(b[0], b[1]) for m, b in zip(safe_modules, batches)], 1)
print("max |SafeEmbeddingBag - composed|", float((ref - fused).abs().max()), flush=True)
got = torch.cat([embfuse_tf(t, b[0], b[1]) for t, b in zip(tables, batches)], 1)
print("max |embfuse.tf - composed|", float((ref - got).abs().max()), flush=True)
for name, run in (("composed torch (TF's graph)", step(composed)), ("embfuse.tf", step(embfuse_tf)),
                  ("embfuse.embedding_bag, same bags", bag_step),
                  ("embfuse.tf.SafeEmbeddingBag, fused SGD", fused_safe_step),
                  ("embfuse.nn.EmbeddingBag, fused SGD, same bags", fused_bag_step)):
    run()
    us = do_bench(run, warmup=3, rep=50, return_mode="median") * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{name}: forward + backward {us:.0f} us, {launches} kernels", flush=True)
