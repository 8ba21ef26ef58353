"""`embfuse ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_PROVIDERS = ("torch", "torch.compile", "embfuse", "embfuse+check", "fbgemm")


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def demo(args: argparse.Namespace) -> int:
    """Look up a batch of bags with embfuse and with torch, and show that they agree."""
    import torch
    import torch.nn.functional as F
    from rich.console import Console
    from rich.table import Table

    import embfuse

    console = Console()
    device = _device(args.device)
    torch.manual_seed(args.seed)
    weight = torch.randn(args.rows, args.dim, device=device)
    table = Table(title=f"embedding_bag on {device}: {args.batch} bags of {args.hotness} ids, table {args.rows} x {args.dim}")
    for col in ("mode", "max |embfuse - torch|", "first output row (embfuse)"):
        table.add_column(col)
    ids = torch.randint(0, args.rows, (args.batch, args.hotness), device=device)
    for mode in ("sum", "mean", "max"):
        ours = embfuse.embedding_bag(ids, weight, mode=mode)
        ref = F.embedding_bag(ids, weight, mode=mode)
        row = ", ".join(f"{v:+.3f}" for v in ours[0, :4].tolist())
        table.add_row(mode, f"{(ours - ref).abs().max().item():.2e}", f"[{row}, ...]")
    console.print(table)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Measure the workloads with every provider on this GPU; write JSON, a table and a plot."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from embfuse.bench.providers import PROVIDERS
    from embfuse.bench.report import markdown, plot, table
    from embfuse.bench.runner import run
    from embfuse.bench.workloads import workloads

    console = Console(width=max(Console().width, 160))
    if not torch.cuda.is_available():
        console.print("embfuse bench measures GPU kernels and needs a CUDA device; none was found.")
        return 2
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embfuse", description="Fast embedding lookups for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="compare embfuse's lookups with torch's")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    p.add_argument("--rows", type=int, default=1000, help="table rows")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--batch", type=int, default=64, help="number of bags")
    p.add_argument("--hotness", type=int, default=8, help="ids per bag")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="measure lookups against torch, torch.compile and FBGEMM on this GPU")
    p.add_argument("--quick", action="store_true", help="a smaller grid (under two minutes on an H100)")
    p.add_argument("--out", default="embfuse-out/bench", help="folder for bench.json, bench.md and bench.png")
    p.add_argument("--providers", nargs="+", default=list(_PROVIDERS), choices=_PROVIDERS,
                   help="implementations to measure")
    p.add_argument("--group", nargs="+", help="only these workload groups (grid, csr, half, modes, embedding, "
                   "dlrm, latency)")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
