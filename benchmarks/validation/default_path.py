"""The default path against `off`, `sync` and the peers, in one run (issue: safe by default at full
speed). Rows: the 26-table Criteo-like collection (power-law ids, bags of 1-99, fused SGD)
forward and training step at B2048 and B16384; one table D128 L64 at B2048 and B65536; the DLRM
inference shape (12 x 500K x 128, B2048 L150); the host-bound call (D64 B512 L8) with host time
and launches per call. Providers: embfuse default ("deferred"), embfuse-off, embfuse-sync (the
old default: reads the check back every call), FBGEMM's default (WARNING) and NONE, torch.

    PYTHONPATH=src python benchmarks/validation/default_path.py [OUT_DIR]
"""

import functools
import json
import sys
from pathlib import Path

import torch

import embfuse
from embfuse.bench import collection, providers, runner
from embfuse.bench.workloads import Workload

providers.PROVIDERS["embfuse-sync"] = lambda w, t, i, o: providers._lookup(
    functools.partial(embfuse.embedding if w.kind == "embedding" else embfuse.embedding_bag, bounds_check="sync"),
    w, t, i, o)
collection.COLLECTION_PROVIDERS["embfuse-sync"] = functools.partial(collection._embfuse, bounds_check="sync")
collection.COLLECTION_PROVIDERS.pop("embfuse-hot")
collection.COLLECTION_PROVIDERS.pop("torchrec")

BAG = ["torch", "embfuse", "embfuse-off", "embfuse-sync", "fbgemm", "fbgemm-none"]


def main(out: Path) -> None:
    device = torch.device("cuda")
    bandwidth = runner.copy_bandwidth(device)
    single = [Workload("one table D128 L64, B2048", "bag", 10_000_000, 128, 2048, 64, "powerlaw", 1.05),
              Workload("one table D128 L64, B65536", "bag", 10_000_000, 128, 65536, 64, "powerlaw", 1.05),
              Workload("dlrm 12 x 500K x 128, B2048 L150", "bag", 500_000, 128, 2048, 150, tables=12),
              Workload("latency D64 B512 L8", "bag", 100_000, 64, 512, 8, group="latency")]
    coll = [Workload(f"{kind} 26 criteo x 128, B{b} L1-99 powerlaw1.05", kind, 10_000_000, 128, b, 50, "powerlaw",
                     1.05, tables=26, group="collection")
            for b in (2048, 16384) for kind in ("collection", "collection-train")]
    runner.measure(single[0], BAG, device)  # warm-up
    rows = []
    for w in single:
        rows += runner.measure(w, BAG, device)
        print(w.name, "done", flush=True)
    for w in coll:
        rows += collection.measure_collection(w, device)
        print(w.name, "done", flush=True)
    runner.derive(rows, bandwidth)
    result = {"meta": runner.metadata(device, bandwidth), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "default_path.json").write_text(json.dumps(result, indent=1))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    print(f"\n{result['meta']['gpu']}, torch {result['meta']['torch']}, fbgemm {result['meta']['fbgemm_gpu']}, "
          f"commit {result['meta']['commit'][:8]}; us (median)")
    print("| workload | " + " | ".join(names) + " | default / off |")
    print("|---" * (len(names) + 2) + "|")
    by = {}
    for r in rows:
        by.setdefault(r["workload"], {})[r["provider"]] = r
    for wname, group in by.items():
        cells = []
        for p in names:
            r = group.get(p, {})
            cell = f"{r['us']:.0f}" if "us" in r else "-"
            if "host_us_per_call" in r:
                launches = f", {r['launches_per_call']} launches" if "launches_per_call" in r else ""
                cell += f" (host {r['host_us_per_call']:.0f}{launches})"
            if "error" in r:
                cell = "err"
            cells.append(cell)
        d, o = group.get("embfuse", {}).get("us"), group.get("embfuse-off", {}).get("us")
        ratio = f"{d / o:.3f}" if d and o else "-"
        print(f"| {wname} | " + " | ".join(cells) + f" | {ratio} |")
    for r in rows:
        if "error" in r:
            print("error:", r["workload"], r["provider"], r["error"])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "embfuse-out/default_path"))
