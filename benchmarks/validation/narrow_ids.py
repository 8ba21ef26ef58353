"""The check writing int64 ids as int32 for the lookup (tuning.NARROW_IDS), A/B in one process:
`off` (ids as given), the default with the narrowed ids, the default without (NARROW_IDS out of
reach). Each cell: GPU time (the call's kernels, profiler, L2 cleared before each call) and
do_bench's median (host time shows there), the middle of three alternating rounds. Rows: forward
lookups without gradient, with `off` on int32 ids beside them (what the pooling alone gains): one
table over widths and dtypes, and the 26-table Criteo-like collection (the keyed check).

    PYTHONPATH=src python3 benchmarks/validation/narrow_ids.py [table] [collection]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops import tuning

NEVER = 1 << 62
AT = tuning.NARROW_IDS
BATCHES = (2048, 4096, 8192, 16384)  # the collection rows


def kernel_times(f, calls=20):
    """{kernel name: its GPU time a call, us} (profiler), L2 cleared by other traffic before each call."""
    flush = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    f()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.bitwise_not_()
            f()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "bitwise_not" not in e.name:
            times[e.name[:30]] = times.get(e.name[:30], 0.0) + e.device_time_total / calls
    return times


def gpu_time(f, calls=20):
    """GPU time of a call, us: the sum of its kernels' times."""
    return sum(kernel_times(f, calls).values())


def timed(calls, rounds=3):
    """{variant: (GPU time, do_bench median)}, each the middle of `rounds` alternating rounds."""
    t = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t[k].append((gpu_time(f), do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3))
    return {k: tuple(sorted(x[i] for x in v)[len(v) // 2] for i in (0, 1)) for k, v in t.items()}


def with_narrow(at, f):
    def call():
        tuning.NARROW_IDS = at
        return f()
    return call


def row(name, calls):
    t = timed(calls)
    (og, ow) = t["off"]
    cells = " | ".join(f"{g:.1f} ({100 * (g / og - 1):+.1f}%) / {w:.1f}" for k, (g, w) in t.items() if k != "off")
    print(f"| {name} | {og:.1f} / {ow:.1f} | {cells} |", flush=True)


def forward_rows():
    for D, B, dist, dtype in [(128, 65536, "powerlaw", torch.float32), (32, 65536, "powerlaw", torch.float32),
                              (64, 65536, "powerlaw", torch.float32), (256, 65536, "powerlaw", torch.float32),
                              (128, 65536, "powerlaw", torch.bfloat16), (128, 16384, "powerlaw", torch.float32),
                              (128, 65536, "uniform", torch.float32)]:
        w = Workload("one table", "bag", 10_000_000, D, B, 64, dist, 1.05)
        table = torch.randn(w.rows, w.dim, device="cuda", dtype=dtype)
        x, _ = generate_batch(w, "cuda")
        x32 = x.int()
        f = lambda: embfuse.embedding_bag(x, table, mode="sum")
        calls = {"off": lambda: embfuse.embedding_bag(x, table, mode="sum", bounds_check="off"),
                 "off32": lambda: embfuse.embedding_bag(x32, table, mode="sum", bounds_check="off"),
                 "narrowed": with_narrow(-1, f), "as given": with_narrow(NEVER, f)}
        with torch.no_grad():
            row(f"forward {str(dtype)[6:]} D{D} B{B} L64 {dist}", calls)
        del table


def criteo(B):
    """The Criteo-like collection at batch B: (its batch, the batch with int32 ids, the collection
    with bounds_check="off", the default one)."""
    w = Workload("c", "collection", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26, group="collection")
    kjt = make_batch(w, "cuda")
    k32 = embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values().int(), lengths=kjt.lengths(), stride=B,
                                    length_per_key=kjt.length_per_key())
    return kjt, k32, make_collection(w, "cuda", bounds_check="off"), make_collection(w, "cuda")


def collection_rows():
    for B in BATCHES:
        kjt, k32, off, ebc = criteo(B)
        f = lambda: ebc(kjt).values()
        calls = {"off": lambda: off(kjt).values(), "off32": lambda: off(k32).values(),
                 "narrowed": with_narrow(-1, f), "as given": with_narrow(NEVER, f)}
        with torch.no_grad():
            row(f"collection 26 x 128 B{B} L1-99 powerlaw ({kjt.values().numel() / 1e6:.1f}M ids)", calls)
        del off, ebc


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us; NARROW_IDS in the tree: {AT}")
    print("GPU time (over off) / do_bench median")
    print("| row | off | off, int32 ids | default, narrowed | default, as given |")
    print("|---|---|---|---|---|")
    parts = sys.argv[1:] or ["table", "collection"]
    if "table" in parts:
        forward_rows()
    if "collection" in parts:
        collection_rows()
    tuning.NARROW_IDS = AT
    embfuse.check_errors()
