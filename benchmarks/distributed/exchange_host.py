"""The host time of the sharded step's exchange, piece by piece, on every rank of a torchrun
launch (`embfuse bench --distributed`'s workload): route, send_buffer, the lookup's own work and
the local collection's forward, each rank's synchronised step and a loop of 20 steps without a
sync. The host time after the header's read is GPU idle time (NOTES, session 36).

`PYTHONPATH=src:. torchrun --nproc_per_node=N benchmarks/distributed/exchange_host.py` (`BATCH`,
`ROWS`: the batch a rank and the rows cap). With `BASE=<another tree's src>` it also runs that
tree's route, send_buffer and _lookup, in alternating rounds in the same process, and checks
that both give the same output."""

import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import embfuse.distributed as ed
from embfuse.bench.distributed import _init, collection, rank_batches, workload
from embfuse.distributed import routing, sharded


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _methods(r, s):
    return r.Routing.route, r.Routing.send_buffer, s.ShardedEmbeddingBagCollection._lookup


variants = {"this tree": _methods(routing, sharded)}
if os.environ.get("BASE"):
    base = os.environ["BASE"] + "/embfuse/distributed/"
    variants["BASE"] = _methods(_load("base_routing", base + "routing.py"), _load("base_sharded", base + "sharded.py"))

dev, _ = _init("auto")
rank, world = dist.get_rank(), dist.get_world_size()
w = workload(int(os.environ.get("BATCH", 16384)), int(os.environ.get("ROWS", 1_000_000)))
model = ed.shard(collection(w, dev), None)
H = model.routing.header_width  # (trees before e5251ac build the header with header_pos)
model.routing.header_pos = torch.tensor([r * H + routing.COUNTS + e for r in range(world)
                                         for e in range(len(model.entries[r]))], device=dev)
batches = rank_batches(w, dev)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
spent: dict[str, float] = {}


def timed(obj, name, label, call):
    def run(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
        return out
    object.__setattr__(obj, name, run)


timed(model.routing, "route", "route", lambda *a: type(model.routing).route(model.routing, *a))
timed(model.routing, "send_buffer", "send_buffer", lambda *a: type(model.routing).send_buffer(model.routing, *a))
timed(model, "_lookup", "lookup", lambda *a: type(model)._lookup(model, *a))
timed(model.local, "forward", "local forward", model.local.forward)


def use(name):
    routing.Routing.route, routing.Routing.send_buffer, sharded.ShardedEmbeddingBagCollection._lookup = variants[name]


def steps(n, each_synced):
    times = []
    for i in range(n):
        if each_synced:
            sync()
            dist.barrier()
            sync()
        start = time.perf_counter()
        model(batches[i % 4]).values().sum().backward()
        if each_synced:
            sync()
            times.append(time.perf_counter() - start)
    return times


outputs = {}
for name in variants:  # before any step changes the tables
    use(name)
    with torch.no_grad():
        outputs[name] = model(batches[0]).values().clone()
figures: dict[tuple, list] = {}
for round_ in range(7):  # round 0 warms up
    for name in variants:
        use(name)
        steps(3, True)
        spent.clear()
        step = statistics.median(steps(20, True))
        sync()
        dist.barrier()
        start = time.perf_counter()
        steps(20, False)
        sync()
        loop = (time.perf_counter() - start) / 20
        if round_:
            for label, seconds in [("step, synced", step), ("loop of 20, a step", loop)] + [
                    (k, v / 20) for k, v in spent.items()]:
                figures.setdefault((label, name), []).append(seconds * 1e6)
lines = [f"rank {rank}, world {world}: both trees give the same output: "
         f"{all(torch.equal(o, outputs['this tree']) for o in outputs.values())}"]
for (label, name), us in figures.items():
    lines.append(f"rank {rank}, world {world}, {name:9s} {label:20s} us: median {statistics.median(us):6.0f}, "
                 f"min {min(us):6.0f}, max {max(us):6.0f} (6 rounds)")
every = [None] * world
dist.all_gather_object(every, "\n".join(lines))
if rank == 0:
    print("\n".join(every), flush=True)
dist.destroy_process_group()
