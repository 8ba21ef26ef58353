"""The collection check kernel alone, bracketed for Nsight Compute (issue 18: what bounds it),
on the Criteo-like collection forward (26 tables, B16384, bags 1-99, power-law), ids as int64
then int32:

    ncu --clock-control none --profile-from-start off --kernel-name regex:check_bags \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python3 benchmarks/validation/ncu_check.py
"""
import torch

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

w = Workload("c", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26, group="collection")
kjt = make_batch(w, "cuda", seed=0)
ebc = make_collection(w, "cuda")
batches = [embfuse.KeyedJaggedTensor(kjt.keys(), kjt.values().to(d), lengths=kjt.lengths().to(d), stride=kjt.stride(),
                                     length_per_key=kjt.length_per_key()) for d in (torch.int64, torch.int32)]
with torch.no_grad():
    for k in batches:
        for _ in range(3):
            ebc(k)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for k in batches:
        ebc(k)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
embfuse.check_errors()
