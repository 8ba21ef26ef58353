"""Measure every workload with every provider in one run, against the roofline of the card.

roofline time = (distinct rows x D x weight bytes + output bytes + index bytes) / copy bandwidth,
with the copy bandwidth measured in the same run (device-to-device copy, bytes read + written).
Rows rate (cuEmbed's metric) = B x L x D x weight bytes / time; it can pass the bandwidth when
hot rows hit in cache. Times are medians of CUDA-event timings of one call, L2 flushed between
calls (triton.testing.do_bench); host overhead shows where the GPU waits for the host.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import embfuse
from embfuse.bench.providers import PROVIDERS, attempt
from embfuse.bench.workloads import WORKLOADS_VERSION, Workload, generate_batch


def copy_bandwidth(device, nbytes: int = 1 << 31) -> float:
    """Bytes per second of a large device-to-device copy (read + written)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def count_bytes(w: Workload, ids: torch.Tensor, offsets) -> dict:
    elt = torch.empty(0, dtype=w.torch_dtype).element_size()
    distinct = int(torch.unique(ids).numel())
    looked_up = ids.numel()
    out_rows = ids.numel() if w.kind == "embedding" else w.batch
    index_bytes = ids.numel() * ids.element_size()
    if offsets is not None:
        index_bytes += offsets.numel() * offsets.element_size()
    return {
        "distinct_rows": distinct,
        "ids": looked_up,
        "min_bytes": w.tables * (distinct * w.dim * elt + out_rows * w.dim * elt + index_bytes),
        "rows_bytes": w.tables * looked_up * w.dim * elt,
    }


def _close(a, b, dtype) -> bool:
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    return all(torch.allclose(x.float(), y.float(), rtol=tol, atol=tol * 8) for x, y in zip(a, b))


# rows this short may read the host's time, not the GPU's (do_bench's L2 flush before each call
# hides only a part of it): they report the host's time a call and the GPU's own beside (NOTES:
# session 27; session 59: on an H200 a default D32 B65536 lookup, 75 us of GPU time, read 215)
HOST_ROWS_US = 2000


def host_us(fn, calls: int = 200) -> float:
    """Wall-clock per call over back-to-back calls: host-bound when the GPU work is short."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def gpu_us(fn, calls: int = 20) -> float:
    """GPU time of one call of `fn`: the summed duration of its GPU work (kernels, copies,
    fills; the profiler's) over `calls` calls, each after an L2 flush as in do_bench. Gaps
    between kernels (the host's time) are not counted."""
    return sum(gpu_kernels(fn, calls).values())


def gpu_kernels(fn, calls: int = 20) -> dict[str, float]:
    """gpu_us by the name of each kernel (or copy, or fill): its GPU time per call of `fn`. The
    flush (a bitwise_not over 256 MB, an op no lookup uses) is told apart by its kernel's name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.bitwise_not(flush, out=flush)
            fn()
        torch.cuda.synchronize()
    work = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    flushes = [e for e in work if "bitwise_not" in e.name]
    assert len(flushes) == calls, f"{len(flushes)} flush kernels profiled for {calls} calls"
    per = {}
    for e in work:
        if "bitwise_not" not in e.name:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    return per


def _graph_us(fn) -> float | None:
    """Median time of replaying `fn` captured in a CUDA graph, or None if it cannot be captured."""
    from triton.testing import do_bench

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception:  # noqa: BLE001 - a provider that cannot be captured is reported as such
        return None
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e3


def measure(w: Workload, providers: list[str], device) -> list[dict]:
    from triton.testing import do_bench

    if w.kind in ("train", "backward"):
        from embfuse.bench.train import measure_train

        return measure_train(w, device)
    if w.kind.startswith("collection"):
        from embfuse.bench.collection import measure_collection

        return measure_collection(w, device)

    tables = [torch.randn(w.rows, w.dim, device=device).to(w.torch_dtype) for _ in range(w.tables)]
    ids, offsets = generate_batch(w, device)
    counts = count_bytes(w, ids, offsets)
    rows, first = [], []
    for name in providers:
        row = {"workload": w.name, "provider": name, **counts}

        @torch.no_grad()
        def measure(row, name=name):
            fn = PROVIDERS[name](w, tables, ids, offsets)
            out = fn()
            if not first:
                first.append(out)
            row["matches_first"] = _close(out, first[0], w.torch_dtype)
            row["us"] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            if w.group == "latency" or row["us"] < HOST_ROWS_US:
                row["host_us_per_call"], row["gpu_us"] = host_us(fn), gpu_us(fn)
            if w.group == "latency":
                from embfuse.bench.collection import launch_counts

                row["launches_per_call"] = launch_counts(fn)["kernels_per_step"]
                if name in ("torch", "embfuse"):
                    row["graph_us"] = _graph_us(fn)

        attempt(row, measure)
        rows.append(row)
    tables = ids = offsets = first = None  # (frees the GPU memory before empty_cache; the closures share these)
    torch.cuda.empty_cache()
    return rows


def commit(where: Path = Path(__file__).parent) -> str:
    """The commit measured: $EMBFUSE_COMMIT (a copy of the tree has no .git), else git's HEAD,
    with "+dirty" where tracked files differ from it: a local change, or a copy of the tree whose
    .git is older than its files (session 59: a device's copy reported the session's first HEAD)."""
    found = os.environ.get("EMBFUSE_COMMIT")
    if found:
        return found

    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(head) and bool(git("status", "--porcelain", "--untracked-files=no"))
    except OSError:
        return "unknown"
    return head + "+dirty" * dirty if head else "unknown"


def tags(device) -> dict:
    """What every committed result names beside its figures: the GPU (None off the GPU),
    versions, commit, date."""
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "embfuse": embfuse.__version__, "commit": commit(),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def metadata(device, bandwidth: float) -> dict:
    import triton

    try:
        import fbgemm_gpu

        fbgemm = getattr(fbgemm_gpu, "__version__", "unknown")
    except ImportError:
        fbgemm = None
    props = torch.cuda.get_device_properties(device)
    return {
        **tags(device), "sms": props.multi_processor_count,
        "triton": triton.__version__, "fbgemm_gpu": fbgemm, "copy_bandwidth_GBps": bandwidth / 1e9,
        "workloads_version": WORKLOADS_VERSION,
    }


def derive(rows: list[dict], bandwidth: float) -> None:
    """Add roofline, rates and speedups to measured rows (in place)."""
    by_workload: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], {})[r["provider"]] = r
        if "us" not in r:
            continue
        r["roofline_us"] = r["min_bytes"] / bandwidth * 1e6
        r["pct_roofline"] = 100 * r["roofline_us"] / r["us"]
        r["GBps"] = r["min_bytes"] / (r["us"] * 1e-6) / 1e9
        r["rows_rate_GBps"] = r["rows_bytes"] / (r["us"] * 1e-6) / 1e9
    for group in by_workload.values():
        for r in group.values():
            # "embfuse-ebc rowwise-adagrad" is compared with "fbgemm rowwise-adagrad" where there is one
            suffix = r["provider"].partition(" ")[2]
            for peer in ("torch", "fbgemm"):
                p = group.get(f"{peer} {suffix}") or group.get(peer)
                if "us" in r and p is not None and "us" in p:
                    r[f"speedup_vs_{peer}"] = p["us"] / r["us"]


def run(workloads: list[Workload], providers: list[str], out_dir: Path, progress=None) -> dict:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    if workloads and workloads[0].kind in ("bag", "embedding"):
        measure(workloads[0], providers, device)  # warm-up: clocks, allocator, compile caches
    rows = []
    for w in workloads:
        if progress is not None:
            progress(w)
        rows += measure(w, providers, device)
    derive(rows, bandwidth)
    result = {"meta": metadata(device, bandwidth), "workloads": [w.as_dict() for w in workloads], "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    return result
