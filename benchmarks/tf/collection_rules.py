"""GPU time of one EmbeddingBagCollection call under TensorFlow's rules against TorchRec's plain
pooling, and the kernels it is spent in (for A/B runs of two trees in separate processes): the
26 Criteo-like tables x 128 of `embfuse bench --distributed` (bench/distributed.py: rows capped at
1M, power-law ids, bags of 1-39 ids), B samples, one feature a table, the default bounds check,
fused row-wise Adagrad. Three collections: `pooling="sum"`, `combiner="sum"` (the rules only drop
ids < 0) and `combiner="mean", default_id=0` (the safe pass); the two with a combiner get the
same batch with 5% of its ids made negative (-1 to -99). Forward (no_grad: a lookup that trains
nothing) and training step: median of CUDA-event timings (do_bench), then the profiler's GPU
time a call and its six longest kernels.

    PYTHONPATH=src python3 benchmarks/tf/collection_rules.py [label] [batch]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.distributed import workload

label = sys.argv[1] if len(sys.argv) > 1 else ""
w = workload(int(sys.argv[2]) if len(sys.argv) > 2 else 16384)
CALLS = 20
kjt = make_batch(w, "cuda")
ids, lengths, keys = kjt.values(), kjt.lengths(), kjt.keys()
g = torch.Generator(device="cuda").manual_seed(1)
negative = torch.rand(ids.numel(), device="cuda", generator=g) < 0.05
dropped = torch.where(negative, -torch.randint(1, 100, ids.shape, device="cuda", generator=g), ids)


def collection(**how):
    tables = [embfuse.EmbeddingBagConfig(r, w.dim, f"t{i}", feature_names=[k], **how)
              for i, (r, k) in enumerate(zip(table_rows(w), keys))]
    return embfuse.EmbeddingBagCollection(tables, device="cuda", optimizer=embfuse.optim.RowWiseAdagrad(lr=0.01))


def kernels(run):
    """The profiler's GPU time of one call and its six longest kernels (us a call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:30]] = times.get(e.name[:30], 0) + e.device_time / CALLS
    top = sorted(times.items(), key=lambda kv: -kv[1])[:6]
    return sum(times.values()), "; ".join(f"{k} {v:.0f}" for k, v in top)


for name, how, values in (("pooling sum", {}, ids), ("combiner sum", dict(combiner="sum"), dropped),
                          ("combiner mean d0", dict(combiner="mean", default_id=0), dropped)):
    ebc = collection(**how)
    batch = embfuse.KeyedJaggedTensor(keys, values, lengths=lengths, stride=w.batch,
                                      length_per_key=kjt.length_per_key())
    grad = torch.randn(w.batch, w.tables * w.dim, device="cuda")

    def forward():
        with torch.no_grad():
            ebc(batch)

    def step():
        ebc(batch).values().backward(grad)

    for mode, run in (("fwd", forward), ("step", step)):
        run()
        us = do_bench(run, warmup=3, rep=200, return_mode="median") * 1e3
        gpu, top = kernels(run)
        print(f"{label} | {name} | {mode} | {us:.0f} us | GPU {gpu:.0f} us | {top}", flush=True)
    embfuse.check_errors()
    ebc = batch = None
    torch.cuda.empty_cache()
