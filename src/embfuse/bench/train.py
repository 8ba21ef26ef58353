"""Training-step providers: forward + backward + optimizer update of T tables, sum pooling
(kind "train"); and forward + backward to a dense weight gradient (kind "backward").

Bytes a fused step must move, per table: the distinct rows read by the forward, read again and
written by the update, (row-wise Adagrad) one fp32 state value per distinct row read and written,
the pooled output written and its gradient read, and the ids.
"""

from __future__ import annotations

import functools

import torch

import embfuse
from embfuse.bench.peers import fbgemm_tbe
from embfuse.bench.providers import attempt
from embfuse.bench.workloads import Workload, generate_batch


def batches(w: Workload, device):
    """One (2-D ids) batch per table, each from its own seed."""
    return [generate_batch(w, device, seed=t)[0] for t in range(w.tables)]


def count_train_bytes(w: Workload, ids: list[torch.Tensor], rowwise_state: bool) -> dict:
    elt = torch.empty(0, dtype=w.torch_dtype).element_size()
    total = distinct_all = 0
    for x in ids:
        distinct = int(torch.unique(x).numel())
        distinct_all += distinct
        total += 3 * distinct * w.dim * elt + 2 * w.batch * w.dim * 4 + x.numel() * x.element_size()
        total += 8 * distinct if rowwise_state else 0
    return {"distinct_rows": distinct_all, "ids": sum(x.numel() for x in ids), "min_bytes": total,
            "rows_bytes": sum(x.numel() for x in ids) * w.dim * elt}


def _step(lookups, grad):
    def step():
        torch.cat([f() for f in lookups], dim=1).backward(grad)
    return step


def torch_sparse_sgd(w, ids, device):
    mods = [torch.nn.EmbeddingBag(w.rows, w.dim, mode="sum", sparse=True, device=device) for _ in ids]
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.01)
    grad = torch.randn(w.batch, w.dim * len(ids), device=device)
    inner = _step([lambda m=m, x=x: m(x) for m, x in zip(mods, ids)], grad)

    def step():
        opt.zero_grad(set_to_none=True)
        inner()
        opt.step()
    return step, mods


def _embfuse(optimizer, bounds_check="deferred"):
    def make(w, ids, device):
        mods = [embfuse.nn.EmbeddingBag(w.rows, w.dim, mode="sum", optimizer=optimizer, bounds_check=bounds_check,
                                        device=device) for _ in ids]
        grad = torch.randn(w.batch, w.dim * len(ids), device=device)
        return _step([lambda m=m, x=x: m(x) for m, x in zip(mods, ids)], grad), mods
    return make


def _collection(optimizer, bounds_check="deferred"):
    """All tables in one embfuse.EmbeddingBagCollection, fed one keyed batch."""
    def make(w, ids, device):
        ebc = embfuse.EmbeddingBagCollection(
            [embfuse.EmbeddingBagConfig(w.rows, w.dim, f"t{t}", feature_names=[f"f{t}"]) for t in range(len(ids))],
            device=device, optimizer=optimizer, bounds_check=bounds_check)
        kjt = embfuse.KeyedJaggedTensor(
            [f"f{t}" for t in range(len(ids))], torch.cat([x.reshape(-1) for x in ids]),
            lengths=torch.full((len(ids) * w.batch,), w.hotness, device=device),
            length_per_key=[x.numel() for x in ids])
        grad = torch.randn(w.batch, w.dim * len(ids), device=device)
        return (lambda: ebc(kjt).values().backward(grad)), [ebc]
    return make


def _fbgemm(kind, checked=True):
    def make(w, ids, device):
        tbe = fbgemm_tbe([(w.rows, w.dim)] * len(ids), optimizer="sgd" if kind == "sgd" else "rowwise",
                         checked=checked)
        flat = torch.cat([x.reshape(-1) for x in ids])
        offs = torch.arange(0, flat.numel() + 1, w.hotness, device=device)
        grad = torch.randn(w.batch, w.dim * len(ids), device=device)

        def step():
            tbe(flat, offs).backward(grad)
        return step, [tbe]
    return make


TRAIN_PROVIDERS = {
    "torch": torch_sparse_sgd,
    "embfuse": _embfuse(embfuse.optim.SGD(lr=0.01)),
    "embfuse rowwise-adagrad": _embfuse(embfuse.optim.RowWiseAdagrad(lr=0.01, eps=1e-8)),
    "embfuse-ebc": _collection(embfuse.optim.SGD(lr=0.01)),
    "embfuse-ebc-off": _collection(embfuse.optim.SGD(lr=0.01), "off"),
    "embfuse-ebc rowwise-adagrad": _collection(embfuse.optim.RowWiseAdagrad(lr=0.01, eps=1e-8)),
    "fbgemm": _fbgemm("sgd"),
    "fbgemm-none": _fbgemm("sgd", checked=False),
    "fbgemm rowwise-adagrad": _fbgemm("rowwise"),
}


def _dense(lookup):
    def make(w, ids, device):
        tables = [torch.randn(w.rows, w.dim, device=device, requires_grad=True) for _ in ids]
        grad = torch.randn(w.batch, w.dim * len(ids), device=device)
        inner = _step([lambda t=t, x=x: lookup(x, t, mode="sum") for t, x in zip(tables, ids)], grad)

        def step():
            for t in tables:
                t.grad = None
            inner()
        return step, tables
    return make


BACKWARD_PROVIDERS = {
    "torch": _dense(torch.nn.functional.embedding_bag),
    "embfuse": _dense(embfuse.embedding_bag),
    "embfuse-off": _dense(functools.partial(embfuse.embedding_bag, bounds_check="off")),
}


def measure_train(w: Workload, device) -> list[dict]:
    from triton.testing import do_bench

    ids = batches(w, device)
    rows = []
    providers = TRAIN_PROVIDERS if w.kind == "train" else BACKWARD_PROVIDERS
    for name, make in providers.items():
        row = {"workload": w.name, "provider": name, **count_train_bytes(w, ids, "rowwise" in name)}
        if w.kind == "backward":  # the dense gradient: zeroed and written whole, every step
            row["min_bytes"] += 2 * w.tables * w.rows * w.dim * 4

        def measure(row, make=make):
            step, _keep = make(w, ids, device)
            step()
            row["us"] = do_bench(step, warmup=3, rep=300, return_mode="median") * 1e3

        attempt(row, measure)
        rows.append(row)
    return rows
