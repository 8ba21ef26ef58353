"""Optional Triton: `import embfuse` works without it, and without a GPU.

Kernel modules import `triton`, `tl` and `wrap_triton` from here. When Triton is missing,
`triton.jit` leaves the function as plain Python (never called: every op then takes its
pure-torch reference path) and `tl.constexpr` is a stand-in for the annotations.
"""

from __future__ import annotations

import os
import types

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by tests/test_import.py in a subprocess
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn, cdiv=lambda a, b: -(-a // b))
    tl = types.SimpleNamespace(constexpr=object)

    def wrap_triton(fn):
        raise RuntimeError("Triton is not installed")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1): the CI kernel tests."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernels(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs the Triton kernels (CUDA, with Triton) or the reference."""
    return HAS_TRITON and t.device.type == "cuda"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def kernel_op(name: str, mutates_args=()):
    """Register a custom op whose body may launch Triton kernels through `wrap_triton`.

    `triton_op` lets torch.compile trace into the body; the body itself picks the kernel
    (CUDA) or the reference (everything else), which also keeps compile and opcheck working
    on the CPU. Without Triton it is a plain `custom_op`.
    """
    if HAS_TRITON:
        return torch.library.triton_op(name, mutates_args=mutates_args)
    return torch.library.custom_op(name, mutates_args=mutates_args)


def tracing() -> bool:
    """True under torch.compile / make_fx / export tracing: dynamo, or a dispatch mode (fake,
    proxy, functional) on the stack. Two C calls: this runs on every eager lookup."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def needs_op(*tensors) -> bool:
    """Whether a call must go through its registered op: under tracing or when autograd records
    it. Otherwise eager code calls the op's body directly, which saves the custom-op dispatch
    (tens of microseconds a call, the whole cost of a small lookup)."""
    return tracing() or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def launch(kernel):
    """`kernel` wrapped for tracing when tracing, else the kernel itself: wrap_triton's eager
    dispatch outside a triton_op costs about 200 us a launch on an H100 (measured)."""
    return wrap_triton(kernel) if tracing() else kernel
