"""The all-to-all's own speed on this launch's GPUs, at the sizes of `embfuse bench --distributed`'s
step (the ids' exchange, the pooled rows' and their gradients'): the floor under the step's
communication. `PYTHONPATH=src torchrun --nproc_per_node=N benchmarks/distributed/a2a_bandwidth.py`
prints, per send-buffer size a rank, the median of 20 all_to_all_single calls (CUDA events, all
ranks started together) and the bytes that leave each rank over that time (NOTES, session 32)."""

import os
import statistics

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
sizes_mb = [int(s) for s in os.environ.get("SIZES_MB", "34,109,218").split(",")]
for mb in sizes_mb:
    n = mb * 2**20 // 4 // world * world
    send, recv = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    times = []
    for i in range(25):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_to_all_single(recv, send)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) * 1e3)
    us = statistics.median(times)
    leaving = n * 4 * (world - 1) / world
    if rank == 0:
        print(f"world {world}: {n * 4 / 1e6:.0f} MB a rank: {us:.0f} us, "
              f"{leaving / us / 1e3:.0f} GB/s leaving each rank", flush=True)
dist.destroy_process_group()
