"""Hot rows resident in L2 (`pin_hot_rows_in_l2`), measured beside the plain lookup and FBGEMM.

Every row is an inference forward of one batch (ids on the GPU): embfuse as a user gets it
(default check) without and with residency, embfuse with checks off, FBGEMM's TBE with its
default check (WARNING) and NONE. The hot set is counted from ANOTHER batch of the same
distribution (seed 1), as a module in service counts an earlier batch; `hit` is the share of
the measured batch's lookups its rows serve. Times are medians of CUDA-event timings with the L2
flushed between calls (triton's do_bench): normal traffic, which persisting lines survive, as
they survive a model's other kernels between two lookups. "resident, reset" also demotes every
persisting line before each call: the gain within one call alone. Each provider starts with no
persisting line left by the one before it. "back-to-back": wall time a
call over 50 calls in a row without flushes (where the host's own time per call shows). "GPU":
the GPU work's own time a call (the profiler's, each call after a flush), which the host's time
does not enter: what a host-bound row (B16384) costs the GPU.

Bounds, in the same run: DRAM (distinct rows + output + ids over the copy bandwidth, as the
grid's roofline) and "all in L2": the same lookup (same bags, same width) with every id folded
into a 16 MB table, so that every row read hits the L2: what the lookup costs when no row comes
from DRAM, the most residency could give.
"""

from __future__ import annotations

from pathlib import Path

import torch

import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.peers import fbgemm_tbe
from embfuse.bench.providers import attempt
from embfuse.bench.report import write_result
from embfuse.bench.runner import copy_bandwidth, gpu_us, host_us, metadata
from embfuse.bench.workloads import Workload, generate_ids

WORKLOADS = [
    *(Workload(f"bag D{d} B{b} L64 powerlaw1.05", "bag", 10_000_000, d, b, 64, "powerlaw", 1.05, group="l2")
      for d in (32, 128) for b in (16384, 65536)),
    Workload("bag D128 B65536 L64 uniform", "bag", 10_000_000, 128, 65536, 64, group="l2"),
    *(Workload(f"bag D{d} B65536 L64 ranked1.05", "bag", 10_000_000, d, 65536, 64, "ranked", 1.05, group="l2")
      for d in (32, 128)),
    Workload("collection 26 criteo x 128, B16384 L1-99 powerlaw1.05", "collection", 10_000_000, 128, 16384, 50,
             "powerlaw", 1.05, tables=26, group="l2"),
    Workload("collection 12 x 500K x 128, B2048 L1-299 powerlaw1.05", "collection", 500_000, 128, 2048, 150,
             "powerlaw", 1.05, tables=12, group="l2"),
    Workload("collection 12 x 500K x 128, B2048 L1-299 ranked1.05", "collection", 500_000, 128, 2048, 150,
             "ranked", 1.05, tables=12, group="l2"),
]
PROVIDERS = ("embfuse", "embfuse resident", "embfuse resident, reset", "embfuse-off", "fbgemm", "fbgemm-none")
# measured beside them, to split the gain: the same rewritten ids and copy, read without a window
DIAGNOSTICS = ("resident, no window",)
BACK_TO_BACK = ("embfuse back-to-back", "embfuse resident back-to-back")
GPU = ("embfuse", "embfuse resident", "fbgemm")  # providers whose GPU time is reported too


def _rows(w: Workload) -> list[int]:
    return table_rows(w) if w.tables == 26 else [w.rows] * w.tables


def _module(w: Workload, device, pin: bool, bounds_check: str = "deferred"):
    """One table: embfuse.nn.EmbeddingBag (fed (B, L) ids); more: an EmbeddingBagCollection."""
    if w.tables == 1:
        return embfuse.nn.EmbeddingBag(w.rows, w.dim, mode="sum", device=device, bounds_check=bounds_check,
                                       pin_hot_rows_in_l2=pin, l2_refresh=2**62)
    return embfuse.EmbeddingBagCollection(
        [embfuse.EmbeddingBagConfig(r, w.dim, f"t{i}", feature_names=[f"f{i}"]) for i, r in enumerate(_rows(w))],
        device=device, bounds_check=bounds_check, pin_hot_rows_in_l2=pin, l2_refresh=2**62)


def _lookup(w: Workload, m, kjt):
    if w.tables == 1:
        ids = kjt.values().view(w.batch, w.hotness)
        return lambda: m(ids)
    return lambda: m(kjt).values()


def _batch(w: Workload, device, seed: int) -> embfuse.KeyedJaggedTensor:
    """make_batch's batch; one table: L ids in every bag (fixed hotness, as the grid)."""
    if w.tables > 1:
        return make_batch(w, device, seed, rows=_rows(w))
    g = torch.Generator(device=device).manual_seed(seed)
    values = generate_ids(w, w.batch * w.hotness, device, g)
    return embfuse.KeyedJaggedTensor(["f0"], values, lengths=torch.full((w.batch,), w.hotness, device=device),
                                     stride=w.batch, length_per_key=[values.numel()])


def all_in_l2_us(w: Workload, kjt, device) -> float:
    """The lookup of `kjt`'s bags with every id folded into a 16 MB table (module docstring)."""
    from triton.testing import do_bench

    rows = (16 << 20) // (w.dim * 4)
    table = torch.randn(rows, w.dim, device=device)
    ids = kjt.values() % rows
    offsets = kjt.offsets()
    return do_bench(lambda: embfuse.embedding_bag(ids, table, offsets, mode="sum", include_last_offset=True,
                                                  bounds_check="off"), warmup=5, rep=200, return_mode="median") * 1e3


def measure(device="cuda", workloads=WORKLOADS, progress=lambda what: None) -> dict:
    from triton.testing import do_bench

    from embfuse.ops import l2

    bandwidth = copy_bandwidth(device)
    result = {"meta": {**metadata(device, bandwidth),
                       "persisting": l2.support(device).__dict__}, "rows": []}
    for w in workloads:
        progress(w.name)
        l2.reset()  # (the last workload's persisting lines would crowd the all-in-L2 bound)
        kjt, earlier = _batch(w, device, 0), _batch(w, device, 1)
        starts = torch.tensor([0] + _rows(w), device=device).cumsum(0)
        lengths = torch.tensor(kjt.length_per_key(), device=device)
        global_rows = torch.repeat_interleave(starts[:-1], lengths) + kjt.values()
        distinct = int(torch.unique(global_rows).numel())
        n = kjt.values().numel()
        row_bytes = w.dim * 4
        dram = distinct * row_bytes + w.batch * w.dim * w.tables * 4 + n * 8 + kjt.lengths().numel() * 8
        row = {"workload": w.name, "lookups": n, "distinct_rows": distinct,
               "dram_bound_us": dram / bandwidth * 1e6, "all_in_l2_us": all_in_l2_us(w, kjt, device)}
        ref = None
        for name in PROVIDERS + DIAGNOSTICS:
            def run(cell, name=name):
                nonlocal ref
                # (no provider inherits the persisting lines another left: they would serve its reads
                # where it reuses the freed addresses, or crowd the L2 where it does not)
                l2.reset()
                if name.startswith("fbgemm"):
                    tbe = fbgemm_tbe([(r, w.dim) for r in _rows(w)], checked=name == "fbgemm")

                    def fn():
                        return tbe(kjt.values(), kjt.offsets())
                else:
                    torch.manual_seed(0)  # the same table for every embfuse provider
                    m = _module(w, device, "resident" in name, "off" if name == "embfuse-off" else "deferred")
                    if name in DIAGNOSTICS:
                        m._residency.use_window = False
                    with torch.no_grad():
                        _lookup(w, m, earlier)()  # counts the earlier batch: the hot set
                    if name == "embfuse resident":
                        report = m.l2_residency
                        row.update(hot_rows=report.hot_rows, window_MB=report.window_bytes / 2**20,
                                   hit_counted=report.hit_rate, residency=report.reason or (
                                       "in place" if report.in_place else "copy"))
                        if report.active:
                            row["hit"] = float(m._residency.hot_set.serves(global_rows).double().mean())

                    lookup = _lookup(w, m, kjt)

                    def fn():
                        with torch.no_grad():
                            return lookup()
                out = fn()
                if name == "embfuse":
                    ref = out
                elif not name.startswith("fbgemm"):
                    assert torch.equal(out, ref), f"{name}: not the plain lookup's bits"
                reset = name.endswith("reset")

                def timed():
                    if reset:
                        l2.reset()
                    fn()
                cell["us"] = do_bench(timed, warmup=5, rep=200, return_mode="median") * 1e3
                if name in GPU:
                    row[f"{name} GPU"] = gpu_us(timed)
                if name in ("embfuse", "embfuse resident"):
                    row[f"{name} back-to-back"] = host_us(fn, 50)

            cell = {}
            attempt(cell, run)
            row[name] = cell.get("us") or cell.get("error")
        result["rows"].append(row)
        torch.cuda.empty_cache()
    return result


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# L2 residency: {m['gpu']}, torch {m['torch']}, triton {m['triton']}, fbgemm_gpu {m['fbgemm_gpu']}, "
             f"commit {m['commit']}, {m['date']}",
             f"copy bandwidth {m['copy_bandwidth_GBps']:.0f} GB/s, max "
             f"persisting L2 {m['persisting']['max_persisting_bytes'] / 2**20:.1f} MB; times in us", "",
             "| workload | " + " | ".join(PROVIDERS) + " | resident vs plain | resident vs FBGEMM | hit | window MB "
             "| DRAM bound | all in L2 | " + " | ".join(DIAGNOSTICS + BACK_TO_BACK) + " | "
             + " | ".join(f"{p} GPU" for p in GPU) + " | resident vs plain, GPU |",
             "|---" * (len(PROVIDERS) + len(DIAGNOSTICS) + len(BACK_TO_BACK) + len(GPU) + 8) + "|"]
    for r in result["rows"]:
        def f(v):
            return f"{v:.1f}" if isinstance(v, float) else str(v)

        def x(a, b):
            va, vb = r.get(a), r.get(b)
            return f"{vb / va:.2f}x" if isinstance(va, float) and isinstance(vb, float) else "-"
        lines.append(f"| {r['workload']} | " + " | ".join(f(r.get(p)) for p in PROVIDERS)
                     + f" | {x('embfuse resident', 'embfuse')} | {x('embfuse resident', 'fbgemm')} | "
                     + (f"{r['hit']:.2f} ({r.get('residency', '-')})" if "hit" in r else r.get("residency", "-"))
                     + f" | {r.get('window_MB', 0):.1f} | {r['dram_bound_us']:.1f} | {r['all_in_l2_us']:.1f} | "
                     + " | ".join(f(r.get(p)) for p in DIAGNOSTICS + BACK_TO_BACK) + " | "
                     + " | ".join(f(r.get(f"{p} GPU", "-")) for p in GPU)
                     + f" | {x('embfuse resident GPU', 'embfuse GPU')} |")
    return "\n".join(lines)


def write(result: dict, out: Path) -> Path:
    return write_result(result, out, "bench-l2", markdown)

