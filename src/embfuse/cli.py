"""`embfuse ...`: the command line."""

from __future__ import annotations

import argparse
import sys


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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
