"""How fast can one table's check read its ids? The default-path row's ids (one table D128 B65536
L64, 4.2M int64, 33.5 MB), L2 flushed before each call: kernel times (profiler, 30 calls) of
torch's amax and clone, a bare Triton read (a block max, one atomic a program) and embfuse's check
kernel in a default lookup.

    PYTHONPATH=src python3 benchmarks/validation/ids_read_floor.py
"""

import torch
import triton

import embfuse
from embfuse.bench.workloads import Workload, generate_batch
from values_read_floor import kernel_times, read_max_kernel  # (this folder is on the path)

w = Workload("one table", "bag", 10_000_000, 128, 65536, 64, "powerlaw", 1.05)
table = torch.randn(w.rows, w.dim, device="cuda")
ids, _ = generate_batch(w, "cuda")
ids = ids.reshape(-1).contiguous()
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
out = torch.zeros(1, dtype=torch.int64, device="cuda")
n = ids.numel()
cases = {
    "torch amax": lambda: ids.amax(),
    "torch clone": lambda: ids.clone(),
    "triton max 2048/4w": lambda: read_max_kernel[(triton.cdiv(n, 2048),)](ids, n, out, BLOCK=2048, CHUNKS=1,
                                                                          num_warps=4),
    "triton max 4096/8w": lambda: read_max_kernel[(triton.cdiv(n, 4096),)](ids, n, out, BLOCK=4096, CHUNKS=1,
                                                                          num_warps=8),
    "embfuse check": lambda: embfuse.embedding_bag(ids.view(65536, 64), table),
}
with torch.no_grad():
    for name, f in cases.items():
        print(name, kernel_times(f, 30, True, flush, drop=()), flush=True)
print("ids MB", ids.numel() * 8 / 1e6)
