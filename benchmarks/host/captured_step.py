"""A fused training step eager and replayed from a CUDA graph, per rule: the host's time a step,
the wall time and the GPU's busy time (host_default_b2048.per_call: 200 steps back to back, then
10 profiled). Rules whose hyper-parameters change every step (Adam, Adagrad with lr_decay) read
them inside the graph from the GPU's step count, which the graph advances with a few small ops
on a side stream beside the backward's sort (FusedOptimizer.stepping). nn.EmbeddingBag, 100K x
128 fp32, B2048 x 20 ids, sum.

    PYTHONPATH=src python3 benchmarks/host/captured_step.py
"""

import sys
from pathlib import Path

import torch

import embfuse
from embfuse.optim import SGD, Adagrad, Adam

sys.path.insert(0, str(Path(__file__).parent))
from host_default_b2048 import per_call  # noqa: E402


def main():
    torch.manual_seed(0)
    B, L, D, N = 2048, 20, 128, 100_000
    ids = torch.randint(0, N, (B, L), device="cuda")
    grad = torch.randn(B, D, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a step, host / wall / GPU busy, three rounds")
    for name, rule in [("SGD", SGD(lr=0.01)), ("Adam", Adam(lr=0.01)),
                       ("Adagrad lr_decay", Adagrad(lr=0.01, lr_decay=0.01))]:
        m = embfuse.nn.EmbeddingBag(N, D, mode="sum", optimizer=rule, device="cuda")

        def step():
            m(ids).backward(grad)

        rows = {"eager": [per_call(step) for _ in range(3)]}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rows["replayed"] = [per_call(graph.replay) for _ in range(3)]
        embfuse.check_errors()
        for how, r in rows.items():
            print(f"{name:17s} {how:8s} " + ", ".join("%.1f / %.1f / %.1f" % t for t in r))


if __name__ == "__main__":
    main()
