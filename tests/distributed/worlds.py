"""Run a function on every rank of a fresh process group (gloo on CPUs, free port, spawn)."""

import gc
import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


# the hang guard of a torchrun subprocess: the distributed bench's run took about 95 s alone on
# a 16-core GPU host and 280-300 s (past the former 300 s guard once) beside 15 other pytest
# workers there (benchmarks/NOTES.md, session 39)
TORCHRUN_TIMEOUT = 540


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# how long a rank waits for the others to join: `timeout` is the collectives' (a test of a rank that
# leaves sets it to 5 s), and a rank spawned beside eleven busy pytest workers on the GPU host took
# longer than that to connect (benchmarks/NOTES.md, session 65)
RENDEZVOUS_TIMEOUT = 120


def _entry(rank, world, port, fn, args, timeout):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        fn(rank, world, *args)
    finally:
        # collect torch.compile's leftover cycles (fake tensors and graphs) while the interpreter
        # and the group are alive: left to interpreter exit, they aborted one run in about seven
        # of the gloo functional-collectives test (terminate called without an active exception)
        gc.collect()
        dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 120):
    """fn(rank, world, *args) on `world` processes; a failure on any rank fails the call with
    that rank's traceback."""
    mp.spawn(_entry, args=(world, free_port(), fn, args, timeout), nprocs=world, join=True)
