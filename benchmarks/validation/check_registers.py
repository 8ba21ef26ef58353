"""The keyed batch's check with and without tuning.CHECK_MAXNREG (one device call): GPU time per
call of the check kernel (profiler, L2 flushed before each call, 20 calls; the two settings
alternated twice in one process), and each compiled variant's registers and spills. The
26-table Criteo-like collection (D128, power-law ids, bags of 1-39), forward with default checks,
at three batch sizes (the two larger ones also write the narrowed ids), and the fused SGD step
with the bench's hot rows at B16384 (the check that also remaps hot ids).

    PYTHONPATH=src python3 benchmarks/validation/check_registers.py
"""

import ast

import torch

from embfuse.bench.collection import HOT_ROWS, make_batch, make_collection
from embfuse.bench.runner import gpu_kernels
from embfuse.bench.workloads import Workload
from embfuse.ops import check_kernels, tuning
from embfuse.optim import SGD

CALLS = 20
SETTINGS = (None, tuning.CHECK_MAXNREG)


def case(batch: int, train: bool):
    w = Workload("v", "collection", 10_000_000, 128, batch, 20, "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    if not train:
        ebc = make_collection(w, "cuda")

        def call():
            with torch.no_grad():
                ebc(kjt)
        return call
    ebc = make_collection(w, "cuda", SGD(lr=0.01), hot_rows=HOT_ROWS)

    def step():
        ebc(kjt).values().sum().backward()
    return step


for batch, train in ((2048, False), (16384, False), (65536, False), (16384, True)):
    fn = case(batch, train)
    seen = {s: [] for s in SETTINGS}
    for _ in range(2):
        for s in SETTINGS:
            tuning.CHECK_MAXNREG = s
            for _ in range(2):
                fn()
            per = gpu_kernels(fn, CALLS)
            check = sum(us for k, us in per.items() if k.startswith("_check_bags_kernel"))
            seen[s].append((check, sum(per.values())))
    what = f"B{batch} {'SGD step, hot rows' if train else 'forward'}"
    cells = ("maxnreg {}: {}".format(s, " / ".join(f"{c:5.1f}, {a:6.1f}" for c, a in v)) for s, v in seen.items())
    print(f"{what:26s} check, all kernels: " + "   ".join(cells) + " us", flush=True)
tuning.CHECK_MAXNREG = SETTINGS[1]
names = [p.name for p in check_kernels._check_bags_kernel.params]
for entry in check_kernels._check_bags_kernel.device_caches.values():
    for key, kernel in entry[0].items():
        spec, options = str(key).split("]{", 1)
        args = dict(zip(names, ast.literal_eval(spec + "]")))
        print(f"variant: registers {kernel.n_regs}, spills {kernel.n_spills}, {{{options[:-1]}}}, "
              + ", ".join(f"{k}={args[k][1]}" for k in ("CHUNKS", "CHECK", "REMAP", "HOT")))
