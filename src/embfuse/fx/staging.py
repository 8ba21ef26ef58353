"""One host-to-device copy for many host tensors: they are written into one pinned host buffer
(each part 16-byte aligned), the buffer crosses in one non-blocking copy, and each part comes
back as a view of the device buffer (no copy, no kernel).

The pinned buffer comes from torch's caching host allocator: a block is reused only after the
copy that read it has finished (the allocator records an event at the copy), so nothing here
waits for the GPU. Writing into pinned memory is the one host pass over the data that a
pageable copy makes anyway (the driver stages pageable memory through pinned buffers).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch
from torch import Tensor

from embfuse._triton import tracing

ALIGN = 16  # bytes: every part starts where a 16-byte vector load may begin
PARALLEL_BYTES = 1 << 22  # below this a copy is not worth a thread hand-off
_POOL: list[ThreadPoolExecutor] = []


def copy_all(pairs: Sequence[tuple[Tensor, Tensor]], side: Callable[[], None] | None = None) -> None:
    """`dst.copy_(src)` for every (dst, src) host pair, spread over up to 12 threads when there
    is enough to copy: copy_ releases the GIL, and one thread copied into pinned memory at about
    a third of what 8-12 did on the H100 machine's host (benchmarks/NOTES.md, session 13).
    `side`, if given, runs beside them."""
    total = sum(src.numel() * src.element_size() for _, src in pairs)
    workers = min(12, os.cpu_count() or 1)
    if total < PARALLEL_BYTES or workers < 2:
        for dst, src in pairs:
            dst.copy_(src)
        if side is not None:
            side()
        return
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(workers, thread_name_prefix="embfuse-staging"))
    # contiguous runs of pairs of about equal bytes, one a worker
    share, runs, run, size = total / workers, [], [], 0
    for pair in pairs:
        run.append(pair)
        size += pair[1].numel() * pair[1].element_size()
        if size >= share:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)

    def copy_run(run):
        for dst, src in run:
            dst.copy_(src)

    tasks = [_POOL[0].submit(copy_run, r) for r in runs]
    if side is not None:
        tasks.append(_POOL[0].submit(side))
    for task in tasks:
        task.result()


def end_to_end(dst: Tensor, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The (dst slice, tensor flattened) pairs that write `tensors` one after another into the
    1-D `dst` (for copy_all; copy_ casts to dst's dtype)."""
    pairs, start = [], 0
    for t in tensors:
        pairs.append((dst[start:start + t.numel()], t.reshape(-1)))
        start += t.numel()
    return pairs


class Staging:
    """A pinned host buffer laid out as `parts` [(dtype, numel), ...]: `host[i]` is part i's
    1-D host view (write into it), `to(device)` copies the buffer over once and returns the
    parts' device views in the same order."""

    def __init__(self, parts: Sequence[tuple[torch.dtype, int]]):
        self._layout, start = [], 0
        for dtype, numel in parts:
            start = -(-start // ALIGN) * ALIGN
            size = numel * dtype.itemsize
            self._layout.append((start, size, dtype))
            start += size
        self.buffer = torch.empty(start, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.host = self.views(self.buffer)

    def views(self, buffer: Tensor) -> list[Tensor]:
        """The parts' 1-D views of `buffer` (this buffer, or a copy of it anywhere)."""
        return [buffer[start:start + size].view(dtype) for start, size, dtype in self._layout]

    def to(self, device) -> list[Tensor]:
        return self.views(self.buffer.to(device, non_blocking=True))


def copy_to_device(tensors: Sequence[Tensor], device) -> tuple[Tensor, ...]:
    """`tuple(t.to(device) for t in tensors)` with one copy for all the host tensors among them
    (from pinned memory: the host does not wait for the GPU, as it does for a pageable copy).
    Tensors already on `device`, and host tensors that require grad (their copy must stay on
    the autograd graph), go by `.to()` as before; the rest share one pinned staging copy (inside
    a torch.compile graph, an opaque op of it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return tuple(t.to(device) for t in tensors)
    staged = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and not t.requires_grad]
    if not staged:
        return tuple(t.to(device) for t in tensors)
    out = list(tensors)
    for i in set(range(len(tensors))) - set(staged):
        out[i] = tensors[i].to(device)
    moved = (_staged_copy_op if tracing() else _staged_copy)([tensors[i] for i in staged], device)
    for i, t in zip(staged, moved):
        out[i] = t
    return tuple(out)


def _staged_copy(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Host tensors through one pinned buffer and one copy; views of the copy on `device`."""
    staging = Staging([(t.dtype, t.numel()) for t in tensors])
    copy_all([(host.view(t.shape), t) for host, t in zip(staging.host, tensors)])
    return [moved.view(t.shape) for moved, t in zip(staging.to(device), tensors)]


@torch.library.custom_op("embfuse::staged_copy", mutates_args=())
def _staged_copy_op(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    return [t.clone() for t in _staged_copy(tensors, device)]  # (an op's outputs may not share storage)


@_staged_copy_op.register_fake
def _(tensors, device):
    return [t.new_empty(t.shape, device=device) for t in tensors]
