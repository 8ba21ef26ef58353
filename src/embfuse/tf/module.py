"""A trainable table with TensorFlow's safe sparse lookup: `SafeEmbeddingBag`.

`module(sparse_ids, sparse_weights)` gives `safe_embedding_lookup_sparse(module.weight, sparse_ids,
sparse_weights, combiner, default_id)` (lookup.py's rules) and, with `optimizer=` (an
embfuse.optim rule), its backward updates the touched rows in place, as embfuse.nn.EmbeddingBag's.

How, without a host read: the table is a collection of one (lookup.py's lookup_bags): the
deferred check, TensorFlow's safe rules in one pass (ops/safe.py: dropped ids stay in place,
skipped by the kernels; a default id is one more entry a row, used only where the row kept
nothing), and one pooling launch in the combiner's pooling (mean: wmean, over the weights' sum;
sqrtn: over their root sum of squares), whose backward updates only the rows TensorFlow looked
up. `bag` (an embfuse.nn.EmbeddingBag) holds the weight and the optimizer state. For many
features at once, an EmbeddingBagCollection of tables with `combiner=` does the same in one
launch each way.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from embfuse.nn.modules import EmbeddingBag
from embfuse._triton import needs_op
from embfuse.ops.bags import accumulation
from embfuse.ops.safe import POOLING, safe_rule
from embfuse.tf.lookup import COMBINERS, sparse_parts, weights_of, bags_of, entry_rows, lookup_bags, one_table_plan


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
        self.bag = EmbeddingBag(num_embeddings, embedding_dim, mode=POOLING[combiner], optimizer=optimizer,
                                device=device, dtype=dtype, include_last_offset=True)

    @property
    def weight(self) -> Tensor:
        return self.bag.weight

    def forward(self, sparse_ids: Tensor, sparse_weights: Optional[Tensor] = None) -> Tensor:
        indices, ids, shape = sparse_parts(sparse_ids, "sparse_ids")
        given = weights_of(sparse_weights, indices)
        N = math.prod(shape[:-1])
        ids, offsets, w, order = bags_of(entry_rows(indices, shape), ids, given, N, sparse_ids.is_coalesced(),
                                         accumulation(self.weight))
        plan = one_table_plan(self.weight, self.combiner, safe_rule(self.combiner, given is not None, self.default_id))
        fused = self.bag._fused_now()
        out = lookup_bags(self.weight.view(-1), ids, offsets, w, plan, N, self.bag.bounds_check, fused,
                          fresh=fused is not None or needs_op(self.weight), positions=order)
        return out.reshape(*shape[:-1], self.weight.shape[1])
