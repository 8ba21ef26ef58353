"""What a user without a GPU gets: wall time per call of embfuse's CPU paths (torch ops) beside
torch's own, on this machine's CPU. Single table: F.embedding_bag against embfuse.embedding_bag
(default checks), forward without grad and forward + backward. A collection of 8 tables
(50K x 64, B2048, bag lengths 1-39): a torch loop of F.embedding_bag against
EmbeddingBagCollection, forward, forward + dense backward, and a fused SGD step against
nn.EmbeddingBag(sparse=True) + torch.optim.SGD. Median of `--reps` timed calls.

    PYTHONPATH=src python3 benchmarks/cpu/cpu_paths.py [--reps 7] [--out FILE.json]
"""

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import embfuse


def median_us(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def single_rows(reps):
    rows = []
    for B, L, D, R in [(64, 4, 16, 1_000), (512, 8, 64, 10_000), (4096, 20, 128, 100_000)]:
        w = torch.randn(R, D)
        ids, off = torch.randint(0, R, (B * L,)), torch.arange(0, B * L, L)
        shape = f"one table {R // 1000}K x {D}, B{B} L{L}"
        for mode in ("sum", "mean", "max"):
            with torch.no_grad():
                t = median_us(lambda: F.embedding_bag(ids, w, off, mode=mode), reps)
                e = median_us(lambda: embfuse.embedding_bag(ids, w, off, mode=mode), reps)
            rows.append((f"{shape}, {mode} forward", t, e))
        wg = w.clone().requires_grad_()
        t = median_us(lambda: F.embedding_bag(ids, wg, off, mode="sum").sum().backward(), reps)
        e = median_us(lambda: embfuse.embedding_bag(ids, wg, off, mode="sum").sum().backward(), reps)
        rows.append((f"{shape}, sum forward + backward", t, e))
    return rows


def collection_rows(reps, T=8, R=50_000, D=64, B=2048):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (T * B,), generator=g)
    values = torch.randint(0, R, (int(lengths.sum()),), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    keys = [f"f{i}" for i in range(T)]
    kjt = embfuse.KeyedJaggedTensor(keys, values, lengths=lengths)
    tables = [embfuse.EmbeddingBagConfig(R, D, f"t{i}", feature_names=[k]) for i, k in enumerate(keys)]
    ebc = embfuse.EmbeddingBagCollection(tables)
    fused = embfuse.EmbeddingBagCollection(tables, optimizer=embfuse.optim.SGD(lr=0.1))
    bags = torch.nn.ModuleList([torch.nn.EmbeddingBag(R, D, mode="sum", sparse=True) for _ in range(T)])
    sgd = torch.optim.SGD(bags.parameters(), lr=0.1)

    def loop():
        outs = []
        for i in range(T):
            o = offs[i * B:(i + 1) * B + 1]
            outs.append(bags[i](values[o[0]:o[-1]], o[:-1] - o[0]))
        return torch.cat(outs, 1)

    def torch_step():
        loop().sum().backward()
        sgd.step()
        sgd.zero_grad()

    shape = f"collection {T} x {R // 1000}K x {D}, B{B}"
    with torch.no_grad():
        rows = [(f"{shape}, forward", median_us(loop, reps), median_us(lambda: ebc(kjt), reps))]
    rows.append((f"{shape}, forward + dense backward (torch: sparse)",
                 median_us(lambda: loop().sum().backward(), reps),
                 median_us(lambda: ebc(kjt).values().sum().backward(), reps)))
    rows.append((f"{shape}, SGD step (embfuse fused)", median_us(torch_step, reps),
                 median_us(lambda: fused(kjt).values().sum().backward(), reps)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = single_rows(args.reps) + collection_rows(args.reps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, commit {commit}")
    print("| case | torch us | embfuse us | embfuse / torch |\n|---|---|---|---|")
    for name, t, e in rows:
        print(f"| {name} | {t:,.0f} | {e:,.0f} | {e / t:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "commit": commit,
                       "rows": [{"case": n, "torch_us": t, "embfuse_us": e} for n, t, e in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
