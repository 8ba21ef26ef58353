"""Optional Triton: `import embfuse` works without it, and without a GPU.

Kernel modules import `triton`, `tl` and `wrap_triton` from here. When Triton is missing,
`triton.jit` leaves the function as plain Python (never called: every op then takes its
pure-torch reference path) and `tl.constexpr` is a stand-in for the annotations.
"""

from __future__ import annotations

import functools
import os
import types
from itertools import repeat

import torch

native_specialize_impl = None  # Triton's per-argument specialisation, when this Triton has it
try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    HAS_TRITON = True
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.runtime import driver
    except ImportError:  # pragma: no cover - a Triton without them launches the usual way
        pass
except ImportError:  # pragma: no cover - exercised by tests/test_import.py in a subprocess
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    tl = types.SimpleNamespace(constexpr=lambda value=None: value)

    def wrap_triton(fn):
        raise RuntimeError("Triton is not installed")


def constexprs(*values):
    """The kernels' copies of host constants: Triton reads only constexpr globals, while host
    code (and torch.compile, which traces it) needs plain ints. A module names each constant
    once for the host and once, with a K_ prefix, for its kernels: `meta + f * stride_m + K_DIM`."""
    return tuple(tl.constexpr(v) for v in values) if HAS_TRITON else values


# Triton decides at @triton.jit time whether a kernel is interpreted: read the variable once,
# when the kernel modules (which import this one first) are defined
_INTERPRETING = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1): the CI kernel tests."""
    return _INTERPRETING


def use_kernels(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs the Triton kernels (CUDA, with Triton) or the reference."""
    return HAS_TRITON and t.device.type == "cuda"


def cdiv(a, b):
    """Ceiling division for host code (sizes may be SymInts): `triton.cdiv` is a Triton
    constexpr function, slow to call from the host."""
    return -(-a // b)


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


def exporting() -> bool:
    """True while torch.export traces (strict or not). Read from export's own flag: torch 2.11's
    dynamo takes `torch.compiler.is_exporting()` for True under torch.compile too (2.13 reads the
    flag, as this does)."""
    return getattr(torch.compiler, "_is_exporting_flag", False)


def needs_op(*tensors) -> bool:
    """Whether a call needs its op's autograd and registration: under tracing (the registered
    op) or when autograd records it (in eager code, `eager_autograd`'s Function). Otherwise eager
    code calls the op's body directly, which saves the custom-op dispatch (tens of microseconds a
    call, the whole cost of a small lookup)."""
    return tracing() or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def backward_needs_op(grad) -> bool:
    """Whether a backward calls its registered backward op rather than the op's body: as
    `needs_op` (tracing, or a double backward recording it), or for gradients batched by
    autograd's `is_grads_batched` (gradcheck's batched check), which the op's fallback takes
    entry by entry where the body's in-place ops cannot take them at once."""
    return needs_op(grad) or torch._C._functorch.is_legacy_batchedtensor(grad)


def eager_autograd(body, setup_context, backward):
    """The autograd.Function that eager calls recording a gradient run in place of a registered
    op: the op's own body, setup_context and backward, without the custom-op dispatch around
    each of them (benchmarks/NOTES.md, session 31). Traced calls keep the op (`tracing`), which
    torch.compile and opcheck see."""

    def forward(ctx, *inputs):
        # (ctx in forward, no setup_context staticmethod: with one, each apply binds its
        # arguments through inspect.signature, about 15 us a call)
        output = body(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(f"Eager_{body.__name__.lstrip('_')}", (torch.autograd.Function,),
                dict(forward=staticmethod(forward), backward=staticmethod(backward))).apply


class _DirectLauncher:
    """Launches a compiled Triton kernel with less host work than `kernel[grid](...)`.

    Triton's own launch binds the arguments, specialises each one, builds a cache key from
    them and a string of the options, checks globals and asks for the stream: about three
    times what its C launcher costs (commit ae94d46; benchmarks/NOTES.md, session 26). Here
    the key is the tuple of Triton's own per-argument specialisation (`native_specialize_impl`:
    type, 16-byte alignment, divisibility by 16, the value 1, where the kernel does not say
    do_not_specialize) plus the constexprs and options, so two calls share a compiled kernel
    exactly when Triton would give them the same one. The first call with a new key goes
    through Triton, which compiles and returns the kernel we keep.
    (A missing constexpr raises KeyError here, as a missing argument does in Triton.)
    """

    def __init__(self, kernel):
        self.kernel = kernel
        runtime = [not p.is_constexpr for p in kernel.params]
        # the fast path takes the runtime arguments by position and the constexprs by name:
        # a kernel with a constexpr before a runtime parameter always launches Triton's way
        self.n_runtime = sum(runtime) if all(runtime[:sum(runtime)]) else -1
        self.constexpr_names = [p.name for p in kernel.params if p.is_constexpr]
        # the kernel's do_not_specialize(_on_alignment), as Triton's own binder passes them
        params = kernel.params[:max(self.n_runtime, 0)]
        self.specialize = [not p.do_not_specialize for p in params]
        self.align = [not p.do_not_specialize_on_alignment for p in params]
        self.compiled = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        n = len(args)
        if n != self.n_runtime:
            self.kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        backend = self.kernel.device_caches[device][3]
        # map() over C functions: no Python frame per argument
        key = (device, *kwargs.items(), *map(native_specialize_impl, repeat(backend, n), args, repeat(False, n),
                                               self.specialize, self.align))
        hit = self.compiled.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = hit
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            driver.active.get_current_stream(device), function, metadata, None, None, None,
            *args, *map(kwargs.__getitem__, self.constexpr_names))


@functools.lru_cache(maxsize=None)
def _direct(kernel) -> _DirectLauncher:
    return _DirectLauncher(kernel)


class _Distinct:
    """`kernel[grid](...)` that first checks that no tensor is passed twice (as two arguments,
    or as views of one base). Inductor functionalizes a traced launch by cloning each argument
    the kernel writes, one clone per argument (pytorch#196657): a buffer passed as both a
    kernel's input and its output then splits into two, and the kernel reads what it never
    wrote. Checked where it costs no eager GPU time: when tracing and when interpreting (CI)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            seen = {}
            for i, a in enumerate((*args, *kwargs.values())):
                if isinstance(a, torch.Tensor) and not _empty(a):
                    base = a if a._base is None else a._base
                    for j, b in seen.get(id(base), ()):
                        if _overlap(a, b):
                            raise RuntimeError(f"embfuse internal error: {getattr(self.kernel, 'fn', self.kernel)} "
                                               f"gets overlapping tensors as arguments {j} and {i}")
                    seen.setdefault(id(base), []).append((i, a))
            return self.kernel[grid](*args, **kwargs)
        return run


def _empty(t: torch.Tensor) -> bool:
    """Known to hold no element (a symbolic count, when tracing, is not read: no guard)."""
    n = t.numel()
    return isinstance(n, int) and n == 0


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one base may share an element: their spans of the storage meet (a
    symbolic span, when tracing, is taken to meet any other)."""
    spans = []
    for t in (a, b):
        start = t.storage_offset()
        end = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        if not isinstance(end, int):
            return True
        spans.append((start, end))
    (s0, e0), (s1, e1) = spans
    return s0 < e1 and s1 < e0


def launch(kernel, overlapping: bool = False):
    """How to launch `kernel` from a host function: wrapped for tracing when tracing
    (wrap_triton's eager dispatch outside a triton_op costs several launches' worth of host
    time), through `_DirectLauncher` on a GPU, and Triton's own way when interpreting; no
    tensor twice in one launch (`_Distinct`), except in eager launches that say `overlapping`
    (only an eager call takes them; a traced launch is always checked). Launch hooks
    (knobs.runtime.launch_enter_hook, a profiler's) see only the first launch of each
    specialisation."""
    if tracing():
        return _Distinct(wrap_triton(kernel))
    if _INTERPRETING:
        return kernel if overlapping else _Distinct(kernel)
    if native_specialize_impl is None:
        return kernel
    return _direct(kernel)
