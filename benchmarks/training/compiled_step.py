"""A training step with a fused optimizer: eager, under torch.compile(fullgraph=True), and under
torch.compile(fullgraph=True, mode="reduce-overhead") (Inductor's CUDA graphs; row-wise Adagrad's
hyper-parameters do not change between steps, so its fused update may be captured). The 26
Criteo-sized tables (at most 1M rows) x 128 of bench/collection.py, power-law ids, bag lengths
1-39, fused row-wise Adagrad, a dense MLP 3328 -> 512 -> 256 -> 1 after the lookup, BCE loss,
torch.optim.SGD on the MLP; batches already on the GPU (four, taken in turn). Median of 5 rounds
in which the variants alternate, each round 20 steps and one synchronisation; then how far each
variant's tables are from eager's after the same steps.

    PYTHONPATH=src python benchmarks/training/compiled_step.py > OUT.md
"""

import statistics
import time

import torch
import torch.nn.functional as F

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload


class Model(torch.nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        torch.manual_seed(0)  # (every variant starts from the same tables and MLP)
        self.ebc = make_collection(w, "cuda", optimizer=embfuse.optim.RowWiseAdagrad(lr=0.01))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(w.dim * w.tables, 512), torch.nn.ReLU(),
                                       torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()

    def forward(self, kjt, target):
        return F.binary_cross_entropy_with_logits(self.mlp(self.ebc(kjt).values()), target)


def runner(model, call):
    opt = torch.optim.SGD(model.mlp.parameters(), lr=0.01)

    def step(kjt, target):
        opt.zero_grad(set_to_none=True)
        call(kjt, target).backward()
        opt.step()
    return step


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| batch | eager step us | compiled | reduce-overhead | rounds: eager | compiled | reduce-overhead |")
    print("|---|---|---|---|---|---|---|")
    for B in (2048, 16384):
        w = Workload("c", "collection-train", 1_000_000, 128, B, 20, "powerlaw", 1.05, tables=26)
        batches = [(make_batch(w, "cuda", seed=s), torch.rand(B, 1, device="cuda")) for s in range(4)]
        eager_model, compiled_model, graphed_model = Model(w), Model(w), Model(w)
        start = eager_model.ebc.weights.detach().clone()
        steps = {"eager": runner(eager_model, eager_model),
                 "compiled": runner(compiled_model, torch.compile(compiled_model, fullgraph=True)),
                 "reduce-overhead": runner(graphed_model, torch.compile(graphed_model, fullgraph=True,
                                                                         mode="reduce-overhead"))}
        for step in steps.values():  # warm-up: compiles, plans, kernels
            for b in batches * 2:
                step(*b)
        embfuse.check_errors()
        times = {k: [] for k in steps}
        for _ in range(5):
            for name, step in steps.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for i in range(20):
                    step(*batches[i % 4])
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t) / 20 * 1e6)
        embfuse.check_errors()
        # the same steps on the same batches: the tables should agree to fp32 rounding
        diff = {k: (m.ebc.weights - eager_model.ebc.weights).abs().max().item()
                for k, m in (("compiled", compiled_model), ("reduce-overhead", graphed_model))}
        moved = (eager_model.ebc.weights - start).abs().max().item()
        print(f"<!-- B{B}: largest table difference from eager {diff}; eager moved its tables up to {moved:.3g} -->")
        med = {k: statistics.median(v) for k, v in times.items()}
        e = med["eager"]
        print(f"| {B} | {e:.0f} | " + " | ".join(f"{med[k]:.0f} ({med[k] / e:.2f})" for k in list(steps)[1:]) + " | "
              + " | ".join(", ".join(f"{t:.0f}" for t in times[k]) for k in steps) + " |")


if __name__ == "__main__":
    main()
