"""Host time of a small checked call by piece: torch's call, embfuse's in `off` and the default,
the checks' preparation, the device log, the check's launch and the pooling launch (D64 B512
L8, no grad; best of three runs of 4000 calls back to back).

    PYTHONPATH=src python3 benchmarks/host/host_parts.py
"""

import sys
import time

import torch

import embfuse
import embfuse.ops.embedding_bag  # noqa: F401 - the module (embfuse.ops.embedding_bag is also a function)
from embfuse.ops import check_kernels, deferred

validate = sys.modules["embfuse.ops.validate"]
eb = sys.modules["embfuse.ops.embedding_bag"]
w = torch.randn(100_000, 64, device="cuda")
ids = torch.randint(0, 100_000, (512, 8), device="cuda")
flat = ids.reshape(-1)
offs = torch.arange(0, 512 * 8 + 1, 8, device="cuda")
log = deferred.device_log(flat.device)


def t(name, fn, calls=4000):
    with torch.no_grad():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    print(f"{name:40s} {best:7.1f} us")


t("torch F.embedding_bag", lambda: torch.nn.functional.embedding_bag(ids, w, mode="sum"))
t("embfuse off", lambda: embfuse.embedding_bag(ids, w, mode="sum", bounds_check="off"))
t("embfuse deferred", lambda: embfuse.embedding_bag(ids, w, mode="sum"))
for mode in ("off", "deferred"):
    t(f"prepare_bags {mode}", lambda: eb.prepare_bags(ids, w, None, None, 2, False, "sum", 0, None, False, None, mode,
                                                      "input", fresh=False))
t("validate_bags deferred", lambda: validate.validate_bags(flat, offs, 100_000, shape=ids.shape, fresh=False))
t("log.start + poll", lambda: log.start(None, "x", fresh=False, track=False))
t("log.poll", log.poll)
c = log.start(None, "x", fresh=False, track=False)
t("launch_ids_check", lambda: check_kernels.launch_ids_check(log, c, flat, offs, 100_000))
t("pool (forward kernel) only", lambda: eb.pool(w, flat, offs, None, 0, -1, with_max_ids=False, status=None))
t("check_kernels._check_args", lambda: check_kernels._check_args(log, c, flat))
t("embfuse deferred again", lambda: embfuse.embedding_bag(ids, w, mode="sum"))
t("embfuse off again", lambda: embfuse.embedding_bag(ids, w, mode="sum", bounds_check="off"))
embfuse.check_errors()
