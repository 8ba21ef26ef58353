"""Tables and plots of a `bench.json` result."""

from __future__ import annotations

import json
from pathlib import Path


# a time whose GPU work is under this share of it is mostly the host's: the tables say so
HOST_BOUND = 0.8


def _gpu_note(r: dict) -> str:
    """What follows a time that is mostly the host's (HOST_BOUND): its GPU time; else nothing."""
    gpu = r.get("gpu_us")
    return f" (GPU {gpu:.1f})" if gpu is not None and "us" in r and gpu < HOST_BOUND * r["us"] else ""


def table(result: dict):
    from rich.table import Table

    meta = result["meta"]
    t = Table(title=f"{meta['gpu']} - copy {meta['copy_bandwidth_GBps']:.0f} GB/s - torch {meta['torch']}, "
                    f"triton {meta['triton']}, fbgemm {meta['fbgemm_gpu']}, commit {meta['commit'][:10]}")
    for col in ("workload", "provider", "us", "GB/s", "% roofline", "rows rate GB/s", "vs torch", "vs fbgemm", "note"):
        t.add_column(col, justify="left" if col in ("workload", "provider", "note") else "right")
    last = None
    for r in result["rows"]:
        note = r.get("skipped") or r.get("error") or ("" if r.get("matches_first", True) else "MISMATCH")
        if "host_us_per_call" in r:  # (after a MISMATCH, never in its place)
            note = ", ".join(filter(None, [note, f"host {r['host_us_per_call']:.0f} us/call" + (
                f", graph {r['graph_us']:.1f} us" if r.get("graph_us") else "")]))
        fmt = lambda k, f: f.format(r[k]) if k in r else "-"  # noqa: E731
        t.add_row(r["workload"] if r["workload"] != last else "", r["provider"], fmt("us", "{:.1f}") + _gpu_note(r),
                  fmt("GBps", "{:.0f}"), fmt("pct_roofline", "{:.0f}%"), fmt("rows_rate_GBps", "{:.0f}"),
                  fmt("speedup_vs_torch", "{:.2f}x"), fmt("speedup_vs_fbgemm", "{:.2f}x"), note[:60])
        last = r["workload"]
    return t


def markdown(result: dict) -> str:
    """The README's table: one row per workload, time per provider and embfuse's % of roofline."""
    providers = list(dict.fromkeys(r["provider"] for r in result["rows"]))
    lines = ["| workload | " + " | ".join(f"{p} (us)" for p in providers) + " | embfuse % of roofline |",
             "|---" * (len(providers) + 2) + "|"]
    by = {}
    for r in result["rows"]:
        by.setdefault(r["workload"], {})[r["provider"]] = r
    for name, group in by.items():
        cells = [f"{group[p]['us']:.1f}" + _gpu_note(group[p]) if p in group and "us" in group[p] else "-"
                 for p in providers]
        pct = group.get("embfuse", {}).get("pct_roofline")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {pct:.0f}% |" if pct else f"| {name} | "
                     + " | ".join(cells) + " | - |")
    if any(_gpu_note(r) for r in result["rows"]):
        lines.append(f"\n(GPU x): the GPU's own time a call, where it is under {HOST_BOUND:.0%} of the time "
                     "measured: that time is mostly the host's.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Rows rate against batch size, per provider, for the fixed-hotness fp32 grid; roofline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = {w["name"]: w for w in result["workloads"]}
    grid = [r for r in result["rows"] if specs[r["workload"]]["group"] == "grid" and "us" in r]
    keys = sorted({(specs[r["workload"]]["dim"], specs[r["workload"]]["dist"], specs[r["workload"]]["alpha"])
                   for r in grid})
    if not keys:
        return
    dims = sorted({k[0] for k in keys})
    dists = sorted({k[1:] for k in keys})
    fig, axes = plt.subplots(len(dims), len(dists), figsize=(4 * len(dists), 3.2 * len(dims)), squeeze=False)
    bw = result["meta"]["copy_bandwidth_GBps"]
    for dim, dist, alpha in keys:
        ax = axes[dims.index(dim)][dists.index((dist, alpha))]
        sel = [r for r in grid if (specs[r["workload"]]["dim"], specs[r["workload"]]["dist"],
                                   specs[r["workload"]]["alpha"]) == (dim, dist, alpha)]
        for provider in dict.fromkeys(r["provider"] for r in sel):
            pts = sorted((specs[r["workload"]]["batch"], r["rows_rate_GBps"]) for r in sel if r["provider"] == provider)
            ax.plot(*zip(*pts), marker="o", label=provider)
        roof = sorted({(specs[r["workload"]]["batch"], r["rows_bytes"] / (r["min_bytes"] / bw)) for r in sel})
        ax.plot(*zip(*roof), "k--", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"D={dim} {dist}{' ' + str(alpha) if alpha else ''}")
        ax.set_xlabel("batch (bags of 64)")
        ax.set_ylabel("rows rate (GB/s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"embedding_bag forward, fp32, 10M rows - {result['meta']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_result(result: dict, out: Path, name: str, markdown) -> Path:
    """`result` as `name`.json and `markdown(result)` as `name`.md in `out`; the .md's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result) + "\n")
    return out / f"{name}.md"
