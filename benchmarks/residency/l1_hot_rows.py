"""Hot rows kept in L1 by sending the cold rows around it: a probe of issue 25's next lever.

The window's ceiling is the L2's throughput (benchmarks/NOTES.md, session 47: L2 at 87% of its
peak at D128, L1 already serving about 38% of the sectors, about what the hottest 128 rows would
give). If the cold rows bypassed L1 (`ld.global.cg`), L1 would hold only the hottest rows, and
the hottest 445 rows (one SM's 228 KB at D128) serve 47.5% of the lookups.

One table of 10M rows, ids numbered by frequency (power-law 1.05, "ranked": hot ids are the
small ids, so a row is hot when id < l1_rows), B65536 x L64, D128 and D32. A probe kernel shaped
as the library's pooling (one warp a bag, 256-element tiles) pools each bag's rows, with:
  plain     every load as the library's (default caching);
  all .cg   every row and id load bypasses L1;
  steer N   ids and rows with id >= N bypass L1, rows with id < N are cached in L1 (two masked
            loads a tile);
each without and with a persisting window over the hottest rows (`choose`'s size, in place),
each case from an L2 with no persisting line (they survive do_bench's flush; the last line
shows what a plain call reads after a windowed run when they are kept).
The library's own lookup on the same ids is timed beside it. Kernel times (do_bench, L2 flushed).
Run on a GPU from the repository root: PYTHONPATH=src python benchmarks/residency/l1_hot_rows.py
"""

import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from embfuse.bench.workloads import Workload, generate_batch
from embfuse.ops import l2
from embfuse.ops.embedding_bag import embedding_bag_forward
from embfuse.ops.residency import choose


@triton.jit
def _pool(weight, ids_ptr, out, l1_rows, L: tl.constexpr, D: tl.constexpr, BLOCK_L: tl.constexpr,
          STEER: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK_L, D], dtype=tl.float32)
    for s in range(0, L, BLOCK_L):
        pos = b * L + s + tl.arange(0, BLOCK_L)
        if STEER == 0:
            ids = tl.load(ids_ptr + pos)
            rows = tl.load(weight + ids[:, None] * D + cols[None, :])
        elif STEER == 1:
            ids = tl.load(ids_ptr + pos, cache_modifier=".cg")
            rows = tl.load(weight + ids[:, None] * D + cols[None, :], cache_modifier=".cg")
        else:
            ids = tl.load(ids_ptr + pos, cache_modifier=".cg")
            hot = (ids < l1_rows)[:, None] & (cols[None, :] < D)
            ptrs = weight + ids[:, None] * D + cols[None, :]
            rows = (tl.load(ptrs, mask=hot, other=0.0, cache_modifier=".ca")
                    + tl.load(ptrs, mask=~hot, other=0.0, cache_modifier=".cg"))
        acc += rows
    tl.store(out + b * D + cols, tl.sum(acc, axis=0))


def us(fn):
    return do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3


def ranked_batch(D, dev, rows, B, L):
    """The probes' case: ids numbered by frequency (B bags of L), another batch's ids (what the
    hot set is counted from), B + 1 offsets, the table, and `choose`'s hot set for it."""
    w = Workload("r", "bag", rows, D, B, L, "ranked", 1.05)
    ids = generate_batch(w, dev, 0)[0].reshape(-1).contiguous()
    counted = generate_batch(w, dev, 1)[0].reshape(-1)
    offsets = torch.arange(0, ids.numel() + 1, L, device=dev)
    weight = torch.randn(rows, D, device=dev)
    return ids, counted, offsets, weight, choose(counted, [0, rows], [D * 4], l2.support().max_persisting_bytes)


def window_lines(cases, weight, window, width):
    """A line a (name, call): its kernel time without and with the persisting window over the
    first `window` bytes of `weight`, each case from an L2 with no persisting line (they survive
    do_bench's flush)."""
    lines = []
    l2.reserve(window)
    for name, fn in cases:
        l2.reset()
        plain = us(fn)

        def windowed(fn=fn):
            with l2.persisting(weight, window):
                fn()

        lines.append(f"  {name:{width}s} {plain:7.1f} us, with the window {us(windowed):7.1f} us")
    return lines


def measure(D, dev="cuda", rows=10_000_000, B=65536, L=64):
    ids, counted, offsets, weight, hs = ranked_batch(D, dev, rows, B, L)
    out = torch.empty(B, D, device=dev)
    block_l = max(1, 256 // D)
    window = hs.nbytes
    lines = [f"D{D} B{B} L{L}: window {window / 2**20:.1f} MB ({hs.in_place is not None and 'in place' or 'copy'}),"
             f" hit {hs.hit_rate:.2f}"]

    def probe(steer, n=0):
        probe.kernel = _pool[(B,)](weight, ids, out, n, L=L, D=D, BLOCK_L=block_l, STEER=steer, num_warps=1)
        return out

    ref = embedding_bag_forward(weight, ids, offsets, None, 0, -1)[0]
    for steer in (0, 1, 2):
        torch.testing.assert_close(probe(steer, 256), ref, rtol=1e-5, atol=1e-4)
        sass = probe.kernel.asm.get("sass", "") or ""
        ptx = probe.kernel.asm["ptx"]
        if os.environ.get("PTX_DIR"):
            with open(f"{os.environ['PTX_DIR']}/pool-D{D}-steer{steer}.ptx", "w") as f:
                f.write(ptx)
        lines.append(f"  (steer={steer}: ptx ld.global.ca {ptx.count('ld.global.ca')}, .cg {ptx.count('ld.global.cg')},"
                     f" plain {ptx.count('ld.global.v') + ptx.count('ld.global.b') - ptx.count('ld.global.cg')};"
                     f" sass LDG.E {sass.count('LDG.E')}, .STRONG.GPU {sass.count('STRONG.GPU')})")
    cases = [("library", lambda: embedding_bag_forward(weight, ids, offsets, None, 0, -1)),
             ("plain", lambda: probe(0)), ("all .cg", lambda: probe(1))]
    for n in ((128, 256, 384, 512, 1024) if D == 128 else (512, 1024, 1536, 2048, 4096)):
        share = (counted < n).float().mean().item()
        cases.append((f"steer {n} ({share:.1%} of lookups)", lambda n=n: probe(2, n)))
    lines += window_lines(cases, weight, window, 32)
    # what this probe's first run did: a plain call timed after a windowed run, lines not reset
    lines.append(f"  plain, after the window's run, lines kept: {us(cases[1][1]):7.1f} us")
    l2.reset()
    return "\n".join(lines)


def report(what, measure, dims):
    """The GPU, `what` ran the probe, the device's persisting L2; then `measure(D)` for each D."""
    mb = l2.support().max_persisting_bytes / 2**20
    print(f"{torch.cuda.get_device_name()}, {what}: max persisting L2 {mb:.1f} MB")
    for D in dims:
        print(measure(D), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    report(f"triton {triton.__version__}", measure, (128, 32))
