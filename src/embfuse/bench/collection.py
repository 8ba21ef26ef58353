"""Table-collection workloads (kind "collection": forward; "collection-train": forward + backward
+ fused SGD; "collection-train-rowwise": the same with row-wise Adagrad): 26 tables with
Criteo-like row counts, one keyed jagged batch of every feature.

Providers: a loop of torch nn.EmbeddingBag (sparse gradients + torch.optim.SGD when training),
FBGEMM's TBE over the same tables (EXACT_SGD / EXACT_ROWWISE_ADAGRAD), TorchRec's unsharded
EmbeddingBagCollection when it imports, and embfuse.EmbeddingBagCollection (with hot_rows:
"embfuse-hot"). Torch and TorchRec's unsharded collection have no row-wise Adagrad. Besides
time, each provider's kernel launches and host-to-device copies per step are counted with the
profiler, starting from a batch in pinned host memory, as a training loop sees it.
"""

from __future__ import annotations

import functools

import torch

import embfuse
from embfuse.bench.peers import Unsupported, fbgemm_tbe
from embfuse.bench.providers import attempt
from embfuse.bench.runner import HOST_ROWS_US, gpu_us, host_us
from embfuse.bench.workloads import Workload, generate_ids

# the 26 categorical features of Criteo's Kaggle display-advertising set, capped at the
# workload's `rows` (10M in the suite)
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
               10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def table_rows(w: Workload) -> list[int]:
    return [min(r, w.rows) for r in CRITEO_ROWS[:w.tables]]


def make_batch(w: Workload, device, seed: int = 0, rows=None) -> embfuse.KeyedJaggedTensor:
    """Bag lengths uniform in [1, 2 * hotness - 1]; ids from the workload's distribution per table
    (of `rows` rows each; default: table_rows)."""
    g = torch.Generator(device=device).manual_seed(seed)
    F, B = w.tables, w.batch
    lengths = torch.randint(1, 2 * w.hotness, (F * B,), device=device, generator=g)
    per_key = lengths.view(F, B).sum(1).tolist()
    values = torch.cat([generate_ids(Workload(w.name, w.kind, r, w.dim, B, dist=w.dist, alpha=w.alpha), n, device, g)
                        for r, n in zip(rows or table_rows(w), per_key)])
    return embfuse.KeyedJaggedTensor([f"f{i}" for i in range(F)], values, lengths=lengths, stride=B,
                                     length_per_key=per_key)


def make_collection(w: Workload, device, optimizer=None, data_type=torch.float32,
                    hot_rows=0, bounds_check="deferred", is_weighted=False) -> embfuse.EmbeddingBagCollection:
    """The workload's tables as one embfuse.EmbeddingBagCollection, table i read by feature f{i}
    (make_batch's keys; batches with weights when `is_weighted`); checked as a user gets it unless
    `bounds_check` says. With `hot_rows` (training) the hot set comes from another batch (seed 1),
    stepped once here, and stays; every batch takes the hot path, whatever its size."""
    ebc = embfuse.EmbeddingBagCollection(
        [embfuse.EmbeddingBagConfig(r, w.dim, f"t{i}", feature_names=[f"f{i}"], data_type=data_type)
         for i, r in enumerate(table_rows(w))], device=device, optimizer=optimizer, bounds_check=bounds_check,
        hot_rows=hot_rows, hot_refresh=2**62, hot_min_values=0, is_weighted=is_weighted)
    if hot_rows:
        ebc(make_batch(w, device, seed=1)).values().sum().backward()
    return ebc


def count_bytes(w: Workload, kjt) -> dict:
    distinct = sum(int(torch.unique(jt.values()).numel()) for jt in kjt.to_dict().values())
    out = w.batch * w.dim * w.tables * 4
    ids = kjt.values().numel() * 8 + kjt.lengths().numel() * 8
    rows = distinct * w.dim * 4
    train = w.kind.startswith("collection-train")
    # training: rows read by the forward, read and written by the update; output and its gradient
    return {"distinct_rows": distinct, "ids": kjt.values().numel(),
            "min_bytes": (3 * rows + 2 * out + ids) if train else (rows + out + ids),
            "rows_bytes": kjt.values().numel() * w.dim * 4}


def _rowwise(w: Workload) -> bool:
    return w.kind == "collection-train-rowwise"


def _torch_loop(w, kjt, device, train):
    if _rowwise(w):
        raise Unsupported("torch has no row-wise Adagrad")
    mods = [torch.nn.EmbeddingBag(r, w.dim, mode="sum", sparse=train, device=device) for r in table_rows(w)]
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.01) if train else None

    def forward(batch):
        return torch.cat([m(jt.values(), jt.offsets()[:-1]) for m, jt in zip(mods, batch.to_dict().values())], 1)

    def move(host):  # what a torch loop does: two copies per feature
        parts = host.to_dict()
        return embfuse.KeyedJaggedTensor.from_jt_dict(
            {k: embfuse.JaggedTensor(jt.values().to(device, non_blocking=True),
                                     lengths=jt.lengths().to(device, non_blocking=True)) for k, jt in parts.items()})

    return forward, opt, move, mods


def _fbgemm(w, kjt, device, train, checked=True):
    tbe = fbgemm_tbe([(r, w.dim) for r in table_rows(w)], optimizer="rowwise" if _rowwise(w) else "sgd",
                     checked=checked)

    def forward(batch):
        return tbe(batch.values(), batch.offsets())

    def move(host):  # ids and offsets of every table, already concatenated: two copies
        return embfuse.KeyedJaggedTensor(host.keys(), host.values().to(device, non_blocking=True),
                                         offsets=host.offsets().to(device, non_blocking=True), stride=host.stride())

    return forward, None, move, [tbe]


def _torchrec(w, kjt, device, train):
    if _rowwise(w):
        raise Unsupported("TorchRec's unsharded collection trains with torch optimizers: no row-wise Adagrad")
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
    except ImportError as e:
        raise Unsupported(f"torchrec does not import: {e}") from None
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=r, embedding_dim=w.dim, name=f"t{i}",
                                                     feature_names=[f"f{i}"]) for i, r in enumerate(table_rows(w))],
                                 device=torch.device(device))
    opt = torch.optim.SGD(ebc.parameters(), lr=0.01) if train else None
    return (lambda batch: ebc(batch.to_torchrec()).values()), opt, (lambda host: host.to(device)), [ebc]


def _embfuse(w, kjt, device, train, hot_rows=0, bounds_check="deferred"):
    rule = embfuse.optim.RowWiseAdagrad(lr=0.01) if _rowwise(w) else embfuse.optim.SGD(lr=0.01)
    ebc = make_collection(w, device, rule if train else None, hot_rows=hot_rows, bounds_check=bounds_check)
    return (lambda batch: ebc(batch).values()), None, (lambda host: host.to(device, non_blocking=True)), [ebc]


def _embfuse_hot(w, kjt, device, train):
    if not train:
        raise Unsupported("the hot-row path is the training step's; the forward is embfuse's")
    return _embfuse(w, kjt, device, train, hot_rows=HOT_ROWS)


# hot rows a table of the "embfuse-hot" provider (benchmarks/NOTES.md, session 9)
HOT_ROWS = 64
COLLECTION_PROVIDERS = {"torch": _torch_loop, "fbgemm": _fbgemm,
                        "fbgemm-none": functools.partial(_fbgemm, checked=False), "torchrec": _torchrec,
                        "embfuse": _embfuse, "embfuse-off": functools.partial(_embfuse, bounds_check="off"),
                        "embfuse-hot": _embfuse_hot}


def launch_counts(fn) -> dict:
    """Kernels and host-to-device copies that one call of `fn` puts on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    h2d = sum("HtoD" in n for n in names)
    other = sum(n.startswith("Memcpy") or n.startswith("Memset") for n in names)
    return {"kernels_per_step": len(names) - other, "h2d_copies_per_step": h2d}


def measure_collection(w: Workload, device) -> list[dict]:
    from triton.testing import do_bench

    train = w.kind.startswith("collection-train")
    kjt = make_batch(w, device)
    host = kjt.to("cpu").pin_memory()
    counts = count_bytes(w, kjt)
    rows = []
    for name, make in COLLECTION_PROVIDERS.items():
        row = {"workload": w.name, "provider": name, **counts}

        def measure(row, make=make):
            forward, opt, move, _keep = make(w, kjt, device, train)
            grad = torch.randn(w.batch, w.dim * w.tables, device=device)

            def step(batch=kjt):
                if not train:
                    with torch.no_grad():
                        return forward(batch)
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                forward(batch).backward(grad)
                if opt is not None:
                    opt.step()

            step()
            row["us"] = do_bench(step, warmup=3, rep=300, return_mode="median") * 1e3
            if row["us"] < HOST_ROWS_US:
                row["host_us_per_call"], row["gpu_us"] = host_us(step), gpu_us(step)
            row.update(launch_counts(lambda: step(move(host))))

        attempt(row, measure)
        rows.append(row)
    return rows
