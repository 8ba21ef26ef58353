"""Host time of a small lookup without gradients (D64 B512 L8) in each of torch's 1-D offsets
forms: B bag starts (nn.EmbeddingBag's default) and B + 1 with include_last_offset (the bench's
latency row). torch, embfuse `off` and the default, back to back, 2000 calls a round, 9 rounds
interleaved; median and least of the rounds. Run it on two trees to compare them.

    PYTHONPATH=src python3 benchmarks/host/host_offsets.py
"""

import torch

import embfuse
from embfuse.bench.runner import host_us

w = torch.randn(100_000, 64, device="cuda")
ids = torch.randint(0, 100_000, (512 * 8,), device="cuda")
starts = torch.arange(0, 512 * 8, 8, device="cuda")
last = torch.arange(0, 512 * 8 + 1, 8, device="cuda")
F = torch.nn.functional
CALLS = {
    "torch_last": lambda: F.embedding_bag(ids, w, last, mode="sum", include_last_offset=True),
    "default_last": lambda: embfuse.embedding_bag(ids, w, last, mode="sum", include_last_offset=True),
    "torch": lambda: F.embedding_bag(ids, w, starts, mode="sum"),
    "off": lambda: embfuse.embedding_bag(ids, w, starts, mode="sum", bounds_check="off"),
    "default": lambda: embfuse.embedding_bag(ids, w, starts, mode="sum"),
}


if __name__ == "__main__":
    with torch.no_grad():
        for fn in CALLS.values():
            for _ in range(300):
                fn()
        seen = {k: [] for k in CALLS}
        for _ in range(9):
            for k, fn in CALLS.items():
                seen[k].append(host_us(fn, 2000))
    print("median", {k: round(sorted(v)[4], 1) for k, v in seen.items()})
    print("least", {k: round(min(v), 1) for k, v in seen.items()})
