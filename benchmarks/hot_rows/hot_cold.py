"""Where the Criteo step spends its time: hot rows against cold ones (one device call).

The collection step's backward (sort + segment levels + fused SGD), and its forward, are timed
on all of a batch's values, then on the values of each table's K most frequent rows alone
("hot") and on the rest ("cold"); the forward's bags keep their place, the values of the other
kind dropped. Beside it, what a dense path for the hot rows would cost in torch ops: the per-bag
counts C (F, K, B) of each feature's hot rows, built by index_add, and C @ grad per feature as
one batched matrix product (fp32 without TF32, and bf16, one of the three products an exact
split of fp32 gradients would take). Medians of CUDA-event timings (do_bench).

    PYTHONPATH=src python3 benchmarks/hot_rows/hot_cold.py [batch [device [rows]]]
"""

import sys

import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload
from embfuse.ops.bags import backward_inputs
from embfuse.ops.collection import collection_forward
from embfuse.optim.fused import fused_update

DEV = sys.argv[2] if len(sys.argv) > 2 else "cuda"
B = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
ROWS = int(sys.argv[3]) if len(sys.argv) > 3 else 10_000_000
w = Workload("c", "collection-train", ROWS, 128, B, 50, "powerlaw", 1.05, tables=26)
kjt = make_batch(w, DEV)
F, D = w.tables, w.dim
ebc = make_collection(w, DEV)
plan = ebc._plan(kjt.keys(), ebc.weights.device)
values, offsets = kjt.values(), kjt.offsets()
keys, bag, _ = backward_inputs(values, offsets, None, plan.meta, B, wide_keys=plan.layout.wide_keys,
                               scaled=plan.scaled, kernel=True)
grad = torch.randn(B, F * D, device=DEV)
weights, sgd = ebc.weights.detach(), embfuse.optim.SGD(lr=1e-6)
uniq, counts = torch.unique(keys.long(), return_counts=True)
table = uniq >> plan.layout.shift


def ms(fn):
    fn()
    return do_bench(fn, warmup=3, rep=300, return_mode="median")


def backward(sel):
    k, b = (keys, bag) if sel is None else (keys[sel], bag[sel])
    return ms(lambda: fused_update(weights, [], sgd, k, plan.layout, grad, 1, src_row=b, scale=None,
                                   src_stride=grad.stride(0), src_bags=B, src_meta=plan.src_meta)), k


g_of = torch.repeat_interleave(torch.arange(F * B, device=DEV), offsets[1:] - offsets[:-1], output_size=values.numel())


def forward(sel):
    v = values if sel is None else values[sel]
    o = offsets if sel is None else torch.cat([offsets[:1], torch.bincount(g_of[sel], minlength=F * B).cumsum(0)])
    return ms(lambda: collection_forward(weights, v, o, None, plan.meta, B, plan.total_dim, plan.max_dim,
                                         plan.layout.vec))


full = backward(None)[0]
print(f"B{B}: {keys.numel()} values; backward (sort, levels, SGD) {full * 1e3:.0f} us, forward "
      f"{forward(None) * 1e3:.0f} us", flush=True)
for K in (64, 256, 1024):
    hot_keys = torch.cat([uniq[table == t][torch.topk(counts[table == t], min(K, int((table == t).sum()))).indices]
                          for t in range(F)]).sort().values
    hot = torch.isin(keys.long(), hot_keys)
    t_hot, k_hot = backward(hot)
    t_cold, k_cold = backward(~hot)
    sort_cold = ms(lambda: torch.sort(k_cold, stable=True))
    print(f"K={K}: hot values {hot.float().mean().item():.1%}; backward of hot {t_hot * 1e3:.0f} us, of cold "
          f"{t_cold * 1e3:.0f} us (its sort {sort_cold * 1e3:.0f} us); forward of hot {forward(hot) * 1e3:.0f} us, "
          f"of cold {forward(~hot) * 1e3:.0f} us", flush=True)
    # the dense form of the hot rows' gradients: C[f, k, b] = times feature f's bag b holds hot row k
    f_of = torch.div(torch.arange(F * B, device=DEV), B, rounding_mode="floor")
    first = torch.searchsorted(hot_keys, torch.arange(F, device=DEV) << plan.layout.shift)
    slot = torch.searchsorted(hot_keys, keys.long()[hot]) - first[f_of[g_of[hot]]]  # hot row within its table
    at = (f_of[g_of[hot]] * K + slot) * B + g_of[hot] % B
    C = torch.zeros(F * K * B, device=DEV)
    ones = torch.ones(at.numel(), device=DEV)
    build = ms(lambda: C.zero_().index_add_(0, at, ones))
    G = grad.view(B, F, D).permute(1, 0, 2).contiguous()
    C3 = C.view(F, K, B)
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = ms(lambda: torch.bmm(C3, G))
    Cb, Gb = C3.bfloat16(), G.bfloat16()
    bf16 = ms(lambda: torch.bmm(Cb, Gb))
    print(f"  dense: counts built {build * 1e3:.0f} us, C @ grad fp32 {fp32 * 1e3:.0f} us, bf16 {bf16 * 1e3:.0f} us",
          flush=True)
    C = C3 = Cb = Gb = G = ones = at = None
    torch.cuda.empty_cache()
