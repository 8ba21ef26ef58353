"""The sharded training step, measured on every rank of a torchrun launch (or a world of one).

`torchrun --nproc_per_node=N --no-python embfuse bench --distributed`: each rank trains the
26-table Criteo-like collection (bench/collection.py's tables and batches, power-law ids, a fixed
batch per rank: weak scaling) sharded by the default plan, fused row-wise Adagrad. Reported per
rank: the step's median time, examples/s of this rank, and the share of the step the
collectives held it (CommTimer: CUDA events on the GPU, the host clock on gloo). NCCL on GPUs,
gloo on CPUs.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import embfuse
import embfuse.distributed as ed
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.runner import commit
from embfuse.bench.workloads import Workload
from embfuse.optim import RowWiseAdagrad


def _init(device: str) -> tuple[torch.device, bool]:
    """Join torchrun's process group (or make a world of one); the device of this rank."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    made = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        made = True
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), made


COMM_DTYPES = {"table": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def workload(batch: int, rows: int = 1_000_000, dim: int = 128, hotness: int = 20) -> Workload:
    """The sharded step's workload: 26 Criteo-like tables (rows capped at `rows`), power-law ids,
    `batch` samples a rank."""
    return Workload("criteo-sharded", "collection-train-rowwise", rows, dim, batch, hotness, "powerlaw", 1.05, "csr",
                    tables=26)


def collection(w: Workload, device) -> embfuse.EmbeddingBagCollection:
    """The workload's tables, table i read by feature f{i}, fused row-wise Adagrad (seeded)."""
    torch.manual_seed(0)
    return embfuse.EmbeddingBagCollection(
        [embfuse.EmbeddingBagConfig(r, w.dim, f"t{i}", feature_names=[f"f{i}"]) for i, r in enumerate(table_rows(w))],
        device=device, optimizer=RowWiseAdagrad(lr=0.01))


def rank_batches(w: Workload, device) -> list:
    """Four batches of this rank's own (seeded by the rank)."""
    return [make_batch(w, device, seed=1000 * dist.get_rank() + i) for i in range(4)]


def measure(batch: int, rows: int, dim: int, hotness: int, steps: int, warmup: int, device: str = "auto",
            plan=None, comm_dtype: str = "table", compiled: bool = False, profile: Path | None = None) -> dict:
    """Time the sharded step on every rank; returns every rank's figures (on every rank).
    `comm_dtype`: a COMM_DTYPES key, the dtype the pooled rows cross ranks in (shard's).
    `compiled`: also the overlap pass under torch.compile, three ways (_loops).
    `profile`: a folder; each rank also profiles the plain loop and the overlap pass's loop
    (PROFILED), writes their traces there and reports overlap_summary of each."""
    dev, made = _init(device)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        w = workload(batch, rows, dim, hotness)
        ebc = collection(w, dev)
        model = ed.shard(ebc, plan, comm_dtype=COMM_DTYPES[comm_dtype])
        batches = rank_batches(w, dev)
        timer = ed.CommTimer()
        model.comm_timer = timer
        times, comm = time_steps(model, batches, steps, warmup, dev, timer)
        plain = None
        if world == 1:  # the sharding layer's own cost: the same step unsharded, in the same run
            plain = statistics.median(time_steps(ebc, batches, steps, warmup, dev)[0])
        del ebc
        model.comm_timer = None
        runs = _runs(model, batches, steps, dev, compiled)
        loops = _loops(runs, steps, dev)
        if profile is not None:
            loops["profile"] = {name: _profile(runs[name], dev, profile / f"{name}-rank{rank}.json")
                                for name in PROFILED}
        step = statistics.median(times)
        mine = {"rank": rank, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "step_us": step * 1e6, "examples_per_s": batch / step, "comm_share": statistics.median(comm) / step,
                "unsharded_step_us": None if plain is None else plain * 1e6, **loops}
        every = [None] * world
        dist.all_gather_object(every, mine)
        return {"world_size": world, "backend": dist.get_backend(), "batch_per_rank": batch, "rows": rows,
                "comm_dtype": comm_dtype,
                "dim": dim, "hotness": hotness, "steps": steps, "plan": str(model.plan), "ranks": every,
                "examples_per_s_total": sum(r["examples_per_s"] for r in every),
                "torch": torch.__version__, "commit": commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    finally:
        if made:
            dist.destroy_process_group()


def _wall(run, dev) -> float:
    """Seconds `run()` takes, the device idle and every rank started together before it, and the
    device finished after it."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    run()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_steps(model, batches, steps, warmup, dev, timer=None):
    """Each step's wall time (forward, backward, fused update; synchronised, all ranks started
    together) and the time its collectives took."""
    times, comm = [], []
    for i in range(warmup + steps):
        if timer is not None:
            timer.reset()
        took = _wall(lambda: model(batches[i % len(batches)]).values().sum().backward(), dev)
        if i >= warmup:
            times.append(took)
            comm.append(sum(timer.seconds().values()) if timer is not None else 0.0)
    return times, comm


ROUNDS = 5


class _Model(torch.nn.Module):
    """The step's model: the sharded lookup written first, then a dense bottom MLP that does not
    need it (13 features -> 512 -> 256 -> 128, DLRM's bottom), the loss reading both."""

    def __init__(self, sharded, device):
        super().__init__()
        self.sharded = sharded
        self.bottom = torch.nn.Sequential(torch.nn.Linear(13, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                          torch.nn.ReLU(), torch.nn.Linear(256, 128)).to(device)

    def forward(self, b):
        pooled = self.sharded(b["sparse_features"]).values()
        dense = self.bottom(b["dense"])
        return pooled.sum() + dense.sum()


def _runs(model, batches, steps, dev, compiled: bool = False) -> dict:
    """Five training loops of `steps` steps each, as closures by name: the ideal with the
    exchanges removed (each rank's own lookups of batches exchanged beforehand, and the MLP); the
    plain loop on batches already on the device; the same through embfuse.fx.overlap_collectives
    (requests early, waits late: the bottom MLP runs while the collectives are in flight); the
    plain loop on batches from pinned host memory (a copy each step); TrainPipeline on the same
    host batches (the next batches' copy and exchange beside this one's compute). `compiled`:
    three more, the overlap pass under torch.compile with its stages eager, with the pooled rows'
    all-to-all a functional collective (Inductor's default places its wait at once), and the same
    with Inductor's reordering on (sink_waits: the wait after the ops that do not need it)."""
    from embfuse.fx import overlap_collectives

    g = torch.Generator().manual_seed(dist.get_rank())
    device_batches = [{"dense": torch.randn(b.stride(), 13, generator=g).to(dev), "sparse_features": b}
                      for b in batches]
    pin = dev.type == "cuda"
    host = [{"dense": b["dense"].cpu().pin_memory() if pin else b["dense"].cpu(),
             "sparse_features": b["sparse_features"].to("cpu").pin_memory() if pin else b["sparse_features"].to("cpu")}
            for b in device_batches]
    step_model = _Model(model, dev)
    overlapped = overlap_collectives(step_model)
    pipe = ed.TrainPipeline(step_model, None, dev)

    def plain(m, source, move):
        for i in range(steps):
            m(move(source[i % len(source)])).backward()

    def piped():
        it = (host[i % len(host)] for i in range(steps))
        for _ in range(steps):
            pipe.progress(it)

    def to_device(b):
        return {k: v.to(dev, non_blocking=True) for k, v in b.items()}

    arrived = [model.input_dist(b["sparse_features"]) for b in device_batches]  # (exchanged once, here)

    def no_exchange():  # the ideal: this rank's lookups and the MLP, no collective
        for i in range(steps):
            b = device_batches[i % len(device_batches)]
            (model.lookup(arrived[i % len(arrived)]).sum() + step_model.bottom(b["dense"]).sum()).backward()

    runs = {"no_exchange_device_us": no_exchange,
            "plain_device_us": lambda: plain(step_model, device_batches, lambda b: b),
            "overlap_pass_device_us": lambda: plain(overlapped, device_batches, lambda b: b),
            "plain_host_us": lambda: plain(step_model, host, to_device),
            "pipelined_host_us": piped}
    if compiled:
        import torch._inductor.config as inductor

        reorder = dict(reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=["sink_waits"])
        variants = {"compiled_overlap_us": (False, {}), "compiled_functional_us": (True, {}),
                    "compiled_functional_reordered_us": (True, reorder)}
        for name, (functional, options) in variants.items():
            fn = torch.compile(overlap_collectives(step_model, functional=functional))

            def run(fn=fn, options=options):  # (Inductor reads its options when it compiles: round 0)
                with inductor.patch(options):
                    plain(fn, device_batches, lambda b: b)
            runs[name] = run
    return runs


def _loops(runs: dict, steps: int, dev) -> dict:
    """Each loop's us a step (`runs`: _runs's loops of `steps` steps), the median of ROUNDS rounds
    in which the loops alternate (one sync at the end of each, all ranks started together)."""
    times = {name: [] for name in runs}
    for rnd in range(1 + ROUNDS):  # the loops alternate, round after round: drift hits each alike
        for name, run in runs.items():
            took = _wall(run, dev)
            if rnd:  # round 0 warms up
                times[name].append(took / steps * 1e6)
    out = {name: statistics.median(t) for name, t in times.items()}
    out["rounds_us"] = times
    return out


PROFILED = ("plain_device_us", "overlap_pass_device_us")  # the loops --profile traces


def _profile(run, dev, path: Path) -> dict:
    """One more run of the loop `run` under torch.profiler: its Chrome trace written to `path`
    and overlap_summary of it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        _wall(run, dev)
    prof.export_chrome_trace(str(path))
    return overlap_summary(json.loads(path.read_text())["traceEvents"])


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering `spans`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(spans) -> float:
    return sum(end - start for start, end in spans)


def overlap_summary(events: list[dict]) -> dict:
    """What a profile's GPU kernels did (Chrome-trace events, microseconds): the time some
    communication kernel (NCCL's) ran, the time some other kernel ran, and how much of the first
    had another kernel running beside it (`hidden_share`: that over the communication time). An
    NCCL kernel's time includes its wait for the peer, so this is the collectives' time on the
    GPU, not the wire's. No kernels (gloo on CPUs): all zero."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    every = _union(comm + compute)
    comm_us, compute_us, busy = _length(comm), _length(compute), _length(every)
    both = comm_us + compute_us - busy  # |A and B| = |A| + |B| - |A or B|
    return {"kernels": len(kernels), "comm_us": comm_us, "compute_us": compute_us,
            "comm_beside_compute_us": both, "hidden_share": both / comm_us if comm else 0.0,
            "gpu_busy_us": busy, "span_us": every[-1][1] - every[0][0] if every else 0.0}


def write(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"distributed-{result['world_size']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path
