"""`embfuse ...`: the command line."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

_PROVIDERS = ("torch", "torch.compile", "embfuse", "embfuse-off", "fbgemm", "fbgemm-none")


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def demo(args: argparse.Namespace) -> int:
    """Train the DLRM click model with embfuse's embeddings and with torch's; compare them."""
    import json

    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from embfuse.bench.runner import tags
    from embfuse.demo import data as demo_data
    from embfuse.demo.run import build, plot, same_start, train

    console = Console(width=max(Console().width, 160))  # the results table is about 150 columns wide
    device = torch.device(_device(args.device))
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad on sparse grads
    try:
        if args.data == "movielens":
            data = demo_data.load_movielens()
        else:
            data = demo_data.synthetic(args.samples, args.rows, args.seed)
    except FileNotFoundError as e:
        console.print(f"[red]{e}")
        return 2
    if "WORLD_SIZE" in os.environ:  # under torchrun: sharded, plain loop against TrainPipeline
        return demo_distributed(args, console, data)
    train_idx, test_idx = data.split(args.test_fraction, args.seed)
    console.print(f"{data.name}: {len(train_idx):,} training and {len(test_idx):,} test examples, "
                  f"{len(data.sparse)} sparse features ({sum(data.rows.values()):,} embedding rows x {args.dim}), "
                  f"{data.dense.shape[1]} dense; positives {float(data.label.mean()):.1%}; device {device}")
    models = {name: build(name, data, args, device) for name in ("embfuse", "torch")}
    same_start(models["embfuse"], models["torch"])
    results = []
    with Progress(console=console, transient=True) as progress:
        for name, model in models.items():
            task = progress.add_task(f"training ({name})", total=args.epochs * len(train_idx))
            res = train(name, model, data, train_idx, test_idx, args, device,
                        progress=lambda n, task=task: progress.update(task, advance=n))
            for line in res.lines:
                progress.console.print(
                    f"{name:8s} epoch {line['epoch']}: train AUC {line['train_auc']:.4f}  test AUC "
                    f"{line['test_auc']:.4f}  test log-loss {line['test_logloss']:.4f}")
            results.append(res)
    memory = "peak GPU memory (MB)" if device.type == "cuda" else "tables + optimizer state (MB)"
    table = Table(title=f"{data.name} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}: "
                        f"{args.epochs} epochs, batch {args.batch_size}")
    for col in ("model", "test AUC", "test log-loss", "examples/s", "embedding ms/step", memory):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        last = r.lines[-1]
        table.add_row(f"DLRM with {r.name} embeddings", f"{last['test_auc']:.4f}", f"{last['test_logloss']:.4f}",
                      f"{r.examples_per_s:,.0f}", f"{r.embedding_ms_per_step:.2f}", f"{r.memory_mb:,.1f}")
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "demo.png")
    (out / "demo.json").write_text(json.dumps({"data": data.name, "device": str(device), **tags(device),
                                               "args": vars(args) | {"func": None},
                                               "results": [r.__dict__ | {"step_losses": r.step_losses[::10]}
                                                           for r in results]}, indent=1))
    console.print(f"wrote {out / 'demo.png'} and {out / 'demo.json'}")
    return 0


def demo_distributed(args: argparse.Namespace, console, data) -> int:
    """`embfuse demo` under torchrun (demo/distributed.py); rank 0 prints and writes."""
    import json

    import torch
    import torch.distributed as dist
    from rich.table import Table

    from embfuse.bench.runner import tags
    from embfuse.demo.distributed import run

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank = dist.get_rank()
        results = run(args, data, lambda text: rank == 0 and console.print(text))
        if rank != 0:
            return 0
        table = Table(title=f"{data.name}, {dist.get_world_size()} rank(s): {args.epochs} epochs, batch "
                            f"{args.batch_size}")
        for col in ("model", "test AUC", "test log-loss", "examples/s (all ranks)"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in results:
            last = r.lines[-1]
            table.add_row(f"DLRM, {r.name}", f"{last['test_auc']:.4f}", f"{last['test_logloss']:.4f}",
                          f"{r.examples_per_s:,.0f}")
        console.print(table)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "demo-distributed.json").write_text(json.dumps({
            "data": data.name, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            **tags(torch.device("cuda" if cuda else "cpu")), "args": vars(args) | {"func": None},
            "results": [r.__dict__ | {"step_losses": r.step_losses[::10]} for r in results]}, indent=1))
        console.print(f"wrote {out / 'demo-distributed.json'}")
        return 0
    finally:
        dist.destroy_process_group()


def bench(args: argparse.Namespace) -> int:
    """Measure the workloads with every provider on this GPU; write JSON, a table and a plot."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from embfuse.bench.report import markdown, plot, table
    from embfuse.bench.runner import run
    from embfuse.bench.workloads import workloads

    console = Console(width=max(Console().width, 160))
    if args.distributed:
        return bench_distributed(args, console)
    if not torch.cuda.is_available():
        if args.fx or args.l2:
            console.print(f"embfuse bench {'--fx' if args.fx else '--l2'} times GPU lookups and needs a CUDA device; "
                          f"none was found.")
            return 2
        console.print("embfuse bench measures GPU kernels and needs a CUDA device; none was found.")
        return 2
    if args.fx:
        return bench_fx(args, console)
    if args.l2:
        return bench_l2(args, console)
    selected = [w for w in workloads(quick=args.quick) if not args.group or w.group in args.group]
    out = Path(args.out)
    with Progress(console=console) as progress:
        task = progress.add_task("benchmarking", total=len(selected))

        def advance(w):
            progress.update(task, advance=1, description=w.name)

        result = run(selected, args.providers, out, progress=advance)
    console.print(table(result))
    (out / "bench.md").write_text(markdown(result) + "\n")
    plot(result, out / "bench.png")
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and {out / 'bench.png'}")
    return 0


def bench_fx(args: argparse.Namespace, console) -> int:
    """The eager seed-like model against torch.compile and embfuse.fx.optimize (bench/graph.py)."""
    from embfuse.bench.graph import VARIANTS, markdown, measure, write

    with console.status("measuring") as status:
        result = measure(variants=args.fx_variants or VARIANTS, progress=lambda what: status.update(what),
                         pinned=args.fx_pinned)
    console.print(markdown(result))
    console.print(f"wrote {write(result, Path(args.out))}")
    return 0


def bench_l2(args: argparse.Namespace, console) -> int:
    """Hot rows resident in L2 against the plain lookup and FBGEMM (bench/residency.py)."""
    from embfuse.bench.residency import markdown, measure, write

    with console.status("measuring") as status:
        result = measure(progress=lambda what: status.update(what))
    console.print(markdown(result))
    console.print(f"wrote {write(result, Path(args.out))}")
    return 0


def bench_distributed(args: argparse.Namespace, console) -> int:
    """The sharded training step on every rank of a torchrun launch (bench/distributed.py)."""
    from rich.table import Table

    from embfuse.bench.distributed import measure, write

    result = measure(args.batch_size, args.rows, args.dim, args.hotness, args.steps, args.warmup, args.device,
                     comm_dtype=args.comm_dtype, compiled=args.compiled,
                     profile=Path(args.out) / "profile" if args.profile else None)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    t = Table(title=f"sharded step: {result['world_size']} rank(s), {result['backend']}, batch {args.batch_size} a "
                    f"rank, 26 tables x {args.dim}, rows capped at {args.rows}"
                    + ("" if args.comm_dtype == "table" else f", pooled rows sent as {args.comm_dtype}"))
    for c in ("rank", "device", "step (us)", "examples/s", "in collectives"):
        t.add_column(c, justify="right")
    for r in result["ranks"]:
        t.add_row(str(r["rank"]), r["device"], f"{r['step_us']:.0f}", f"{r['examples_per_s']:,.0f}",
                  f"{100 * r['comm_share']:.0f}%")
    console.print(result["plan"])
    console.print(t)
    console.print(f"all ranks: {result['examples_per_s_total']:,.0f} examples/s")
    r0 = result["ranks"][0]
    loops = Table(title=f"rank 0: a training step (lookup + a dense bottom MLP), us, median of 5 alternating runs of "
                        f"{args.steps} steps")
    for c in ("no exchange (ideal)", "plain loop", "+ overlap pass", "plain loop, host batches",
              "TrainPipeline, host batches"):
        loops.add_column(c, justify="right")
    loops.add_row(*(f"{r0[k]:.0f}" for k in ("no_exchange_device_us", "plain_device_us", "overlap_pass_device_us",
                                              "plain_host_us", "pipelined_host_us")))
    console.print(loops)
    if args.compiled:
        compiled = Table(title="rank 0: the same step with the overlap pass under torch.compile, us")
        for c in ("stages eager", "functional all-to-all", "functional, Inductor's reordering on"):
            compiled.add_column(c, justify="right")
        compiled.add_row(*(f"{r0[k]:.0f}" for k in ("compiled_overlap_us", "compiled_functional_us",
                                                     "compiled_functional_reordered_us")))
        console.print(compiled)
    if args.profile:
        prof = Table(title=f"one more run of {args.steps} steps under torch.profiler, GPU kernels' time (us); "
                           f"traces in {Path(args.out) / 'profile'}")
        for c in ("rank", "loop", "kernels", "collectives", "other kernels", "collectives beside others",
                  "GPU busy", "span"):
            prof.add_column(c, justify="right")
        for r in result["ranks"]:
            for name, p in r["profile"].items():
                prof.add_row(str(r["rank"]), name.removesuffix("_device_us"), str(p["kernels"]), f"{p['comm_us']:.0f}",
                             f"{p['compute_us']:.0f}",
                             f"{p['comm_beside_compute_us']:.0f} ({100 * p['hidden_share']:.0f}%)",
                             f"{p['gpu_busy_us']:.0f}", f"{p['span_us']:.0f}")
        console.print(prof)
    plain = result["ranks"][0]["unsharded_step_us"]
    if plain is not None:
        console.print(f"the same step unsharded (world of one): {plain:.0f} us")
    console.print(f"wrote {write(result, Path(args.out))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embfuse", description="Fast embedding lookups for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a DLRM click model with embfuse and with torch embeddings; compare",
                       description="Trains the same DLRM-style click model twice, once with an embfuse "
                       "EmbeddingBagCollection (fused Adagrad in the backward) and once with torch nn.EmbeddingBag "
                       "modules (sparse gradients + torch.optim.Adagrad), from the same start, and compares them.")
    p.add_argument("--data", choices=("movielens", "synthetic"), default="movielens",
                   help="movielens: MovieLens-100K (label: rating >= 4) from the recbole wheel; synthetic: a "
                   "Criteo-shaped set (26 power-law sparse features, 13 dense) sized by --samples and --rows")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=1024, help="examples per training step")
    p.add_argument("--dim", type=int, default=16, help="embedding width of every table")
    p.add_argument("--lr-sparse", type=float, default=0.05, help="Adagrad learning rate of the embedding tables")
    p.add_argument("--lr-dense", type=float, default=1e-3, help="Adam learning rate of the MLPs")
    p.add_argument("--test-fraction", type=float, default=0.2, help="share of examples held out for testing")
    p.add_argument("--samples", type=int, default=1_000_000, help="synthetic: number of examples")
    p.add_argument("--rows", type=int, default=1_000_000, help="synthetic: rows of each of the 26 tables")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the shuffles and the initial weights")
    p.add_argument("--out", default="embfuse-out/demo", help="folder for demo.png and demo.json")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="measure lookups against torch, torch.compile and FBGEMM on this GPU")
    p.add_argument("--quick", action="store_true", help="a smaller grid (under two minutes on an H100)")
    p.add_argument("--out", default="embfuse-out/bench", help="folder for bench.json, bench.md and bench.png")
    p.add_argument("--providers", nargs="+", default=list(_PROVIDERS), choices=_PROVIDERS,
                   help="implementations to measure")
    p.add_argument("--group", nargs="+", help="only these workload groups (grid, csr, half, modes, embedding, "
                   "dlrm, latency)")
    p.add_argument("--fx", action="store_true", help="an eager seed-like model as written, under torch.compile "
                   "and under embfuse.fx.optimize (forward and training step, kernels and copies per call)")
    p.add_argument("--fx-pinned", action="store_true", help="--fx: batches start in pinned host memory (a "
                   "DataLoader with pin_memory=True), not pageable")
    p.add_argument("--fx-variants", nargs="+", default=None, help="--fx: only these of " + ", ".join(
                   "'" + v + "'" for v in ("eager", "compile", "compile + batch fusions", "optimize",
                                            "optimize + compile", "optimize + CUDA graph")))
    p.add_argument("--l2", action="store_true", help="hot rows resident in L2 (pin_hot_rows_in_l2) against the "
                   "plain lookup and FBGEMM, with the hit rate and window chosen")
    p.add_argument("--distributed", action="store_true",
                   help="the sharded training step on every rank: run under torchrun --nproc_per_node=N "
                   "--no-python embfuse bench --distributed (alone: a world of one)")
    p.add_argument("--device", default="auto", help="--distributed: cpu (gloo), cuda (nccl) or auto")
    p.add_argument("--batch-size", type=int, default=16384, help="--distributed: samples a rank")
    p.add_argument("--rows", type=int, default=1_000_000, help="--distributed: cap on each table's rows")
    p.add_argument("--dim", type=int, default=128, help="--distributed: embedding width")
    p.add_argument("--hotness", type=int, default=20, help="--distributed: mean ids a bag")
    p.add_argument("--compiled", action="store_true", help="--distributed: also the overlap pass under "
                   "torch.compile (stages eager, functional all-to-all, and that with Inductor's reordering)")
    p.add_argument("--comm-dtype", choices=("table", "bf16", "fp16"), default="table",
                   help="--distributed: the dtype pooled rows cross ranks in (default: the tables')")
    p.add_argument("--profile", action="store_true", help="--distributed: also profile the plain and overlapped "
                   "loops on every rank; Chrome traces in OUT/profile, a summary of the collectives' overlap")
    p.add_argument("--steps", type=int, default=20, help="--distributed: timed steps")
    p.add_argument("--warmup", type=int, default=5, help="--distributed: untimed steps first")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
