"""embfuse.fx.optimize on a model whose cat holds a dense part beside the per-feature chains
(DLRM's `cat([dense_out] + features)`): the chains fused (this pass since 2026-11-28) against
the same optimize with the horizontal pass off (what it did before: a cat with anything besides
chains was left alone), and the eager model.

The model: bench/eager.py's EagerModel (64 features, tables of 1K-1M rows x 64, mean pooling,
split -> LayerNorm -> tanh) with a dense branch Linear(13, 64) + ReLU whose output is the cat's
first part, then the MLP; B 4096, mean bag length 20, inputs already on the GPU. Per variant, the
forward under no_grad and a training step (fused SGD on the tables, torch.optim.SGD on the
rest); median of 7 alternating rounds of 20 calls, synchronised; kernels launched a call
(torch.profiler). The outputs of the three are compared first.

    PYTHONPATH=src python benchmarks/fx/dense_beside.py > OUT.md
"""

import copy
import importlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import embfuse
import embfuse.fx
from embfuse.bench.eager import EagerModel, eager_batch
from embfuse.bench.graph import table_sizes


class DenseBeside(EagerModel):
    def __init__(self, sizes, dim, device):
        super().__init__(sizes, dim, hidden=(512, 256), device=device)
        self.bottom = nn.Sequential(nn.Linear(13, dim, device=device), nn.ReLU())
        self.mlp[0] = nn.Linear((len(sizes) + 1) * dim, 512, device=device)

    def forward(self, ids, offsets, dense):
        pooled = [emb(i, o) for emb, i, o in zip(self.embs, ids, offsets)]
        parts = torch.split(torch.cat(pooled, dim=1), self.dim, dim=1)
        chains = [torch.tanh(norm(p)) for norm, p in zip(self.norms, parts)]
        return self.mlp(torch.cat([self.bottom(dense)] + chains, dim=1))


def kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    torch.manual_seed(0)
    sizes, D, B = table_sizes(64, 1_000, 1_000_000), 64, 4096
    base = DenseBeside(sizes, D, "cuda")
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids, offsets = eager_batch(sizes, B, 20, g)
        batches.append(([i.cuda() for i in ids], [o.cuda() for o in offsets], torch.randn(B, 13, device="cuda"),
                        torch.rand(B, 1, device="cuda")))
    example = batches[0][:3]
    optimize_module = importlib.import_module("embfuse.fx.optimize")  # (embfuse.fx.optimize is the function)
    plain = optimize_module.fuse_horizontal
    optimize_module.fuse_horizontal = lambda gm, report=None: gm  # the pass off
    off = embfuse.fx.optimize(copy.deepcopy(base), example, optimizer=embfuse.optim.SGD(lr=0.01))
    optimize_module.fuse_horizontal = plain
    fused = embfuse.fx.optimize(copy.deepcopy(base), example, optimizer=embfuse.optim.SGD(lr=0.01))
    eager = copy.deepcopy(base)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B {B}, {len(sizes)} features x {D}\n")
    print("optimize's report:", "; ".join(r for r in fused.embfuse_report if not r.startswith("batched")), "\n")
    with torch.no_grad():
        want = eager(*example)
        for name, m in (("pass off", off), ("fused", fused)):
            err = (m(*example) - want).abs().max().item()
            print(f"- {name}: forward max |difference| from eager {err:.2e}")
    models = {"eager": eager, "optimize, horizontal pass off": off, "optimize (chains beside dense fused)": fused}
    opts = {k: torch.optim.SGD([p for n, p in m.named_parameters() if k != "eager" or "embs" not in n], lr=0.01)
            for k, m in models.items()}
    opts["eager-tables"] = torch.optim.SGD([p for n, p in eager.named_parameters() if "embs" in n], lr=0.01)

    def forward(name):
        with torch.no_grad():
            for ids, offsets, dense, _ in batches:
                models[name](ids, offsets, dense)

    def step(name):
        for ids, offsets, dense, target in batches:
            opts[name].zero_grad(set_to_none=True)
            if name == "eager":
                opts["eager-tables"].zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(models[name](ids, offsets, dense), target).backward()
            opts[name].step()
            if name == "eager":
                opts["eager-tables"].step()

    print("\n| variant | forward ms | step ms | kernels a forward | kernels a step |")
    print("|---|---|---|---|---|")
    times = {(k, w): [] for k in models for w in ("f", "s")}
    for fn in (forward, step):
        for k in models:
            for _ in range(3):
                fn(k)
    for _ in range(7):
        for k in models:
            for w, fn in (("f", forward), ("s", step)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    fn(k)
                torch.cuda.synchronize()
                times[(k, w)].append((time.perf_counter() - t0) * 1e3 / 20)
    for k in models:
        kf = kernels_per_call(lambda: forward(k)) // len(batches)
        ks = kernels_per_call(lambda: step(k)) // len(batches)
        print(f"| {k} | {statistics.median(times[(k, 'f')]):.3f} | {statistics.median(times[(k, 's')]):.3f} "
              f"| {kf} | {ks} |")


if __name__ == "__main__":
    main()
