"""A pipelined training loop for models with sharded collections (TorchRec's TrainPipelineSparseDist
idea): while batch i computes on the default stream, batch i+1's input exchange runs on a
distribution stream and batch i+2's host-to-device copy on a copy stream.

Each step, in host order:
1. the default stream waits for batch i's copy (its event: the copy stream is already moving
   a later batch) and exchange; the tensors made on the other streams are `record_stream`ed to it so
   the allocator keeps them;
2. batch i's forward (its sharded collections take the exchange started a step ago: no host read
   left in the forward), backward (the fused sparse updates) and `optimizer.step()`;
3. after the backward was launched: batch i+2's copy, then batch i+1's input exchange (whose one
   host read now waits only for the distribution stream and the collectives before it, while the
   GPU still runs batch i's backward). The distribution stream has the higher priority, so its
   few short kernels run beside the backward's instead of after them.
The results are those of the plain loop (`model(batch)`, backward, step) batch for batch: the
exchange of ids does not read the tables, and every update happens in the plain loop's order.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from contextlib import nullcontext
from typing import Callable, Iterator, Optional

import torch

from embfuse.distributed.sharded import ShardedEmbeddingBagCollection
from embfuse.sparse.jagged import KeyedJaggedTensor


def _map(obj, fn):
    """fn on every tensor and KeyedJaggedTensor inside lists, tuples, dicts and dataclasses."""
    if isinstance(obj, (torch.Tensor, KeyedJaggedTensor)):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def _record(obj, stream) -> None:
    def record(t):
        if t.device.type == "cuda" if isinstance(t, torch.Tensor) else t.device().type == "cuda":
            t.record_stream(stream)
        return t
    _map(obj, record)


def _sparse_features(batch):
    """The default `features`: the batch itself when it is a KeyedJaggedTensor, else its
    `sparse_features` (TorchRec's Batch), else its "sparse_features" item."""
    if isinstance(batch, KeyedJaggedTensor):
        return batch
    if hasattr(batch, "sparse_features"):
        return batch.sparse_features
    return batch["sparse_features"]


class TrainPipeline:
    """`progress(it)` trains on the next batch of the iterator `it` and returns `model(batch)`;
    StopIteration when `it` is done. `model(batch)` returns the loss, or a tuple whose first
    item is the loss (TorchRec's convention). `optimizer`: the dense parameters' optimizer (or
    None when every parameter is updated by fused optimizers). Batches are moved with `.to` on
    every tensor and KeyedJaggedTensor they hold (lists, tuples, dicts, dataclasses); for the copy
    to overlap, the loader's tensors should be in pinned memory."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], device,
                 features: Callable = _sparse_features):
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.features = features
        self.sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
        cuda = self.device.type == "cuda"
        self._copy = torch.cuda.Stream(self.device) if cuda else None
        # above the default stream's priority: the exchange's one host read waits for this stream's
        # routing kernels, which at the default priority queue behind the backward's long kernels
        # while the host, blocked, cannot launch the next forward (benchmarks/NOTES.md, session 33)
        self._dist = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self._queue: deque = deque()  # batches on the device: [batch, exchange started, copy done event]
        self._done = False
        self._source = None

    def _stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _fetch(self, it: Iterator) -> None:
        if self._done:
            return
        try:
            host = next(it)
        except StopIteration:
            self._done = True
            return
        with self._stream(self._copy):
            moved = _map(host, lambda t: t.to(self.device, non_blocking=True))
            copied = None
            if self._copy is not None:  # this batch's copy alone: the stream goes on to the next
                copied = torch.cuda.Event()
                copied.record(self._copy)
            self._queue.append([moved, False, copied])

    def _distribute(self, entry) -> None:
        if entry[1] or not self.sharded:
            return
        with self._stream(self._dist):
            if self._dist is not None:
                self._dist.wait_event(entry[2])
                _record(entry[0], self._dist)
            kjt = self.features(entry[0])
            for m in self.sharded:
                m.prefetch(kjt)
        entry[1] = True

    def progress(self, it: Iterator):
        if it is not self._source:  # a new iterator (a new epoch) after the last one ran out
            self._source, self._done = it, False
        while len(self._queue) < 2 and not self._done:
            self._fetch(it)
        if not self._queue:
            raise StopIteration
        entry = self._queue[0]
        self._distribute(entry)
        batch = entry[0]
        if self._copy is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry[2])  # not wait_stream: the copy stream is moving a later batch already
            current.wait_stream(self._dist)
            _record(batch, current)
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        out = self.model(batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        self._queue.popleft()
        self._fetch(it)  # batch i+2's copy
        if self._queue:
            self._distribute(self._queue[0])  # batch i+1's exchange
        if self.optimizer is not None:
            self.optimizer.step()
        return out
