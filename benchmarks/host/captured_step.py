"""A fused training step eager and replayed from a CUDA graph, per rule: host time a step (the
time to enqueue 200 steps back to back) and wall time a step (until the GPU is done). Rules
whose hyper-parameters change every step (Adam, Adagrad with lr_decay) read them inside the
graph from the GPU's step count, which the graph advances with a few small ops
(FusedOptimizer.stepping). nn.EmbeddingBag, 100K x 128 fp32, B2048 x 20 ids, sum.

    PYTHONPATH=src python3 benchmarks/host/captured_step.py
"""

import time

import torch

import embfuse
from embfuse.optim import SGD, Adagrad, Adam


def per_call(fn, calls=200, rounds=3):
    """(host, wall) us a call, one pair a round."""
    out = []
    for _ in range(rounds):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append(((t1 - t0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6))
    return out


def main():
    torch.manual_seed(0)
    B, L, D, N = 2048, 20, 128, 100_000
    ids = torch.randint(0, N, (B, L), device="cuda")
    grad = torch.randn(B, D, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a step, host / wall, three rounds")
    for name, rule in [("SGD", SGD(lr=0.01)), ("Adam", Adam(lr=0.01)),
                       ("Adagrad lr_decay", Adagrad(lr=0.01, lr_decay=0.01))]:
        m = embfuse.nn.EmbeddingBag(N, D, mode="sum", optimizer=rule, device="cuda")

        def step():
            m(ids).backward(grad)

        rows = {"eager": per_call(step)}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rows["replayed"] = per_call(graph.replay)
        embfuse.check_errors()
        for how, r in rows.items():
            print(f"{name:17s} {how:8s} " + ", ".join(f"{h:.1f} / {w:.1f}" for h, w in r))


if __name__ == "__main__":
    main()
