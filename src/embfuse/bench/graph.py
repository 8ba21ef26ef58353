"""`embfuse bench --fx`: an eager seed-like model (bench/eager.py: 64 features, one
nn.EmbeddingBag(sparse=True) each, tables of 1K-1M rows x 64, mean pooling, B 4096, mean bag
length 20, split -> LayerNorm -> tanh -> cat, MLP 512-256-1), inputs starting on the host, run
five ways in one process:

- eager: the model as written, torch.optim.SGD over every parameter (sparse table gradients);
- compile: `torch.compile(model)`;
- compile + batch fusions: the same with Inductor's pre-grad batch fusions on;
- optimize: `embfuse.fx.optimize(model, optimizer=embfuse.optim.SGD)` + torch.optim.SGD on the rest;
- optimize + compile: that, compiled;
- optimize + CUDA graph: that, its forward and step each captured in a CUDA graph by
  `embfuse.fx.capture` and replayed on the same batches as the others (their bag lengths change).

Per variant: the forward (no_grad) and the training step (forward, BCE loss, backward, update),
milliseconds per call (median of alternating rounds, synchronised), and per call the CUDA
kernels launched and the host-to-device copies (torch.profiler). The floor of the forward: the
batch's id and offset bytes over the pinned host-to-device bandwidth, plus the lookup's roofline
(distinct rows + pooled output + ids over the device copy bandwidth), both measured in this run.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import embfuse
import embfuse.fx
from embfuse.bench.eager import EagerModel, eager_batch
from embfuse.bench.report import write_result
from embfuse.bench.runner import copy_bandwidth, metadata
from embfuse.fx.staging import Staging, copy_all, end_to_end

VARIANTS = ("eager", "compile", "compile + batch fusions", "optimize", "optimize + compile",
            "optimize + CUDA graph")
BATCH_FUSIONS = {name: {} for name in ("batch_layernorm", "batch_tanh", "batch_relu", "batch_sigmoid",
                                        "batch_linear")}


def table_sizes(features: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Log-uniform table sizes in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(features, generator=g, dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + float(x) * (math.log(hi) - math.log(lo))))) for x in u]


class _Variant:
    """A model, its optimizer, and its own forward / step callables."""

    def __init__(self, name: str, base: EagerModel, example, lr: float):
        self.fusions = name == "compile + batch fusions"
        model = copy.deepcopy(base)
        if name.startswith("optimize"):
            model = embfuse.fx.optimize(model, example, optimizer=embfuse.optim.SGD(lr=lr))
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        self.name, self.model = name, model
        self.call = model
        if "compile" in name:
            self.call = torch.compile(model)

    def _options(self):
        """Inductor's batch fusions, for the variant that asks for them (read when it compiles)."""
        if not self.fusions:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor

        return inductor.patch(pre_grad_fusion_options=BATCH_FUSIONS)

    def forward(self, batch):
        with torch.no_grad(), self._options():
            return self.call(*batch[:2])

    def step(self, batch):
        with self._options():
            self.opt.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(self.call(*batch[:2]), batch[2])
            loss.backward()
            self.opt.step()


class _Graphed:
    """`optimize`, its forward and its step each captured in a CUDA graph by `embfuse.fx.capture`
    and replayed on the bench's own batches, whose bag lengths change from batch to batch (the ids
    padded to the largest batch's count)."""

    def __init__(self, base: EagerModel, batches, lr: float):
        ids0, offsets0, _ = batches[0]
        model = embfuse.fx.optimize(copy.deepcopy(base), (ids0, offsets0), optimizer=embfuse.optim.SGD(lr=lr))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        capacity = max(sum(i.numel() for i in b[0]) for b in batches)

        def step(m, ids, offsets, target):
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(m(ids, offsets), target).backward()
            opt.step()

        self.graph_step = embfuse.fx.capture(model, batches[0], step, capacity=capacity, optimizers=[opt])
        with torch.no_grad():  # (the forward's graph: inference, the chain in the lookup's epilogue)
            self.graph_forward = embfuse.fx.capture(model, (ids0, offsets0), capacity=capacity)

    def forward(self, batch):
        return self.graph_forward(*batch[:2])

    def step(self, batch):
        self.graph_step(*batch)


def _time(fn, batches, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def _profile(fn, batch) -> dict:
    """Kernels and host-to-device copies of one call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(batch)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if "HtoD" in e.name]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    return {"kernels": len(kernels), "h2d_copies": len(copies)}


def _pinned_h2d(nbytes: int, device) -> float:
    """Bytes per second of one pinned host-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def _host_copy(ids) -> float:
    """Bytes per second of the host writing the batch's ids into pinned memory (the work a
    pageable copy makes the host do, whoever does it), on the threads embfuse uses."""
    n = sum(i.numel() for i in ids)
    pairs = end_to_end(Staging([(torch.int64, n)]).host[0], ids)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        copy_all(pairs)
        times.append(time.perf_counter() - t)
    return 8 * n / statistics.median(times)


def chain_kernel(features: int = 64, dim: int = 64, batch: int = 4096, mean_length: int = 20,
                 rows=(1_000, 1_000_000)) -> dict:
    """The pooled lookup alone (the collection on a batch already on the GPU) against the lookup
    followed by the fused LayerNorm + tanh kernel and by torch's LayerNorm, affine and tanh (the
    seed model's chain), us."""
    from triton.testing import do_bench

    from embfuse.fx.passes.lookups import LookupBatch
    from embfuse.ops.chain import layer_norm_act
    from embfuse.sparse.jagged import KeyedJaggedTensor

    device = torch.device("cuda")
    sizes = table_sizes(features, *rows)
    model = EagerModel(sizes, dim, mode="mean", device=device)
    batch_ = LookupBatch([f"f{i}" for i in range(features)], list(model.embs), False)
    ids, offsets = eager_batch(sizes, batch, mean_length, torch.Generator().manual_seed(1))
    kjt = KeyedJaggedTensor(batch_.names, torch.cat(ids).to(device), offsets=torch.cat(
        [o + sum(i.numel() for i in ids[:k]) for k, o in enumerate(offsets)]
        + [torch.tensor([sum(i.numel() for i in ids)])]).to(device), stride=batch)

    def lookup():
        return batch_.collection(kjt).values()
    w = torch.stack([n.weight.detach() for n in model.norms])
    b = torch.stack([n.bias.detach() for n in model.norms])

    def torch_chain(x):
        v = x.view(batch, features, dim)
        return torch.tanh(torch.addcmul(b, torch.nn.functional.layer_norm(v, (dim,)), w))

    with torch.no_grad():
        x = lookup()
        torch.testing.assert_close(layer_norm_act(x.view(batch, features, dim), w, b, 1e-5, "tanh"), torch_chain(x),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batch_.collection.forward_layer_norm(kjt, w, b, 1e-5, "tanh"),
                                   torch_chain(x).flatten(1), rtol=1e-4, atol=1e-5)
        us = {
            "lookup_us": do_bench(lookup, return_mode="median") * 1e3,
            "lookup_fused_chain_us": do_bench(lambda: layer_norm_act(lookup().view(batch, features, dim), w, b,
                                                                     1e-5, "tanh"), return_mode="median") * 1e3,
            "lookup_torch_chain_us": do_bench(lambda: torch_chain(lookup()), return_mode="median") * 1e3,
            "lookup_epilogue_chain_us": do_bench(lambda: batch_.collection.forward_layer_norm(kjt, w, b, 1e-5, "tanh"),
                                                 return_mode="median") * 1e3,
            "fused_chain_alone_us": do_bench(lambda: layer_norm_act(x.view(batch, features, dim), w, b, 1e-5,
                                                                    "tanh"), return_mode="median") * 1e3,
            "torch_chain_alone_us": do_bench(lambda: torch_chain(x), return_mode="median") * 1e3,
        }
    us["chain_bytes"] = 2 * x.numel() * x.element_size()
    return us


def measure(features: int = 64, dim: int = 64, batch: int = 4096, mean_length: int = 20, rows=(1_000, 1_000_000),
            rounds: int = 5, calls: int = 10, variants=VARIANTS, progress=None, pinned: bool = False) -> dict:
    """`pinned`: the batches start in pinned host memory (a DataLoader with pin_memory=True), not
    pageable."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    sizes = table_sizes(features, *rows)
    base = EagerModel(sizes, dim, mode="mean", device=device)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids, offsets = eager_batch(sizes, batch, mean_length, g)
        if pinned:
            ids, offsets = [i.pin_memory() for i in ids], [o.pin_memory() for o in offsets]
        batches.append((ids, offsets, torch.rand(batch, 1, generator=g).round().to(device)))
    lr = 0.01
    built = {name: _Graphed(base, batches, lr) if name == "optimize + CUDA graph" else
             _Variant(name, base, batches[0][:2], lr) for name in variants}
    rows_out = {name: {"variant": name} for name in variants}
    for kind in ("forward", "step"):
        for name, v in list(built.items()):  # warm-up: compiles, caches, clocks
            if progress is not None:
                progress(f"warming up: {name}, {kind}")
            try:
                for i in range(3):
                    getattr(v, kind)(batches[i % len(batches)])
            except Exception as e:  # a variant that does not run is reported, not fatal
                rows_out[name]["error"] = f"{kind}: {type(e).__name__}: {str(e)[:300]}"
                del built[name]
        samples = {name: [] for name in built}
        for _ in range(rounds):
            for name, v in built.items():
                samples[name].append(_time(getattr(v, kind), batches, calls))
        for name, v in built.items():
            rows_out[name][f"{kind}_ms"] = 1e3 * statistics.median(samples[name])
            prof = _profile(getattr(v, kind), batches[0])
            rows_out[name][f"{kind}_kernels"] = prof["kernels"]
            rows_out[name][f"{kind}_h2d_copies"] = prof["h2d_copies"]
    bandwidth = copy_bandwidth(device)
    ids, offsets = batches[0][:2]
    index_bytes = sum(i.numel() * i.element_size() + o.numel() * o.element_size() for i, o in zip(ids, offsets))
    h2d = _pinned_h2d(index_bytes, device)
    distinct = sum(int(torch.unique(i).numel()) for i in ids)
    lookup_bytes = distinct * dim * 4 + batch * features * dim * 4 + index_bytes
    floor = {"index_bytes": index_bytes, "pinned_h2d_GBps": h2d / 1e9, "h2d_ms": 1e3 * index_bytes / h2d,
             "distinct_rows": distinct, "lookup_roofline_ms": 1e3 * lookup_bytes / bandwidth}
    floor["forward_floor_ms"] = floor["h2d_ms"] + floor["lookup_roofline_ms"]
    floor["host_copy_GBps"] = _host_copy(ids) / 1e9
    floor["host_copy_ms"] = 1e3 * index_bytes / (floor["host_copy_GBps"] * 1e9)
    return {"meta": metadata(device, bandwidth),
            "model": {"features": features, "dim": dim, "batch": batch, "mean_length": mean_length, "pinned": pinned,
                      "rows": list(rows), "table_rows_total": sum(sizes)},
            "floor": floor, "rows": [rows_out[n] for n in variants], "chain": chain_kernel(features, dim, batch,
                                                                                          mean_length, rows)}


def markdown(result: dict) -> str:
    m, f = result["meta"], result["floor"]
    eager = next(r for r in result["rows"] if r["variant"] == "eager")
    lines = [f"Seed-like eager model on {m['gpu']} (torch {m['torch']}, triton {m['triton']}, commit {m['commit']}, "
             f"{m['date']}): {result['model']}",
             "",
             "| variant | forward ms | vs eager | kernels | H2D copies | step ms | vs eager | kernels | H2D copies |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "step_ms" not in r:
            lines.append(f"| {r['variant']} | failed: {r.get('error')} |")
            continue
        lines.append(f"| {r['variant']} | {r['forward_ms']:.2f} | {eager['forward_ms'] / r['forward_ms']:.2f}x | "
                     f"{r['forward_kernels']} | {r['forward_h2d_copies']} | {r['step_ms']:.2f} | "
                     f"{eager['step_ms'] / r['step_ms']:.2f}x | {r['step_kernels']} | {r['step_h2d_copies']} |")
    lines += ["", f"Forward floor: {f['forward_floor_ms']:.2f} ms = ids and offsets ({f['index_bytes'] / 1e6:.1f} MB) "
                  f"over the pinned host-to-device bandwidth ({f['pinned_h2d_GBps']:.1f} GB/s): {f['h2d_ms']:.2f} ms, "
                  f"+ the lookup's roofline ({f['distinct_rows']} distinct rows): {f['lookup_roofline_ms']:.2f} ms. "
                  f"The ids start in {'pinned' if result['model'].get('pinned') else 'pageable'} host memory; "
                  f"writing them into pinned memory took "
                  f"{f['host_copy_ms']:.2f} ms ({f['host_copy_GBps']:.1f} GB/s, 12 host threads) in this run."]
    c = result.get("chain")
    if c:
        lines += ["", "| batch on the GPU, us | lookup | lookup with LayerNorm/tanh in its epilogue (inference) | "
                      "lookup + fused LayerNorm/tanh | lookup + torch LayerNorm, affine, "
                      "tanh | fused chain alone | torch chain alone |", "|---|---|---|---|---|---|---|",
                  f"| B{result['model']['batch']} x {result['model']['features']} x {result['model']['dim']} | "
                  f"{c['lookup_us']:.0f} | {c['lookup_epilogue_chain_us']:.0f} "
                  f"(+{100 * (c['lookup_epilogue_chain_us'] / c['lookup_us'] - 1):.0f}%) | "
                  f"{c['lookup_fused_chain_us']:.0f} "
                  f"(+{100 * (c['lookup_fused_chain_us'] / c['lookup_us'] - 1):.0f}%) | "
                  f"{c['lookup_torch_chain_us']:.0f} | {c['fused_chain_alone_us']:.0f} | "
                  f"{c['torch_chain_alone_us']:.0f} |"]
    return "\n".join(lines)


def write(result: dict, out: Path) -> Path:
    return write_result(result, out, "bench-fx", markdown)
