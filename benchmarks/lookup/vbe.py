"""Variable batch size per feature (TorchRec's VBE, issue 20) against the fixed batch it stands
for: the Criteo-like collection (26 tables x 128, B16384, bags 1-99, power-law ids), its first
13 features deduplicated to B/8 samples each (user features, say), every output sample taking
its row by inverse index. The fixed batch is the same bags expanded to all B samples (what a
loader without VBE sends). Forward (no autograd) and a step with fused SGD, the default
(deferred) check, one run; the two outputs compared.

    PYTHONPATH=src python3 benchmarks/lookup/vbe.py
"""
import torch
from triton.testing import do_bench

import embfuse
from embfuse.bench.collection import make_batch, make_collection
from embfuse.bench.workloads import Workload

dev, SHARED, DEDUP = "cuda", 13, 8
w = Workload("c", "collection", 10_000_000, 128, 16384, 50, "powerlaw", 1.05, tables=26, group="collection")
B, F = w.batch, w.tables
base = make_batch(w, dev, seed=0)
g = torch.Generator(device=dev).manual_seed(1)
vbe_v, vbe_l, fix_v, fix_l, inverse, strides = [], [], [], [], [], []
for f, jt in enumerate(base.to_dict().values()):
    if f >= SHARED:
        vbe_v.append(jt.values()), vbe_l.append(jt.lengths()), fix_v.append(jt.values()), fix_l.append(jt.lengths())
        inverse.append(torch.arange(B, device=dev)), strides.append(B)
        continue
    n = B // DEDUP
    lengths = jt.lengths()[:n]
    values = jt.values()[:int(lengths.sum())]
    inv = torch.randint(0, n, (B,), device=dev, generator=g)
    starts = (torch.cumsum(lengths, 0) - lengths)[inv]
    lens = lengths[inv]
    first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    vbe_v.append(values), vbe_l.append(lengths), inverse.append(inv), strides.append(n)
    fix_v.append(values[torch.repeat_interleave(starts, lens) + torch.arange(int(lens.sum()), device=dev) - first])
    fix_l.append(lens)
keys = base.keys()
fixed = embfuse.KeyedJaggedTensor(keys, torch.cat(fix_v), lengths=torch.cat(fix_l), stride=B,
                                  length_per_key=[v.numel() for v in fix_v])
vbe = embfuse.KeyedJaggedTensor(keys, torch.cat(vbe_v), lengths=torch.cat(vbe_l),
                                length_per_key=[v.numel() for v in vbe_v],
                                stride_per_key_per_rank=[[s] for s in strides],
                                inverse_indices=(keys, torch.stack(inverse)))
x = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
copy_us = do_bench(lambda: x.clone(), warmup=10, rep=100, return_mode="median") * 1e3
print(f"copy of 256 MiB: {2 * x.numel() / copy_us / 1e6:.2f} TB/s (read + write)")
print(f"ids: fixed {fixed.values().numel() / 1e6:.2f}M, VBE {vbe.values().numel() / 1e6:.2f}M "
      f"(features 0-{SHARED - 1} at {B // DEDUP} samples)")
ebc = make_collection(w, dev)
with torch.no_grad():
    a, b = ebc(fixed).values(), ebc(vbe).values()
print(f"outputs: max |fixed - VBE| = {(a - b).abs().max().item():.3g}")
train = make_collection(w, dev, optimizer=embfuse.optim.SGD(lr=0.01))
grad = torch.randn_like(a)
for name, kjt in (("fixed", fixed), ("VBE", vbe)):
    with torch.no_grad():
        fwd = [do_bench(lambda: ebc(kjt).values(), warmup=20, rep=200, return_mode="median") * 1e3 for _ in range(2)]
    step = [do_bench(lambda: train(kjt).values().backward(grad), warmup=10, rep=100, return_mode="median") * 1e3
            for _ in range(2)]
    print(f"{name}: forward {fwd[0]:.1f} / {fwd[1]:.1f} us, step {step[0]:.1f} / {step[1]:.1f} us", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            train(kjt).values().backward(grad)
        torch.cuda.synchronize()
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
    print("  step's kernels (us a step): " + "; ".join(f"{e.key[:40]} {e.device_time_total / 5:.0f}" for e in top))
embfuse.check_errors()
