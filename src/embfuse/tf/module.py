"""A trainable table with TensorFlow's safe sparse lookup: `SafeEmbeddingBag`.

`module(sparse_ids, sparse_weights)` gives `safe_embedding_lookup_sparse(module.weight, sparse_ids,
sparse_weights, combiner, default_id)` (lookup.py's rules) and, with `optimizer=` (an
embfuse.optim rule), its backward updates the touched rows in place, as embfuse.nn.EmbeddingBag's.

How, without a host read (when the weights were built on the ids' index tensor, so that their
indices need no comparison): every rule is a weighted sum over a divisor. An id TensorFlow would
drop (id < 0; weight <= 0 for mean and sqrtn) stays in place with weight 0 and id 0; with a
default id, each row gets one more entry, the default id, weighted 1 when the row kept nothing and
0 otherwise. The entries then pool in one weighted-sum embedding_bag (fused backward + update),
and mean / sqrtn divide by the row's sum of weights / root sum of squared weights (0 where it is
0): for kept entries and the default that is exactly TensorFlow's count, weight sum or root.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from embfuse.nn.modules import EmbeddingBag
from embfuse.tf.lookup import COMBINERS, _sparse_parts, _weights_of, safe_entries


class SafeEmbeddingBag(torch.nn.Module):
    """One table (`weight`: num_embeddings x embedding_dim, torch's init N(0, 1) as
    nn.EmbeddingBag) looked up as TensorFlow's `safe_embedding_lookup_sparse`: combiner sum,
    mean or sqrtn; ids < 0 (and weights <= 0 for mean and sqrtn) dropped; rows left without ids
    given `default_id` (weight 1) or zeros; ids of rank > 2 pooled over their last dimension.
    `optimizer`: an embfuse.optim rule applied inside the backward. max_norm and partitioned
    tables are the functional API's (embfuse.tf.safe_embedding_lookup_sparse)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, combiner: str = "mean",
                 default_id: Optional[int] = None, optimizer=None, device=None, dtype=None):
        super().__init__()
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
        if default_id is not None and not 0 <= default_id < num_embeddings:
            raise ValueError(f"default_id {default_id} is out of range for a table of {num_embeddings} rows")
        self.combiner, self.default_id = combiner, default_id
        self.bag = EmbeddingBag(num_embeddings, embedding_dim, mode="sum", optimizer=optimizer, device=device,
                                dtype=dtype, include_last_offset=True)

    @property
    def weight(self) -> Tensor:
        return self.bag.weight

    def forward(self, sparse_ids: Tensor, sparse_weights: Optional[Tensor] = None) -> Tensor:
        indices, ids, shape = _sparse_parts(sparse_ids, "sparse_ids")
        given = _weights_of(sparse_weights, indices)
        dev, N = ids.device, math.prod(shape[:-1])
        rows, ids, keep = safe_entries(indices, ids, shape, given, self.combiner)
        acc = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        w = keep.to(acc) if given is None else torch.where(keep, given.to(acc), 0)
        ids = torch.where(keep, ids, 0)
        # TensorFlow's contract is row-major order; a stable sort keeps it and makes it so (a
        # coalesced sparse tensor is in that order already: sorted, unique indices)
        if not sparse_ids.is_coalesced():
            rows, order = torch.sort(rows, stable=True)
            ids, w, keep = ids[order], w[order], keep[order]
        count = torch.zeros(N + 1, dtype=torch.int64, device=dev)
        count[1:].index_add_(0, rows, torch.ones_like(rows))
        offsets = count.cumsum(0)
        if self.default_id is not None:  # one more entry a row, after its own: the default id
            kept = torch.zeros(N, dtype=torch.int64, device=dev).index_add_(0, rows, keep.long())
            n = ids.numel()
            real_at = torch.arange(n, device=dev) + rows  # each earlier row gained one slot
            default_at = offsets[1:] + torch.arange(N, device=dev)
            ext_ids = torch.empty(n + N, dtype=torch.int64, device=dev)
            ext_w = torch.empty(n + N, dtype=acc, device=dev)
            ext_ids[real_at], ext_w[real_at] = ids, w
            ext_ids.index_fill_(0, default_at, self.default_id)  # (a python int through [] = is a host copy)
            ext_w[default_at] = (kept == 0).to(acc)
            ext_rows = torch.empty(n + N, dtype=torch.int64, device=dev)
            ext_rows[real_at], ext_rows[default_at] = rows, torch.arange(N, device=dev)
            ids, w, rows, offsets = ext_ids, ext_w, ext_rows, offsets + torch.arange(N + 1, device=dev)
        pooled = self.bag(ids, offsets, per_sample_weights=w.to(self.weight.dtype))
        if self.combiner != "sum":
            div = torch.zeros(N, dtype=acc, device=dev).index_add_(0, rows, w if self.combiner == "mean" else w * w)
            if self.combiner == "sqrtn":
                div = div.sqrt()
            pooled = torch.where(div[:, None] != 0, pooled.to(acc) / torch.where(div != 0, div, 1)[:, None], 0)
        return pooled.to(self.weight.dtype).reshape(*shape[:-1], self.weight.shape[1])
