"""TensorFlow's per-feature SparseTensors as one keyed batch, for an EmbeddingBagCollection.

A TensorFlow model looks each feature up with its own `safe_embedding_lookup_sparse` call; the
same features as one `KeyedJaggedTensor` are looked up by one EmbeddingBagCollection (tables with
`combiner=` follow TensorFlow's rules) in one launch each way. `keyed_batch` builds that batch on
the device, with no host read: row i of feature f is bag i of f, its ids in row-major order.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from embfuse.ops.errors import BadArgumentError
from embfuse.sparse.jagged import KeyedJaggedTensor
from embfuse.tf.lookup import sparse_parts, weights_of


def keyed_batch(ids: Mapping[str, Tensor], weights: Optional[Mapping[str, Tensor]] = None) -> KeyedJaggedTensor:
    """One KeyedJaggedTensor of the features `ids` (name -> 2-D sparse COO ids, every feature the
    same batch size, as TensorFlow's SparseTensors) and, if given, their `weights` (name -> sparse
    weights on the same indices). Ids are kept as they are (ids < 0 included: tables with
    TensorFlow's combiner drop them). A coalesced tensor is taken in its order; another is put in
    row order by a stable sort."""
    keys = list(ids)
    if not keys:
        raise ValueError("keyed_batch needs at least one feature")
    if weights is not None and set(weights) != set(keys):
        raise BadArgumentError(f"weights must have the features of ids: {sorted(weights)} against {sorted(keys)}")
    values, ws, rows, counts, B = [], [], [], [], None
    for k in keys:
        indices, v, shape = sparse_parts(ids[k], f"ids[{k!r}]")
        if len(shape) != 2:
            raise BadArgumentError(f"ids[{k!r}] must be 2-D (batch, ids of a row), got shape {shape}")
        if B is None:
            B = shape[0]
        elif shape[0] != B:
            raise BadArgumentError(f"ids[{k!r}] has {shape[0]} rows; the features before it have {B}")
        w = None if weights is None else weights_of(weights[k], indices)
        r = indices[0]
        if not ids[k].is_coalesced():
            r, order = torch.sort(r, stable=True)
            v = v[order]
            w = None if w is None else w[order]
        values.append(v)
        ws.append(w)
        rows.append(r + len(rows) * B)  # the entry's bag: feature f's come after f * B
        counts.append(v.numel())
    # the bags ascend, so the offsets are one search (torch.bincount would read its input's max
    # back to the host, and a tensor of the counts made here would be a blocking copy)
    offsets = torch.searchsorted(torch.cat(rows), torch.arange(len(keys) * B + 1, device=values[0].device))
    return KeyedJaggedTensor(keys, torch.cat(values), None if weights is None else torch.cat(ws), offsets=offsets,
                             stride=B, length_per_key=counts)
