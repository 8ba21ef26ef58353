"""The GPU's persisting L2: an access-policy window on a stream, through the CUDA driver API.

Ampere and Hopper GPUs let a stream mark one address window as *persisting*: lines of it that
hit are kept in a reserved part of the L2 (the set-aside, at most the device's
max-persisting-L2 attribute), while other accesses use the rest. embfuse uses it for hot rows
(ops/residency.py): their window is set on the current stream around embfuse's own launches and
the stream's previous window is put back afterwards, so a user's kernels are not affected.

The driver is reached through ctypes (libcuda, which every CUDA install has): torch exposes
neither call. Nothing here initialises CUDA at import; `support()` says, with the reason,
whether the current device can take a window.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from typing import Optional

import torch

# cuda.h
_ATTR_L2_CACHE_SIZE = 38
_ATTR_MAX_PERSISTING_L2 = 108
_ATTR_MAX_WINDOW = 109
_LIMIT_PERSISTING_L2 = 0x06
_STREAM_ATTR_ACCESS_POLICY_WINDOW = 1
_KERNEL_NODE_ATTR_ACCESS_POLICY_WINDOW = 1
_GRAPH_NODE_KERNEL = 0
_ACCESS_NORMAL, _ACCESS_STREAMING, _ACCESS_PERSISTING = 0, 1, 2


class _Window(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUstreamAttrValue (CUlaunchAttributeValue: 64 bytes)
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


@dataclass(frozen=True)
class Support:
    """What the current device offers: `ok`, and when not, `reason`; sizes in bytes."""

    ok: bool
    reason: str = ""
    l2_bytes: int = 0
    max_persisting_bytes: int = 0
    max_window_bytes: int = 0


@functools.lru_cache(maxsize=1)
def _driver():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _call(fn, *args) -> None:
    result = fn(*args)
    if result != 0:
        raise RuntimeError(f"CUDA driver: {fn.__name__} returned error {result}")


@functools.lru_cache(maxsize=None)
def _support(device_index: int) -> Support:
    lib = _driver()
    if lib is None:
        return Support(False, "the CUDA driver library (libcuda) could not be loaded")
    values = []
    for attr in (_ATTR_L2_CACHE_SIZE, _ATTR_MAX_PERSISTING_L2, _ATTR_MAX_WINDOW):
        v = ctypes.c_int(0)
        if lib.cuDeviceGetAttribute(ctypes.byref(v), attr, device_index) != 0:
            return Support(False, "the CUDA driver did not report the device's L2 attributes")
        values.append(v.value)
    l2, persisting, window = values
    if persisting <= 0 or window <= 0:
        return Support(False, f"{torch.cuda.get_device_name(device_index)} has no persisting L2 "
                              f"(an Ampere or newer GPU has one)", l2)
    return Support(True, "", l2, persisting, window)


def support(device=None) -> Support:
    """Whether `device` (default: the current CUDA device) can keep a window in L2, and its sizes."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return Support(False, f"tensors on {device.type}: only a CUDA GPU has a persisting L2")
    if not torch.cuda.is_available():
        return Support(False, "CUDA is not available")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    return _support(index)


def reserve(nbytes: int) -> int:
    """Set the context's persisting set-aside to at least `nbytes` (capped at the device's
    maximum); returns the set-aside now in force. The set-aside is the context's, shared by
    every stream; the L2 it does not hold persisting lines for stays usable by other accesses."""
    lib = _driver()
    current = ctypes.c_size_t(0)
    _call(lib.cuCtxGetLimit, ctypes.byref(current), _LIMIT_PERSISTING_L2)
    if current.value < nbytes:
        _call(lib.cuCtxSetLimit, _LIMIT_PERSISTING_L2, ctypes.c_size_t(nbytes))
        _call(lib.cuCtxGetLimit, ctypes.byref(current), _LIMIT_PERSISTING_L2)
    return current.value


def _stream_handle(stream: Optional[torch.cuda.Stream]) -> ctypes.c_void_p:
    if stream is None:  # the raw handle: current_stream() builds a Stream, 9 us of host (NOTES, session 28)
        return ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()))
    return ctypes.c_void_p(stream.cuda_stream)


def _window(stream_handle) -> _AttrValue:
    value = _AttrValue()
    _call(_driver().cuStreamGetAttribute, stream_handle, _STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(value))
    return value


@contextlib.contextmanager
def persisting(tensor: torch.Tensor, nbytes: int, hit_ratio: float = 1.0, stream=None):
    """Kernels launched on `stream` (default: the current one) inside the block see the first
    `nbytes` of `tensor` as a persisting window; the stream's previous window is put back on
    exit. Kernels captured into a CUDA graph inside the block keep the window as their kernel
    node's attribute (kernel_node_windows; checked on the H100 by tests/ops/test_residency.py)."""
    handle = _stream_handle(stream)
    lib = _driver()
    previous = _window(handle)
    value = _AttrValue()
    w = value.accessPolicyWindow
    w.base_ptr, w.num_bytes, w.hitRatio = tensor.data_ptr(), nbytes, hit_ratio
    w.hitProp, w.missProp = _ACCESS_PERSISTING, _ACCESS_STREAMING
    _call(lib.cuStreamSetAttribute, handle, _STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(value))
    try:
        yield
    finally:
        _call(lib.cuStreamSetAttribute, handle, _STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(previous))


def stream_window(stream=None) -> tuple[int, int]:
    """(base address, bytes) of the window set on `stream` now ((0, 0): none). For tests."""
    w = _window(_stream_handle(stream)).accessPolicyWindow
    return (w.base_ptr or 0, w.num_bytes)


def kernel_node_windows(graph: torch.cuda.CUDAGraph) -> list[tuple[int, int]]:
    """(base address, bytes) of the window of each kernel node of `graph` ((0, 0): none), in
    the graph's node order. `graph` must be made with keep_graph=True. For tests."""
    lib = _driver()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    _call(lib.cuGraphGetNodes, handle, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    _call(lib.cuGraphGetNodes, handle, nodes, ctypes.byref(count))
    windows = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        _call(lib.cuGraphNodeGetType, ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value == _GRAPH_NODE_KERNEL:
            value = _AttrValue()
            _call(lib.cuGraphKernelNodeGetAttribute, ctypes.c_void_p(node), _KERNEL_NODE_ATTR_ACCESS_POLICY_WINDOW,
                  ctypes.byref(value))
            windows.append((value.accessPolicyWindow.base_ptr or 0, value.accessPolicyWindow.num_bytes))
    return windows


def reset() -> None:
    """Demote every persisting line of the context to normal (cuCtxResetPersistingL2Cache)."""
    _call(_driver().cuCtxResetPersistingL2Cache)
