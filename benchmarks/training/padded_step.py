"""The fused training step of compiled_step.py on jagged batches whose lengths change every step,
as a data loader gives them: eager, and under torch.compile(fullgraph=True, mode="reduce-overhead")
(Inductor's CUDA graphs), each on the batches as they are and padded to one capacity
(PaddedKeyedJaggedTensor: the largest batch's values, rounded up to 64K).

Every timed step takes a batch no earlier step had (100 of them, made on the GPU first; the
warm-up uses four others). Median of 5 rounds in which the variants alternate, 20 steps a round
and one synchronisation. reduce-overhead on unpadded batches records a graph for every new shape:
it runs one round of 5 steps only. Then how far each variant's tables are from eager's.

    PYTHONPATH=src python benchmarks/training/padded_step.py > OUT.md
"""

import os
import statistics
import sys
import time

import torch

import embfuse
from embfuse.bench.collection import make_batch
from embfuse.bench.workloads import Workload
from embfuse.sparse import PaddedKeyedJaggedTensor

sys.path.insert(0, os.path.dirname(__file__))
from compiled_step import Model, runner  # noqa: E402


def timed(step, batches, first, steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        step(*batches[first + i])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e6


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"commit {os.environ.get('EMBFUSE_COMMIT', '?')}\n")
    print("| batch | values a batch (min-max) | capacity | eager | eager, padded | reduce-overhead, as they are "
          "| reduce-overhead, padded | rounds: eager | eager, padded | reduce-overhead, padded |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B in (2048, 16384):
        w = Workload("c", "collection-train", 1_000_000, 128, B, 20, "powerlaw", 1.05, tables=26)
        plain = [(make_batch(w, "cuda", seed=s), torch.rand(B, 1, device="cuda")) for s in range(104)]
        sizes = [k.values().numel() for k, _ in plain]
        capacity = -(-max(sizes) // 65536) * 65536
        padded = [(PaddedKeyedJaggedTensor.from_kjt(k, capacity), t) for k, t in plain]
        models = {name: Model(w) for name in ("eager", "eager, padded", "reduce-overhead", "reduce-overhead, padded")}
        start = models["eager"].ebc.weights.detach().clone()
        steps, feeds = {}, {}
        for name, m in models.items():
            call = torch.compile(m, fullgraph=True, mode="reduce-overhead") if name.startswith("reduce") else m
            steps[name], feeds[name] = runner(m, call), padded if name.endswith("padded") else plain
        for name, step in steps.items():  # warm-up on the last four batches: compiles, plans, kernels
            for b in feeds[name][100:] * 2:
                step(*b)
        embfuse.check_errors()
        times = {k: [] for k in steps if k != "reduce-overhead"}
        for r in range(5):
            for name in times:
                times[name].append(timed(steps[name], feeds[name], 20 * r, 20))
        recorded = timed(steps["reduce-overhead"], feeds["reduce-overhead"], 0, 5)
        embfuse.check_errors()
        # the same 100 steps from the same tables: the tables should agree to fp32 rounding
        diff = {k: (models[k].ebc.weights - models["eager"].ebc.weights).abs().max().item()
                for k in ("eager, padded", "reduce-overhead, padded")}
        moved = (models["eager"].ebc.weights - start).abs().max().item()
        print(f"<!-- B{B}: largest table difference from eager {diff}; eager moved its tables up to {moved:.3g} -->")
        med = {k: statistics.median(v) for k, v in times.items()}
        e = med["eager"]
        print(f"| {B} | {min(sizes)}-{max(sizes)} | {capacity} | {e:.0f} | {med['eager, padded']:.0f} "
              f"({med['eager, padded'] / e:.2f}) | {recorded:.0f} ({recorded / e:.2f}; 5 steps) | "
              f"{med['reduce-overhead, padded']:.0f} ({med['reduce-overhead, padded'] / e:.2f}) | "
              + " | ".join(", ".join(f"{t:.0f}" for t in times[k]) for k in times) + " |")
        del plain, padded, models, steps, feeds
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
