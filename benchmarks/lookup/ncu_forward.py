"""The forward bag kernel of embfuse and of FBGEMM on one issue-3 shape, bracketed for Nsight
Compute (what bounds a lookup whose rows mostly hit L2):

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 benchmarks/lookup/ncu_forward.py DIM BATCH {uniform | powerlaw | embedding} > OUT.csv

(FBGEMM from the build of ../shared/peers/fbgemm_for_device.sh on PYTHONPATH; `embedding`:
torch's embedding case, BATCH ids into a 1M-row table, beside torch's own kernel.)
"""

import sys

import torch

from embfuse.bench.providers import embfuse_unchecked, fbgemm_tbe, torch_native
from embfuse.bench.workloads import Workload, generate_batch

dim, batch, dist = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if dist == "embedding":
    w = Workload("e", "embedding", 1_000_000, dim, batch)
else:
    w = Workload("f", "bag", 10_000_000, dim, batch, 64, dist, 1.05 if dist == "powerlaw" else 0.0)
table = torch.randn(w.rows, dim, device="cuda")
ids, _ = generate_batch(w, "cuda")
peer = torch_native if dist == "embedding" else fbgemm_tbe
calls = [embfuse_unchecked(w, [table], ids, None), peer(w, [table], ids, None)]
for call in calls:
    for _ in range(3):
        call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for call in calls:
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
