"""Does checking and pooling a collection's forward in feature groups let the pooling read the
check's int32 ids from L2 (85 MB of them at B16384)? (benchmarks/NOTES.md, session 39, "grouped
check"). The 26-table Criteo-like collection (D128, power-law ids, 1-99 ids a bag), forward under
no_grad: one collection over all features against G = 2/4/8 collections over consecutive feature
groups of about equal value counts, reading their tables inside the one collection's buffer
(sub-batches built outside the timing); default check and `off`. GPU time alone (residency/
gpu_time.py's method), three alternating rounds. `--smoke` runs the mechanics on the CPU.

    PYTHONPATH=src python3 benchmarks/validation/grouped_check.py [B] [--smoke]
"""
import os
import sys
import torch
import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.workloads import Workload
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "residency"))
from gpu_time import gpu_us  # noqa: E402

SMOKE = "--smoke" in sys.argv  # CPU, small: the mechanics only
DEV = "cpu" if SMOKE else "cuda"
args = [a for a in sys.argv[1:] if not a.startswith("--")]
B = int(args[0]) if args else (64 if SMOKE else 16384)
w = Workload("c", "collection", 1000 if SMOKE else 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
rows = table_rows(w)
kjt = make_batch(w, DEV)
per_key = kjt.length_per_key()
flush = None if SMOKE else torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def ebc(features, check, device="meta"):
    return embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(rows[f], 128, f"t{f}", feature_names=[f"f{f}"])
                                          for f in features], device=device, bounds_check=check)


base = ebc(range(26), "deferred", DEV)  # the one buffer every module below reads
starts = [t.storage_offset() for t in base.table_weights()]
sizes = [t.numel() for t in base.table_weights()]


def sharing(features, check):
    """A collection of consecutive `features` reading their tables inside `base`'s buffer."""
    m = ebc(features, check)
    a, b = features[0], features[-1]
    view = base.weights.detach()[starts[a]:starts[b] + sizes[b]]
    assert m.weights.numel() == view.numel(), (m.weights.numel(), view.numel())
    m.weights = torch.nn.Parameter(view)
    return m


def groups(G):
    """Consecutive features cut where the running value count passes each k/G of the total."""
    total, cuts, run = sum(per_key), [], 0
    for f, n in enumerate(per_key):
        run += n
        if len(cuts) < G - 1 and run >= total * (len(cuts) + 1) / G and f < 25:
            cuts.append(f + 1)
    bounds = [0] + cuts + [26]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


cases = {}
for check in ("deferred", "off"):
    whole = base if check == "deferred" else sharing(list(range(26)), check)
    cases[f"whole {check}"] = lambda m=whole: m(kjt)
    for G in (2, 4, 8):
        gs = groups(G)
        mods = [sharing(g, check) for g in gs]
        subs = kjt.split([len(g) for g in gs])
        subs = [embfuse.KeyedJaggedTensor(s.keys(), s.values().clone(), lengths=s.lengths().clone(), stride=B)
                for s in subs]
        cases[f"G{G} {check}"] = lambda mods=mods, subs=subs: [m(s) for m, s in zip(mods, subs)]
for G in (2, 4, 8):
    print(G, [len(g) for g in groups(G)])
print("cpu" if SMOKE else torch.cuda.get_device_name(), f"B{B}", "values", sum(per_key), flush=True)
times = {k: [] for k in cases}
with torch.no_grad():
    ref = base(kjt).values()
    for k, fn in cases.items():  # warm-up, compile, and the same output as one collection
        out = fn()
        got = torch.cat([o.values() for o in out], 1) if isinstance(out, list) else out.values()
        assert torch.equal(got, ref), k
    for _ in range(0 if SMOKE else 3):
        for k, fn in cases.items():
            times[k].append(gpu_us(fn, flush, reps=20))
for k, t in times.items() if not SMOKE else []:
    print(f"{k}: {min(t):.1f} us (rounds {', '.join(f'{x:.1f}' for x in t)})", flush=True)
