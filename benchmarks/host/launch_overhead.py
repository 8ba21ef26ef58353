"""Host time of one Triton launch, by part: Triton's `kernel[grid](...)`, its argument binder,
the per-argument specialisation, the C launcher alone, and embfuse's `_DirectLauncher`, for a
kernel of 10 and one of 30 arguments (one device call, no GPU work to speak of).

    PYTHONPATH=src python3 benchmarks/host/launch_overhead.py
"""

import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.runtime import driver

from embfuse._triton import _DirectLauncher
from embfuse.bench.runner import host_us


@triton.jit
def _k10(a, b, c, d, n, m, s, t, u, v, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(b + i, tl.load(a + i) + n + m + s + t + u + v)


@triton.jit
def _k30(a, b, c, d, e, f, g, h, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, j0, j1, j2, j3, j4, j5, j6, j7, j8, j9,
         k0, k1, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(b + i, tl.load(a + i) + i0 + i1 + i2 + i3 + i4 + i5 + i6 + i7 + i8 + i9 + j0 + j1 + j2 + j3 + j4 + j5
             + j6 + j7 + j8 + j9 + k0 + k1)


def per_call_us(fn, calls=5000):
    for _ in range(50):
        fn()
    return host_us(fn, calls)


x = torch.randn(1024, device="cuda")
y = torch.empty_like(x)
for kernel, args in [(_k10, (x, y, x, y, 3, 5, 7, 9, 11, 13)), (_k30, (x, y) * 4 + tuple(range(3, 25)))]:
    compiled = kernel[(1,)](*args, BLOCK=128)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    backend = kernel.device_caches[device][3]
    direct = _DirectLauncher(kernel)
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    cases = {
        "triton kernel[grid](...)": lambda: kernel[(1,)](*args, BLOCK=128),
        "  its argument binder": lambda: kernel.device_caches[device][4](*args, BLOCK=128),
        "  specialising each argument": lambda: [native_specialize_impl(backend, a, False, True, True) for a in args],
        "  the C launcher alone": lambda: run(1, 1, 1, stream, function, meta, None, None, None, *args, 128),
        "embfuse _DirectLauncher": lambda: direct[(1,)](*args, BLOCK=128),
    }
    for name, fn in cases.items():
        print(f"{len(args)} args  {name:30s} {per_call_us(fn):6.1f} us/call", flush=True)
