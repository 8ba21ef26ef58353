"""What the persisting window gives when the ids cost nothing to rewrite (the ceiling of
`pin_hot_rows_in_l2`), against the rewrite's own cost, for budgets of 8, 16 and 31 MB.

One table of 10M rows, power-law ids (1.05), B65536 x L64, D32 and D128; the hot set counted
from another batch (ops/residency.py `choose`, budget capped here). Per budget: the rewrite as a
pass of its own (the check kernel run without checking), the plain kernel on the rewritten ids
without and with the window, and both together. Kernel times (triton do_bench, L2 flushed).
Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/residency/window_ceiling.py
"""

import torch
from triton.testing import do_bench

from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops import l2
from embfuse.ops.embedding_bag import embedding_bag_forward
from embfuse.ops.residency import Resident, choose, copy_hot, layout
from embfuse.ops.validate import remap_ids


def us(fn):
    return do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3


def measure(D, dev="cuda", rows=10_000_000) -> str:
    w = Workload("p", "bag", rows, D, 65536, 64, "powerlaw", 1.05)
    ids = generate_batch(w, dev, 0)[0].reshape(-1)
    counted = generate_batch(w, dev, 1)[0].reshape(-1)
    offsets = torch.arange(0, ids.numel() + 1, 64, device=dev)
    weight = torch.randn(rows, D, device=dev)

    def lookup(i):
        return embedding_bag_forward(weight, i, offsets, None, 0, -1)[0]

    line = f"D{D} B65536 L64: plain {us(lambda: lookup(ids)):.1f} us"
    for mb in (8, 16, 31):
        l2.reset()  # the previous budget's lines persist otherwise
        hs = choose(counted, [0, rows], [D * 4], mb << 20)
        hot = torch.empty(hs.nbytes // 4 + D, device=dev)
        elem, rel = layout([weight], hot, hs)
        copy_hot(hot, [weight], hs, [0, rows], elem)
        res = Resident(hot, hs.words, torch.tensor([[0, rows, rel[0]]], device=dev), True, hot.numel() * 4)
        new = remap_ids(ids, None, None, 1, res, rows)
        assert torch.equal(lookup(new), lookup(ids))
        l2.reserve(res.window)

        def windowed(i):
            with l2.persisting(hot, res.window):
                lookup(i)

        line += (f" | {mb} MB: {hs.nbytes / 2**20:.1f} MB taken, hit {hs.hit_rate:.2f}, rewrite "
                 f"{us(lambda: remap_ids(ids, None, None, 1, res, rows)):.1f}, rewritten ids "
                 f"{us(lambda: lookup(new)):.1f}, + window {us(lambda: windowed(new)):.1f}, rewrite + window "
                 f"{us(lambda: windowed(remap_ids(ids, None, None, 1, res, rows))):.1f}")
    return line


def main():
    print(f"{torch.cuda.get_device_name()}: max persisting L2 {l2.support().max_persisting_bytes / 2**20:.1f} MB")
    for D in (128, 32):
        print(measure(D), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
