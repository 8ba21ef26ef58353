"""Column pieces of a table whose optimizer keeps one state a row, updated exactly (see
PieceUpdate)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from embfuse.nn.collection import EmbeddingBagCollection
from embfuse.ops.bags import accumulation
from embfuse.sparse.jagged import KeyedJaggedTensor


class PieceUpdate:
    """The update of column pieces whose optimizer keeps one state a row (row-wise Adagrad):
    exact, as the unsharded table's, for fp32 and fp64 tables. (A 2-byte table's gradient comes
    through autograd in the table's dtype, each touched row's sum rounded once, where the
    unsharded fused update keeps it fp32: its updated weights may differ by an ulp.) Every piece
    of a table sees the same ids in the same order, so its touched rows line up across the
    pieces; after the backward has accumulated the pieces' gradient, each piece sums its part of
    each touched row's squared gradient, the pieces' sums are added by one all_reduce a table
    (its pieces' group), and each piece applies the rule with the whole row's mean. Torch ops and
    a dense gradient of the pieces: this combination pays a slower update for exactness."""

    def __init__(self, pieces: EmbeddingBagCollection, optimizer, tables: list[tuple]):
        self.pieces, self.optimizer, self.tables = pieces, optimizer, tables  # tables: (group, full width)
        _, value = optimizer.state_spec()["sum"]
        self.state = torch.full((pieces._row_starts[-1],), float(value), dtype=torch.float32,
                                device=pieces.weights.device)
        self.steps, self._touched = 0, None
        pieces.weights.register_post_accumulate_grad_hook(self._update)

    def saw(self, kjt: KeyedJaggedTensor) -> None:
        """The rows each piece table's features look up in this batch (a host read: torch.unique)."""
        per_key = dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))
        self._touched = [torch.unique(torch.cat([per_key[f].long() for f in t.feature_names]))
                         for t in self.pieces.tables]

    def _update(self, weights) -> None:
        hyper = self.optimizer.hyper(self.steps + 1)
        grad = weights.grad
        starts, rows_at = self.pieces._starts, self.pieces._row_starts
        acc = accumulation(weights)
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
