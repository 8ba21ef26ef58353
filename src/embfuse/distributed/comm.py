"""The collectives a sharded collection runs, all torch.distributed's own (`all_to_all_single`,
`broadcast`, `all_gather_object`): no home-made transport.

`PooledAllToAll` carries pooled rows to the ranks whose samples they belong to (a request,
waited on later), and carries their gradients back in the backward. `CommTimer` measures how
long the collectives hold the step (CUDA events on the GPU, the host clock on the CPU, where
gloo's waits block the host).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist


class CommTimer:
    """Time spent in a module's collectives, by name ("input", "output", "output_backward").
    `seconds()` syncs the device once and returns the totals since the last `reset()`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._spans: list[tuple[str, object, object]] = []

    @contextmanager
    def __call__(self, name: str, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._spans.append((name, start, end))

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if any(isinstance(s, torch.cuda.Event) for _, s, _ in self._spans):
            torch.cuda.synchronize()
        for name, start, end in self._spans:
            took = start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start
            out[name] = out.get(name, 0.0) + took
        return out


def timed(timer: Optional[CommTimer], name: str, device):
    return timer(name, device) if timer is not None else nullcontext()


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, async_op=False):
    """all_to_all_single on a 1-D buffer: `send_splits[r]` elements go to rank r and
    `recv_splits[r]` come from it. Returns (the received buffer, the work handle or None); in a
    world of one, `send` itself."""
    if len(send_splits) == 1:  # a world of one: what is sent is what arrives, no collective
        return send, None
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)
    return recv, work


class PooledAllToAll(torch.autograd.Function):
    """Forward: the pooled rows (flat) start for their samples' ranks; `handle.work` is the
    request, to be waited on before the received buffer is read (OutputDist.wait). Backward: the
    gradients of what arrived go back to the ranks that pooled them (the reverse all-to-all,
    waited at once: the local backward needs them next)."""

    @staticmethod
    def forward(ctx, pooled, send_splits, recv_splits, group, timer, handle):
        ctx.shape, ctx.splits, ctx.group, ctx.timer = pooled.shape, (send_splits, recv_splits), group, timer
        recv, handle.work = all_to_all(pooled.contiguous().view(-1), send_splits, recv_splits, group, async_op=True)
        return recv

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        with timed(ctx.timer, "output_backward", grad.device):
            back, _ = all_to_all(grad.contiguous(), recv_splits, send_splits, ctx.group)
        return back.view(ctx.shape), None, None, None, None, None


class InputDist:
    """A batch's input exchange in flight: `wait()` makes the current stream (or, on gloo, the
    host) wait for what arrived (lengths, ids and weights of every source, one buffer) and
    returns it."""

    def __init__(self, owner, kjt, B, batches, counts, recv, work, rows=None):
        self.owner, self.kjt, self.B, self.batches, self.counts = owner, kjt, B, batches, counts
        self.rows = rows  # a VBE batch's output rows (nn/vbe.py one_stride), else None
        self._recv, self._work, self._waited = recv, work, False

    def wait(self) -> torch.Tensor:
        if not self._waited:
            if self._work is not None:
                with timed(self.owner.comm_timer, "input", self.owner.device):
                    self._work.wait()
            self._waited, self._work = True, None
            if self.owner.device.type == "cuda":  # made on the distribution stream, used on this one
                for t in (self._recv, self.rows) if self.rows is not None else (self._recv,):
                    t.record_stream(torch.cuda.current_stream(self.owner.device))
        return self._recv


class OutputDist:
    """Pooled rows on their way to this rank's samples: `work` is the all-to-all's request,
    `recv` its buffer (not to be read before `work.wait()`)."""

    def __init__(self, kjt, B, rows=None):
        self.kjt, self.B, self.rows, self.recv, self.work = kjt, B, rows, None, None
