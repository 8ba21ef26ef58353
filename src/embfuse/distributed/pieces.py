"""Column pieces of a table whose optimizer keeps one state a row, updated exactly (see
PieceUpdate)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from embfuse.nn.collection import EmbeddingBagCollection
from embfuse.ops.bags import accumulation
from embfuse.ops.collection import collection_backward_reference
from embfuse.sparse.jagged import KeyedJaggedTensor


class PieceUpdate:
    """The update of column pieces whose optimizer keeps one state a row (row-wise Adagrad):
    exact, as the unsharded table's. Every piece of a table sees the same ids in the same order,
    so its touched rows line up across the pieces; once the backward has reached the pieces,
    each piece sums its part of each touched row's squared gradient, the pieces' sums are added
    by one all_reduce a table (its pieces' group), and each piece applies the rule with the whole
    row's mean. Of a bf16 or fp16 table, the gradient is the pooled output's, reduced into the
    rows in fp32 here (`watch`), as the unsharded fused update keeps it: autograd's gradient of
    such a table is rounded to its dtype. Torch ops and a dense gradient of the pieces: this
    combination pays a slower update for exactness."""

    def __init__(self, pieces: EmbeddingBagCollection, optimizer, tables: list[tuple]):
        self.pieces, self.optimizer, self.tables = pieces, optimizer, tables  # tables: (group, full width)
        _, value = optimizer.state_spec()["sum"]
        self.state = torch.full((pieces._row_starts[-1],), float(value), dtype=torch.float32,
                                device=pieces.weights.device)
        self.steps, self._touched, self._batch, self._grad = 0, None, None, None
        pieces.weights.register_post_accumulate_grad_hook(self._update)

    @property
    def _rounded(self) -> bool:
        """Whether autograd's gradient of the pieces is rounded (a 2-byte table)."""
        return self.pieces.weights.element_size() < 4

    def saw(self, kjt: KeyedJaggedTensor) -> None:
        """The rows each piece table's features look up in this batch (a host read: torch.unique),
        and of 2-byte tables the batch as the pieces' lookup reads it (for the gradient)."""
        per_key = dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))
        touched = [torch.unique(torch.cat([per_key[f].long() for f in t.feature_names])) for t in self.pieces.tables]
        self._touched = [rows[rows >= 0] for rows in touched]  # (ids < 0 touch no row: routing.py)
        if self._rounded:
            B, plan, values, offsets, psw, _, _ = self.pieces._checked(kjt, True)
            self._batch = (values, offsets, psw, plan.meta, B, plan.max_dim)

    def watch(self, out: torch.Tensor) -> None:
        """Keep the gradient of the pieces' pooled output `out` for `_update` (2-byte tables)."""
        if self._rounded and out.requires_grad:
            out.register_hook(self._keep)

    def _keep(self, grad: torch.Tensor) -> None:
        self._grad = grad

    def _update(self, weights) -> None:
        hyper = self.optimizer.hyper(self.steps + 1)
        acc = accumulation(weights)
        grad = weights.grad
        if self._grad is not None:  # (the reduction in fp32, as the unsharded fused update's)
            values, offsets, psw, meta, B, max_dim = self._batch
            grad = collection_backward_reference(self._grad.to(acc), values, offsets, psw, meta, B, weights.numel(),
                                                 max_dim)
        self._grad = self._batch = None
        starts, rows_at = self.pieces._starts, self.pieces._row_starts
        with torch.no_grad():
            for i, ((group, width), rows) in enumerate(zip(self.tables, self._touched)):
                n, d = self.pieces._shapes[i]
                w = weights.data[starts[i]:starts[i + 1]].view(n, d)
                w_rows = w[rows].to(acc)
                g = self.optimizer.decayed(grad[starts[i]:starts[i + 1]].view(n, d)[rows].to(acc), w_rows)
                squares = (g * g).sum(1)
                dist.all_reduce(squares, group=group)
                state = self.state[rows_at[i]:rows_at[i + 1]]
                s = state[rows] + squares / width
                state[rows] = s.to(state.dtype)
                w[rows] = (w_rows - hyper.lr * g / (s.sqrt() + hyper.eps)[:, None]).to(w.dtype)
        weights.grad = None
        self.steps += 1
