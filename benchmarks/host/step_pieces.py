"""Host time of the Criteo-like collection's fused training step at B2048 (26 tables x 128,
power-law ids, bags of 1-99, fused SGD), checked by default and `off`, by piece: each piece's
inclusive host time a step from wrappers around the module's forward, the check, the device
log, the lookup, the update (the fused backward), the backward inputs, the sort with its
Segments and the reduction's launches; three runs of 200 steps back to back, the two modes
alternating. Then the host time of a tiny autograd backward (what any step pays to enter the
engine).

    PYTHONPATH=src python3 benchmarks/host/step_pieces.py
"""

import functools
import time

import torch

import embfuse
import embfuse.nn.collection as nc
import embfuse.ops.deferred as dd
import embfuse.ops.segments as sg
import embfuse.optim.fused as of
import embfuse.optim.lookup as ol
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

B = 2048
w = Workload("c", "collection-train", 10_000_000, 128, B, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, "cuda")
grad = torch.randn(B, 128 * 26, device="cuda")
spent = {}


def timed(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, g)


timed(nc.EmbeddingBagCollection, "forward", "forward (module)")
timed(nc, "validate_collection", "validate_collection")
timed(dd.DeviceLog, "start", "DeviceLog.start")
timed(nc, "fused_embedding_bag_collection", "fused lookup (forward)")
timed(ol, "pool_collection", "pool_collection")
timed(ol._CollectionCall, "update", "update (backward)")
timed(of, "backward_inputs", "backward_inputs")
timed(sg.Segments, "__init__", "Segments() with the sort")
timed(sg.Segments, "launch", "Segments.launch (levels)")
steps = {}
for mode in ("deferred", "off"):
    ebc = make_collection(w, "cuda", embfuse.optim.SGD(lr=0.01), bounds_check=mode)
    steps[mode] = lambda ebc=ebc: ebc(kjt).values().backward(grad)
    for _ in range(30):
        steps[mode]()
torch.cuda.synchronize()
for run in range(3):  # the modes alternate, run after run: the machine's drift hits both alike
    for mode, step in steps.items():
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(200):
            step()
        total = (time.perf_counter() - t0) * 5e3
        torch.cuda.synchronize()
        print(f"{mode} run {run}: step {total:.0f} us of host time; "
              + "; ".join(f"{k} {v * 5e3:.0f}" for k, v in sorted(spent.items())), flush=True)


def tiny():
    (torch.ones((), device="cuda", requires_grad=True) * 2).backward()


for _ in range(20):
    tiny()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(300):
    tiny()
print(f"a tiny backward: {(time.perf_counter() - t0) / 300 * 1e6:.1f} us of host time")
torch.cuda.synchronize()
embfuse.check_errors()
