"""The launch floor under the B2048 calls, on this host: one table D128 B2048 L64
(`embfuse.embedding_bag` with 1-D ids and torch's bag starts) and the 26-table Criteo-like
collection's forward, default and `off`. Each Triton launch a call makes is recorded, then
replayed three ways: through `_DirectLauncher` (what embfuse does); through a leaner copy of it
(the device and stream read by torch's C calls instead of Triton's driver); and Triton's compiled
launcher alone, everything precomputed (the floor of a launch from Python). Beside them: the
whole calls, torch's, one aten launch and one torch.empty. Host time a call (host_default_b2048's
per_call: no synchronisation inside the loop), seven interleaved rounds of 300 calls; min and
median.

    PYTHONPATH=src python3 benchmarks/host/launch_floor.py
"""

import statistics
from itertools import repeat

import torch
from host_default_b2048 import per_call  # (this folder: the script's own)

import embfuse
from embfuse import _triton
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops.bags import POOLINGS
from embfuse.ops.embedding_bag import embedding_bag_forward

DIRECT = _triton._DirectLauncher._launch


def _key(launcher, device, args, kwargs) -> tuple:
    """_DirectLauncher's cache key for these arguments."""
    n = len(args)
    backend = launcher.kernel.device_caches[device][3]
    return (device, *kwargs.items(), *map(_triton.native_specialize_impl, repeat(backend, n), args, repeat(False, n),
                                          repeat(True, n), repeat(True, n)))


def _lean(launcher, grid, *args, **kwargs):
    """_DirectLauncher._launch with the device and stream read by torch's C calls."""
    device = torch._C._cuda_getDevice()
    run, function, metadata = launcher.compiled[_key(launcher, device, args, kwargs)]
    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None,
        *args, *map(kwargs.__getitem__, launcher.constexpr_names))


def launches(tag: str, call) -> dict:
    """Each launch `call` makes, as three calls: direct, lean and the compiled launcher alone."""
    seen = []

    def record(launcher, grid, *args, **kwargs):
        seen.append((launcher, grid, args, kwargs))
        return DIRECT(launcher, grid, *args, **kwargs)

    _triton._DirectLauncher._launch = record
    try:
        call()
        torch.cuda.synchronize()
    finally:
        _triton._DirectLauncher._launch = DIRECT
    out = {}
    device = torch._C._cuda_getDevice()
    for i, (launcher, grid, args, kwargs) in enumerate(seen):
        out[f"{tag} launch{i} direct ({len(args)} args, {len(kwargs)} kw)"] = (
            lambda a=(launcher, grid, *args), k=kwargs: DIRECT(*a, **k))
        out[f"{tag} launch{i} lean"] = lambda a=(launcher, grid, *args), k=kwargs: _lean(*a, **k)
        run, function, metadata = launcher.compiled[_key(launcher, device, args, kwargs)]
        head = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None)
        tail = (*args, *map(kwargs.__getitem__, launcher.constexpr_names))
        out[f"{tag} launch{i} compiled run only"] = lambda r=run, a=head + tail: r(*a)
    return out


def main() -> None:
    torch.set_grad_enabled(False)
    ids, _ = generate_batch(Workload("one", "bag", 10_000_000, 128, 2048, 64, "powerlaw", 1.05), "cuda")
    table = torch.randn(10_000_000, 128, device="cuda")
    flat = ids.reshape(-1).contiguous()
    starts = torch.arange(0, flat.numel(), 64, device="cuda", dtype=ids.dtype)
    x = torch.empty(1, device="cuda")
    calls = {"aten x.add_(1)": lambda: x.add_(1),
             "torch.empty(B,D)": lambda: torch.empty(2048, 128, device="cuda"),
             "F.embedding_bag 1-D": lambda: torch.nn.functional.embedding_bag(flat, table, starts),
             "embedding_bag 1-D off": lambda: embfuse.embedding_bag(flat, table, starts, bounds_check="off"),
             "embedding_bag 1-D default": lambda: embfuse.embedding_bag(flat, table, starts),
             "embedding_bag_forward off": lambda: embedding_bag_forward(
                 table, flat, starts, None, POOLINGS["mean"], -1, with_max_ids=False, open_end="starts")}
    for f in list(calls.values()):
        f()
    calls.update(launches("one off", calls["embedding_bag 1-D off"]))
    calls.update(launches("one default", calls["embedding_bag 1-D default"]))
    w = Workload("c", "collection", 10_000_000, 128, 2048, 50, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    mods = {m: make_collection(w, "cuda", None, bounds_check=m) for m in ("deferred", "off")}
    calls["collection default"] = lambda: mods["deferred"](kjt).values()
    calls["collection off"] = lambda: mods["off"](kjt).values()
    calls["collection default"]()
    calls.update(launches("coll default", calls["collection default"]))
    res = {k: [] for k in calls}
    for _ in range(7):
        for k, f in calls.items():
            res[k].append(per_call(f, 300)[0])
    for k, v in res.items():
        print(f"{k:52s} min %6.1f  median %6.1f  us/call" % (min(v), statistics.median(v)), flush=True)


if __name__ == "__main__":
    main()
