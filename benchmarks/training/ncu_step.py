"""One training step of embfuse and of FBGEMM, bracketed for Nsight Compute: where each kernel's
bytes come from (DRAM or L2) and how busy it keeps the GPU. Only the bracketed step is profiled.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \
        python3 benchmarks/training/ncu_step.py {train26 | criteo [batch]} {embfuse | fbgemm} > OUT.csv

(FBGEMM from the build of ../shared/peers/fbgemm_for_device.sh on PYTHONPATH.) The H100
machines' ncu reads the counters (Firecracker runtime); one step of each is a minute or so.
"""

import sys

import torch

from embfuse.bench.collection import COLLECTION_PROVIDERS, make_batch
from embfuse.bench.train import TRAIN_PROVIDERS, batches
from embfuse.bench.workloads import Workload

which, provider = sys.argv[1], sys.argv[2]
if which == "train26":
    w = Workload("t", "train", 1_000_000, 128, 16384, 20, "powerlaw", 1.05, tables=26)
    step, _keep = TRAIN_PROVIDERS["embfuse-ebc" if provider == "embfuse" else provider](w, batches(w, "cuda"), "cuda")
else:
    w = Workload("c", "collection-train", 10_000_000, 128, int(sys.argv[3]) if len(sys.argv) > 3 else 16384, 50,
                 "powerlaw", 1.05, tables=26)
    kjt = make_batch(w, "cuda")
    forward, _opt, _move, _keep = COLLECTION_PROVIDERS[provider](w, kjt, "cuda", True)
    grad = torch.randn(w.batch, w.dim * w.tables, device="cuda")

    def step():
        forward(kjt).backward(grad)

for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
