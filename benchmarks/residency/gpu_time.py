"""The GPU time alone of one-table lookups with and without `pin_hot_rows_in_l2`: the host's
enqueue is hidden behind a sleep on the GPU, so host-bound rows of `embfuse bench --l2` read
what the GPU spends.

One table of 10M rows, B65536 x L64, D32 and D128; power-law ids hashed over the table (the
copy) and numbered by frequency (read in place). Modules: `off`, the default, resident, and
resident without its window (the same copy or run, no window). The hot set is counted from
another batch. Medians of CUDA-event timings, the L2 flushed before each call, back to back
(20 calls between two events, no flush), and the call captured into a CUDA graph and replayed
(L2 flushed; a lookup with a copy is captured as the plain one, a run read in place keeps its
window). Each module is timed from an L2 with no persisting line (l2.reset()).
Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/residency/gpu_time.py
"""

import statistics

import torch

import embfuse
from embfuse.bench.workloads import Workload, generate_ids
from embfuse.ops import l2


def gpu_us(fn, flush, flushed=True, calls=1, reps=30) -> float:
    times = []
    for i in range(reps + 3):
        if flushed:
            flush.zero_()
        torch.cuda._sleep(calls * 2_000_000)  # the GPU waits while the host enqueues the calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def captured(fn):
    """`fn` captured into a CUDA graph (after a warm-up call on a side stream): its replay."""
    stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        fn()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(D: int, dist: str, flush, dev="cuda") -> str:
    w = Workload("x", "bag", 10_000_000, D, 65536, 64, dist, 1.05)
    ids, earlier = (generate_ids(w, w.batch * w.hotness, dev, torch.Generator(device=dev).manual_seed(seed))
                    .view(w.batch, w.hotness) for seed in (0, 1))
    torch.manual_seed(0)
    plain = embfuse.nn.EmbeddingBag(w.rows, D, mode="sum", device=dev)
    modules = {"off": embfuse.nn.EmbeddingBag(w.rows, D, mode="sum", device=dev, bounds_check="off"),
               "default": plain}
    for name in ("resident", "resident without window"):
        m = embfuse.nn.EmbeddingBag(w.rows, D, mode="sum", device=dev, pin_hot_rows_in_l2=True, l2_refresh=2**62)
        m._residency.use_window = name == "resident"
        modules[name] = m
    for m in modules.values():
        m.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for name in ("resident", "resident without window"):
            modules[name](earlier)  # counts the hot set
            assert torch.equal(modules[name](ids), plain(ids))
        report = modules["resident"].l2_residency
        times = {}
        for k, m in modules.items():
            l2.reset()  # (persisting lines outlive the flush: no module inherits another's)
            times[k] = (gpu_us(lambda: m(ids), flush), gpu_us(lambda: m(ids), flush, False, 20),
                        gpu_us(captured(lambda: m(ids)), flush))
    mode = ("in place" if report.in_place else "copy") if report.active else report.reason
    return (f"D{D} {dist} ({mode}, hit {report.hit_rate:.2f}, window {report.window_bytes / 2**20:.1f} MB) us, "
            "flushed: " + ", ".join(f"{k} {v[0]:.1f}" for k, v in times.items())
            + " | back to back: " + ", ".join(f"{k} {v[1]:.1f}" for k, v in times.items())
            + " | replayed: " + ", ".join(f"{k} {v[2]:.1f}" for k, v in times.items()))


def main():
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    print(torch.cuda.get_device_name())
    for D in (32, 128):
        for dist in ("ranked", "powerlaw"):
            print(measure(D, dist, flush), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
