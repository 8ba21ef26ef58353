"""One GPU, no process group: the sharded collection's routing of the bench's 26-table batch for
2-rank plans, and its output assembly at world 2. Each against the path it replaced in d4bd304
(a per-id sort of the whole batch; split + cat + index_select), kept here for the A/B only.
`PYTHONPATH=src python benchmarks/distributed/routing.py` (NOTES, session 22)."""

import statistics
import time

import torch

import embfuse
from embfuse.bench.collection import make_batch, table_rows
from embfuse.bench.workloads import Workload
from embfuse.distributed.assembly import SideBySide, gather_reference, move_columns, move_table, scatter_reference
from embfuse.distributed.planner import plan_shards
from embfuse.distributed.routing import COUNTS, Routing
from embfuse.ops.bags import bag_of_value
from embfuse.ops.validate import collection_status
from embfuse.optim import RowWiseAdagrad

dev = torch.device("cuda", 0)
W, B = 2, 16384
w = Workload("criteo-sharded", "collection-train-rowwise", 1_000_000, 128, B, 20, "powerlaw", 1.05, "csr", tables=26)
cfgs = [embfuse.EmbeddingBagConfig(r, 128, f"t{i}", feature_names=[f"f{i}"]) for i, r in enumerate(table_rows(w))]
names = [f"f{i}" for i in range(26)]
kjt = make_batch(w, dev, seed=7)


def old_route(values, lengths, limits, block, copies, slot_of, nslots, F):
    Bs = B
    offsets = torch.zeros(F * B + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lengths.long(), 0, out=offsets[1:])
    collection_status(values, offsets, limits, B)
    n = values.numel()
    bag = bag_of_value(offsets, n).clamp(0, max(F * B - 1, 0))
    feat, sample = bag // Bs, bag % Bs
    limit = limits[feat]
    ids = torch.minimum(values.long().clamp(min=0), limit - 1)
    blk = block[feat]
    shard = ids // blk
    local = ids - shard * blk
    C = int(copies.max())
    copy = torch.arange(C, device=dev).repeat_interleave(n)
    feat_c, shard_c = feat.repeat(C), shard.repeat(C)
    slot = torch.where(copy < copies[feat_c], slot_of[feat_c, shard_c + copy], nslots)
    order = torch.sort(slot.int(), stable=True).indices
    ids_sorted = local.repeat(C)[order]
    count = torch.zeros((nslots + 1) * Bs, dtype=torch.int64, device=dev)
    count.index_add_(0, slot * Bs + sample.repeat(C), torch.ones_like(slot))
    lens = count.view(nslots + 1, Bs)[:nslots, :B]
    lens.sum(1).tolist()
    return ids_sorted


def timed(fn, reps=20):
    ts = []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


for label, spec in (("auto (table-wise)", None), ("two row-wise tables", {"t2": "row_wise", "t3": "row_wise"}),
                    ("four column-wise tables", {f"t{i}": "column_wise" for i in (2, 3, 11, 15)})):
    plan = plan_shards(cfgs, W, spec, optimizer=RowWiseAdagrad(lr=0.01), memory_per_rank=2**40)
    entries = [[f"f{int(s.table[1:])}" for s in plan.local(r)] for r in range(W)]
    slot_base = [0]
    for e in entries:
        slot_base.append(slot_base[-1] + len(e))
    shards = [plan.shards[f"t{i}"] for i in range(26)]
    kinds = [plan.types[f"t{i}"] for i in range(26)]
    rows = [c.num_embeddings for c in cfgs]
    routing = Routing(names, names, shards, kinds, rows, entries, slot_base, False, dev)
    H = routing.header_width

    def new():
        header, routed = routing.route(kjt)
        counts = header.view(W, H).tolist()
        routing.send_buffers(routed, [c for d in range(W) for c in counts[d][COUNTS:COUNTS + len(entries[d])]])

    copies = [len(s) if k == "column_wise" else 1 for s, k in zip(shards, kinds)]
    width = max(len(s) for s in shards) + max(copies)
    slot_of = torch.full((26, width), slot_base[-1], dtype=torch.int64)
    for i, (f, ss) in enumerate(zip(names, shards)):
        for j, s in enumerate(ss):
            slot_of[i, j] = slot_base[s.rank] + entries[s.rank].index(f)
    block = [ss[0].rows if k == "row_wise" else r for ss, k, r in zip(shards, kinds, rows)]
    args = (kjt.values(), kjt.lengths(), routing.limits, torch.tensor(block, device=dev),
            torch.tensor(copies, device=dev), slot_of.to(dev), slot_base[-1], 26)
    print(f"{label}: routing, old {timed(lambda: old_route(*args)):.0f} us, new {timed(new):.0f} us "
          f"({kjt.values().numel() / 1e6:.2f}M ids)", flush=True)

# the output assembly at world 2: rank 0's 12 features and rank 1's 14, interleaved in the output
widths = [12 * 128, 14 * 128]
owner = [0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1]
start, at, index, moves = [0, widths[0]], [0, 0], [], []
for c, r in enumerate(owner):
    index += list(range(start[r] + at[r], start[r] + at[r] + 128))
    moves.append((r, at[r], 128, c * 128))
    at[r] += 128
index = torch.tensor(index, device=dev)
table = move_table(moves, widths, dev)
recv = torch.randn(B * sum(widths), device=dev, requires_grad=True)
g = torch.randn(B, 26 * 128, device=dev)


def old_assembly():
    blocks = torch.split(recv, [B * w for w in widths])
    side = torch.cat([b.view(B, w) for b, w in zip(blocks, widths)], dim=1)
    side = torch.cat([side, side.new_zeros(B, 1)], dim=1)
    side.index_select(1, index).backward(g)
    recv.grad = None  # (else each run also adds into the last run's gradient)


def new_assembly():
    SideBySide.apply(recv, B, widths, moves, table, recv.dtype).backward(g)
    recv.grad = None


a = SideBySide.apply(recv, B, widths, moves, table, recv.dtype)
blocks = torch.split(recv, [B * w for w in widths])
side = torch.cat([b.view(B, w) for b, w in zip(blocks, widths)], dim=1)
assert torch.equal(a, side.index_select(1, index))
def cat_assembly():  # SideBySide's torch path (the CPU's): torch.cat of column slices each way
    gather_reference(recv.detach(), B, widths, moves)
    scatter_reference(g, B, widths, moves)


print(f"assembly of {B} x {26 * 128} fp32, forward + backward: old {timed(old_assembly):.0f} us, "
      f"torch.cat of runs {timed(cat_assembly):.0f} us, new {timed(new_assembly):.0f} us", flush=True)


def events(fn, reps=30):
    """Median GPU time of `fn` (CUDA events), us."""
    ts = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(start.elapsed_time(end) * 1e3)
    return statistics.median(ts)


side, out = recv.detach(), torch.empty(B, 26 * 128, device=dev)
print(f"each way alone (GPU time, us): kernel {events(lambda: move_columns(side, out, table, B, 128, True)):.0f} / "
      f"{events(lambda: move_columns(side, g, table, B, 128, False)):.0f}, torch.cat of runs "
      f"{events(lambda: gather_reference(side, B, widths, moves)):.0f} / "
      f"{events(lambda: scatter_reference(g, B, widths, moves)):.0f}, a copy of the output "
      f"{events(lambda: out.copy_(g)):.0f}", flush=True)
