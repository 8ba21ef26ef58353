"""Where the sharded training step's time goes on each rank (`embfuse bench --distributed`'s
workload): input exchange request and wait, lookup and send, output wait, backward, each timed
with a device sync after it, median of 20 steps.
`PYTHONPATH=src torchrun --nproc_per_node=N benchmarks/distributed/phases.py` (NOTES, session 22)."""

import os
import statistics
import time

import torch
import torch.distributed as dist

import embfuse.distributed as ed
from embfuse.bench.distributed import _init, collection, rank_batches, workload

dev, _ = _init("auto")
rank, world = dist.get_rank(), dist.get_world_size()
w = workload(int(os.environ.get("BATCH", 16384)))
model = ed.shard(collection(w, dev), None)
batches = rank_batches(w, dev)


def marks(step):
    """Host times after each phase of `step`, the device synced at each."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    t = [time.perf_counter()]

    def mark():
        torch.cuda.synchronize()
        t.append(time.perf_counter())

    incoming = model.input_dist(batches[step % 4])
    mark()
    incoming.wait()
    mark()
    sent = model.lookup_and_send(incoming)  # (its wait is a no-op now)
    mark()
    out = model.output_wait(sent)
    mark()
    out.values().sum().backward()
    mark()
    return t


phases = {k: [] for k in ("input_dist", "input_wait", "lookup_send", "output_wait", "backward", "total")}
for i in range(25):
    t = marks(i)
    if i >= 5:
        for k, d in zip(phases, [b - a for a, b in zip(t, t[1:])] + [t[-1] - t[0]]):
            phases[k].append(d * 1e6)
mine = {k: round(statistics.median(v)) for k, v in phases.items()}
every = [None] * world
dist.all_gather_object(every, mine)
if rank == 0:
    print(f"world {world}: phases (us, a sync after each, median of 20):")
    for r, m in enumerate(every):
        print(f"  rank {r}: {m}", flush=True)

dist.destroy_process_group()
