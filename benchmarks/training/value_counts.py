"""What a batch's count of values, or of examples, costs when it is not a multiple of 16 (one device
call). Triton specialises an integer argument on divisibility by 16, so a kernel taking the count
compiles one variant for counts that are and one for counts that are not, unless the kernel says
do_not_specialize, as embfuse's do for both counts. A jagged batch's count of values is a multiple
of 16 one time in 16; fixed-hotness benchmarks always are, and benchmark batch sizes too. Same
batches, with the last values (or the last example) dropped so that the count is 0 or 15 modulo 16,
default checks: GPU time per kernel (profiler, L2 flushed before each call, 20 calls, the two
variants alternated twice). `--examples`: the count of examples; without it, of values.

    PYTHONPATH=src python3 benchmarks/training/value_counts.py [--examples]
"""

import sys
from collections import defaultdict

import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.runner import gpu_kernels
from embfuse.bench.workloads import Workload, generate_batch

CALLS = 20
EXAMPLES = "--examples" in sys.argv[1:]


def drop_tail(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """lengths with k values taken off the last bags."""
    lengths = lengths.clone()
    i = lengths.numel() - 1
    while k:
        take = min(k, int(lengths[i]))
        lengths[i] -= take
        k -= take
        i -= 1
    return lengths


def counts(n: int, name: str = "n") -> dict[str, int]:
    """values (or examples) to drop for a count that is a multiple of 16, and for one that is not"""
    return {f"{name} % 16 == 0": n % 16, f"{name} % 16 == 15": (n % 16 + 1) % 16 or 16}


def single(optimizer, batch=16384, hotness=20, bounds_check="deferred"):
    w = Workload("v", "bag", 1_000_000, 128, batch, hotness, "powerlaw", 1.05, layout="csr")
    ids, offsets = generate_batch(w, "cuda")
    module = embfuse.nn.EmbeddingBag(w.rows, w.dim, mode="sum", optimizer=optimizer, device="cuda",
                                     bounds_check=bounds_check)
    lengths = offsets.diff()
    out = {}
    if EXAMPLES:  # the first B - k bags
        for name, k in counts(batch, "B").items():
            out[name] = (ids[:int(offsets[batch - k])], offsets[:batch - k])
        return module, out
    for name, k in counts(ids.numel()).items():
        cut = drop_tail(lengths, k)
        starts = torch.cat([cut.new_zeros(1), cut.cumsum(0)[:-1]])
        out[name] = (ids[:ids.numel() - k], starts)
    return module, out


def gather(optimizer):
    w = Workload("v", "embedding", 1_000_000, 128, 327680, dist="powerlaw", alpha=1.05)
    ids = generate_batch(w, "cuda")[0]
    module = embfuse.nn.Embedding(w.rows, w.dim, optimizer=optimizer, device="cuda")
    return module, {name: (ids[:ids.numel() - k],) for name, k in counts(ids.numel()).items()}


def collection(optimizer):
    w = Workload("v", "collection", 10_000_000, 128, 16384, 20, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    ebc = make_collection(w, "cuda", optimizer)
    out = {}
    if EXAMPLES:  # each feature's first B - k examples
        for name, k in counts(w.batch, "B").items():
            keep = torch.arange(w.batch, device="cuda").repeat(w.tables) < w.batch - k
            lengths = kjt.lengths()[keep]
            values = kjt.values()[torch.repeat_interleave(keep, kjt.lengths())]
            out[name] = (embfuse.KeyedJaggedTensor(kjt.keys(), values, lengths=lengths, stride=w.batch - k,
                                                   length_per_key=lengths.view(w.tables, -1).sum(1).tolist()),)
        return ebc, out
    for name, k in counts(kjt.values().numel()).items():
        lengths = drop_tail(kjt.lengths(), k)
        out[name] = (embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values()[:kjt.values().numel() - k], lengths=lengths,
                                               stride=w.batch,
                                               length_per_key=lengths.view(w.tables, w.batch).sum(1).tolist()),)
    return ebc, out


def step_of(module, batch, train):
    def forward():
        with torch.no_grad():
            module(*batch)

    def step():
        out = module(*batch)
        (out if isinstance(out, torch.Tensor) else out.values()).sum().backward()
    return step if train else forward


def kernels(fn) -> dict[str, float]:
    for _ in range(2):  # (gpu_kernels calls it once more before it profiles)
        fn()
    per = defaultdict(float)
    for name, us in gpu_kernels(fn, CALLS).items():
        per[name[:60]] += us
    return per


CASES = (("one table 1M x 128, B16384 ~20 ids", single, (False, True)),
         ("one table 1M x 128, B65536 ~64 ids", lambda opt: single(opt, 65536, 64), (False,)),
         ("the same, bounds_check='off'", lambda opt: single(opt, 65536, 64, "off"), (False,)),
         ("embedding 1M x 128, 327680 ids", gather, (False, True)),
         ("26-table collection, B16384 ~20 ids", collection, (False, True)))
for case, build, trains in CASES:
    if EXAMPLES and build is gather:
        continue  # (no examples)
    for train in trains:
        module, batches = build(embfuse.optim.SGD(lr=0.01) if train else None)
        seen = defaultdict(lambda: defaultdict(list))
        for _ in range(2):
            for name, batch in batches.items():
                for k, us in kernels(step_of(module, batch, train)).items():
                    seen[k][name].append(us)
        title = f"{case}, {'fused SGD step' if train else 'forward'}"
        names = list(batches)
        print(f"==== {title}: us per call, two rounds each\n  {'kernel':60s} " + "  ".join(f"{n:>17s}" for n in names))
        totals = {n: [0.0, 0.0] for n in names}
        for k, by in sorted(seen.items(), key=lambda kv: -max(max(v) for v in kv[1].values())):
            cells = []
            for n in names:
                v = by.get(n, [])
                for r, x in enumerate(v):
                    totals[n][r] += x
                cells.append(" / ".join(f"{x:7.1f}" for x in v) if v else f"{'-':>17s}")
            print(f"  {k:60s} " + "  ".join(f"{c:>17s}" for c in cells))
        print(f"  {'all':60s} " + "  ".join(f"{t[0]:7.1f} / {t[1]:7.1f}" for t in totals.values()), flush=True)
