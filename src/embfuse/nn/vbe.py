"""Variable batch size per feature (TorchRec's VBE) in the collections: the batch padded to one
stride for the usual launches; in EmbeddingBagCollection's forward, each output sample then
given the pooled row its inverse index names."""

from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import tracing
from embfuse.ops.embedding import gather
from embfuse.ops.vbe import pad_variable_batch
from embfuse.sparse.jagged import KeyedJaggedTensor


class PinnedRing:
    """Small int64 host data copied to a device without the host waiting and without a new
    pinned allocation each call: while the GPU is behind, the caching host allocator's blocks
    are still held by copies not yet run, so a pinned tensor a call allocated afresh (about 300
    us of host time a VBE forward on the H100: benchmarks/NOTES.md, session 16). Rows of one
    pinned buffer are reused once the copy that last read them has run (a CUDA event)."""

    def __init__(self, slots: int = 8, width: int = 256):
        self.slots, self.width, self.k = slots, width, 0
        self.host, self.events = None, [None] * slots

    def to(self, values: list[int], device: torch.device) -> Tensor:
        if device.type != "cuda" or tracing():  # (traced: a constant; the ring keeps nothing a trace made)
            return torch.tensor(values, device=device)
        k = self.k % self.slots
        self.k += 1
        if self.host is None or len(values) > self.width:
            self.width = max(self.width, len(values))
            self.host = torch.empty((self.slots, self.width), dtype=torch.int64, pin_memory=True)
            self.events = [None] * self.slots
        event = self.events[k]
        if event is not None and not event.query():  # every row still being read: a fresh one
            return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)
        row = self.host[k, :len(values)]
        row.copy_(torch.tensor(values))
        out = row.to(device, non_blocking=True)
        self.events[k] = event = torch.cuda.Event()
        event.record()
        return out


def one_stride(kjt: KeyedJaggedTensor, slots: list[tuple[str, str]], names: list[str], ring: PinnedRing,
               expand: bool = True) -> tuple[KeyedJaggedTensor, Optional[Tensor], Tensor]:
    """A batch whose features have their own batch sizes (stride_per_key) as one keyed by the
    output `names` (slots: (feature, output name) in output order) of the largest stride, each
    feature's bags padded with empty ones; to `expand` pooled outputs, the rows of the pooled
    output each output sample takes, (B, F) (TorchRec's inverse_indices, transposed; else None);
    and each output's own batch size, on the device (its bags past that are padding). Inverse
    indices made on a device are not checked (KeyedJaggedTensor.validate checks host ones): they
    are kept inside each feature's samples, so that no read leaves the pooled output."""
    inverse = kjt.inverse_indices_or_none()
    if expand and inverse is None:
        raise ValueError("a batch whose features have their own batch sizes (stride_per_key "
                         f"{kjt.stride_per_key()}) needs inverse_indices to be pooled (TorchRec's rule)")
    if not tracing() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError("a batch whose features have their own batch sizes cannot be captured in a CUDA "
                                  "graph: its per-feature sizes cross from the host at each call")
    keys, index = inverse if expand else (kjt.keys(), None)
    missing = [f for f, _ in slots if f not in kjt.keys() or f not in keys]
    if missing:
        raise KeyError(f"the batch has no feature {missing[0]!r} in its keys or inverse indices")
    order = [kjt.keys().index(f) for f, _ in slots]
    if order != list(range(len(kjt.keys()))):
        kjt = kjt.permute(order)
    strides, dev = kjt.stride_per_key(), kjt.values().device
    B, F = max(strides), len(strides)
    # each feature's stride, first lengths entry and row of the inverse indices: one copy
    # without a wait, then one or two launches (ops/vbe.py)
    firsts = list(itertools.accumulate(strides, initial=0))[:-1]
    meta = ring.to(strides + firsts + [keys.index(f) for f, _ in slots], dev)
    lengths, rows = pad_variable_batch(kjt.lengths(), None if index is None else index.contiguous(), meta, F, B)
    padded = KeyedJaggedTensor(names, kjt.values(), kjt.weights_or_none(), lengths=lengths, stride=B,
                               length_per_key=kjt.length_per_key())
    return padded, rows, meta[:F]


def _runs(dims: list[int]) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive features of one width: (first feature, count, first column, width)."""
    runs, col = [], 0
    for f, d in enumerate(dims):
        if runs and runs[-1][3] == d:
            runs[-1][1] += 1
        else:
            runs.append([f, 1, col, d])
        col += d
    return [tuple(r) for r in runs]


class Expand(torch.autograd.Function):
    """out[b, feature f's columns] = pooled[rows[b, f], those columns]: a variable-batch lookup's
    pooled rows handed to the output samples that share them, one gather a run of features of
    one width (one for the whole output when all share it). The backward adds the gradients of
    the samples sharing a row deterministically: index_put(accumulate=True) sorts on CUDA,
    index_add runs in order on the CPU (torch's deterministic-algorithms notes: each op's other
    device is the nondeterministic one)."""

    @staticmethod
    def forward(ctx, pooled, rows, dims):
        ctx.save_for_backward(rows)
        ctx.runs, ctx.shape = _runs(dims), pooled.shape
        B, parts = rows.shape[0], []
        for f, n, col, d in ctx.runs:
            if n * d == pooled.shape[1]:  # one width for all: a row gather over (pooled row, feature) rows
                at = (rows * n + torch.arange(n, device=rows.device)).reshape(-1)
                # (traced: torch's indexing, which Inductor fuses; dynamo traces no launch outside an op)
                flat = pooled.view(-1, d)
                parts.append((flat[at] if tracing() else gather(flat, at)).view(B, n * d))
                continue
            block = pooled[:, col:col + n * d].unflatten(1, (n, d))
            parts.append(block[rows[:, f:f + n], torch.arange(n, device=rows.device)].reshape(B, n * d))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        B, parts = rows.shape[0], []
        for f, n, col, d in ctx.runs:
            # flat (pooled row, feature of the run) of every output sample's block
            at = (rows[:, f:f + n] * n + torch.arange(n, device=rows.device)).reshape(-1)
            g = grad[:, col:col + n * d].reshape(B * n, d)
            part = grad.new_zeros(ctx.shape[0] * n, d)
            part.index_put_((at,), g, accumulate=True) if part.is_cuda else part.index_add_(0, at, g)
            parts.append(part.view(-1, n * d))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1), None, None
