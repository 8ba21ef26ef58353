"""Sharded tables with TensorFlow's rules against TorchRec's pooling, in one torchrun launch: the
26-table Criteo-like collection of `embfuse bench --distributed` (1M rows x 128 at most, power-law
ids, bags of 1-39, fused row-wise Adagrad, the default plan), sharded four ways:

- pooling "sum" (TorchRec's tables, the `bench --distributed` step);
- combiner="sum" (TensorFlow's rules: the sending rank's safe pass, a batch that carries weights);
- combiner="mean" with default_id=0;
- that, on batches where 1% of the ids are -1 (pruned; a bag left empty reads the default id).

Per way: the training step (forward, backward, fused update) and the forward alone, median of
each rank's synchronised steps, all ranks started together (bench/distributed.py's timer).

    PYTHONPATH=src torchrun --nproc_per_node=N benchmarks/distributed/sharded_tf.py [BATCH [ROWS]]
"""

import statistics
import sys

import torch
import torch.distributed as dist

import embfuse
import embfuse.distributed as ed
from embfuse.bench.collection import table_rows
from embfuse.bench.distributed import _init, _wall, rank_batches, time_steps, workload
from embfuse.bench.runner import commit
from embfuse.optim import RowWiseAdagrad

WAYS = {"pooling sum": {}, "combiner sum": {"combiner": "sum"},
        "combiner mean, default_id 0": {"combiner": "mean", "default_id": 0}}
STEPS, WARMUP = 30, 10


def sharded(w, dev, **rules) -> torch.nn.Module:
    torch.manual_seed(0)
    ebc = embfuse.EmbeddingBagCollection(
        [embfuse.EmbeddingBagConfig(r, w.dim, f"t{i}", feature_names=[f"f{i}"], **rules)
         for i, r in enumerate(table_rows(w))], device=dev, optimizer=RowWiseAdagrad(lr=0.01))
    return ed.shard(ebc)


def pruned(kjt, seed: int):
    """The batch with 1% of its ids made -1."""
    g = torch.Generator(device=kjt.values().device).manual_seed(seed)
    drop = torch.rand(kjt.values().shape, device=kjt.values().device, generator=g) < 0.01
    return embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values().masked_fill(drop, -1), lengths=kjt.lengths(),
                                     stride=kjt.stride(), length_per_key=kjt.length_per_key())


def forward_times(model, batches, dev) -> list[float]:
    with torch.no_grad():
        times = [_wall(lambda b=batches[i % len(batches)]: model(b).values(), dev) for i in range(WARMUP + STEPS)]
    return times[WARMUP:]


def main() -> None:
    dev, _ = _init("auto")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = workload(int(sys.argv[1]) if len(sys.argv) > 1 else 16384, int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000)
    batches = rank_batches(w, dev)
    cases = [(name, rules, batches) for name, rules in WAYS.items()]
    cases.append(("combiner mean, default_id 0, 1% ids -1", WAYS["combiner mean, default_id 0"],
                  [pruned(b, 7 + i) for i, b in enumerate(batches)]))
    rows = []
    for name, rules, data in cases:
        model = sharded(w, dev, **rules)
        step = statistics.median(time_steps(model, data, STEPS, WARMUP, dev)[0]) * 1e6
        fwd = statistics.median(forward_times(model, data, dev)) * 1e6
        every = [None] * world
        dist.all_gather_object(every, (step, fwd))
        rows.append((name, every))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(f"{world} x {gpu}, {dist.get_backend()}, torch {torch.__version__}, commit {commit()[:8]}; B{w.batch} "
              f"a rank, 26 tables (rows <= {w.rows}) x {w.dim}, bags 1-{2 * w.hotness - 1}; us, median of {STEPS} "
              "(per rank)")
        print("| tables | step | forward | step / pooling sum |")
        print("|---|---|---|---|")
        base = rows[0][1]
        for name, every in rows:
            print(f"| {name} | " + " / ".join(f"{s:.0f}" for s, _ in every) + " | "
                  + " / ".join(f"{f:.0f}" for _, f in every) + " | "
                  + " / ".join(f"{s / b[0]:.3f}" for (s, _), b in zip(every, base)) + " |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
