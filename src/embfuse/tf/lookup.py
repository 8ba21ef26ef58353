"""TensorFlow's sparse embedding lookups (`tf.compat.v1.nn`), with TensorFlow's numbers.

For a 2-D sparse batch (row r holding ids i_k with weights w_k, w = 1 when unweighted):

    sum   = sum_k w_k e(i_k)
    mean  = sum_k w_k e(i_k) / sum_k w_k          (0 where the divisor is 0)
    sqrtn = sum_k w_k e(i_k) / sqrt(sum_k w_k^2)  (0 where the divisor is 0)

e(i) is row i of the (possibly partitioned) table, clipped to norm max_norm when given:
e * max_norm / max(||e||, max_norm), out of place and differentiable, never written back.
A partitioned table is a list of P shards: "mod" puts id i in shard i % P at row i // P; "div"
gives shard p the ids [p * q + min(p, r), ...) with q, r = divmod(total rows, P), the first r
shards one row more. `safe_embedding_lookup_sparse` first drops ids < 0 (and, for mean and
sqrtn, weights <= 0), gives each row without ids `default_id` with weight 1 (or zeros without a
default_id), and flattens ids of rank > 2 to 2-D, reshaping the output back.

Inputs are torch sparse COO tensors (`torch.sparse_coo_tensor(indices, values, size)`, TF's
SparseTensor), read as given (not coalesced: TensorFlow sums no duplicates either). Where the
semantics allow it (one table, no max_norm) the pooling is embfuse's `embedding_bag` (one
deferred-checked kernel, its deterministic backward); otherwise the lookup is composed of torch
ops, which is also the reference the tests check the fast path against.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from embfuse._triton import needs_op, tracing
from embfuse.ops.bags import accumulation, index_sum
from embfuse.ops.collection import Plan, embedding_bag_collection
from embfuse.ops.errors import BadArgumentError, BadDtypeError, BadIdError, UnsupportedError
from embfuse.ops.safe import POOLING, safe_bags, safe_rule
from embfuse.ops.validate import validate_collection
from embfuse.optim.lookup import fused_embedding_bag_collection

COMBINERS = ("sum", "mean", "sqrtn")
Params = Union[Tensor, Sequence[Tensor]]


def _shards(params: Params, what: str) -> list[Tensor]:
    shards = [params] if isinstance(params, Tensor) else list(params)
    if not shards:
        raise ValueError(f"{what} needs at least one table or shard")
    for s in shards:
        if not isinstance(s, Tensor) or s.dim() != 2:
            raise BadArgumentError(f"{what}: every shard must be a 2-D tensor, got "
                                   f"{getattr(s, 'shape', type(s).__name__)}")
    first = shards[0]
    for p, s in enumerate(shards[1:], 1):
        if s.shape[1] != first.shape[1] or s.dtype != first.dtype or s.device != first.device:
            raise BadArgumentError(f"{what}: shard {p} is {tuple(s.shape)} {s.dtype} on {s.device}, shard 0 is "
                                   f"{tuple(first.shape)} {first.dtype} on {first.device}: shards share a width, "
                                   f"a dtype and a device")
    return shards


def _check_ids(ids: Tensor, total: int, what: str) -> None:
    """Every id inside the (whole) table: a host read, as TensorFlow's gather checks too."""
    if ids.numel() == 0:
        return
    bad = ((ids < 0) | (ids >= total)).nonzero()
    if bad.numel():
        p = int(bad[0, 0])
        raise BadIdError(f"{what}: id {int(ids.reshape(-1)[p])} at position {p} is out of range for a table of "
                         f"{total} rows (valid ids are 0..{total - 1})")


def _clip(rows: Tensor, max_norm: Optional[float]) -> Tensor:
    """TensorFlow's clip_by_norm of each row (its safe square root: no NaN gradient at 0)."""
    if max_norm is None:
        return rows
    acc = rows.float() if rows.dtype in (torch.float16, torch.bfloat16) else rows
    l2sum = (acc * acc).sum(-1, keepdim=True)
    positive = l2sum > 0
    l2norm = torch.where(positive, torch.where(positive, l2sum, 1).sqrt(), l2sum)
    return (acc * max_norm / torch.clamp(l2norm, min=max_norm)).to(rows.dtype)


def _gather(shards: list[Tensor], ids: Tensor, partition_strategy: str) -> Tensor:
    """Rows of the partitioned table for `ids` (1-D int64, in range), differentiable."""
    P = len(shards)
    if P == 1:
        return shards[0][ids]
    if partition_strategy == "mod":
        shard, row = ids % P, ids // P
    elif partition_strategy == "div":
        q, r = divmod(sum(s.shape[0] for s in shards), P)
        shard = torch.where(ids < r * (q + 1), ids // (q + 1), (ids - r) // max(q, 1))
        row = torch.where(shard < r, ids % (q + 1), (ids - r) % max(q, 1))
    else:
        raise ValueError(f"partition_strategy must be 'mod' or 'div', got {partition_strategy!r}")
    out = shards[0].new_zeros(ids.numel(), shards[0].shape[1])
    for p, s in enumerate(shards):  # (every shard, even one no id reads: the output stays in the graph)
        take = (shard == p).nonzero()[:, 0]
        out = out.index_put((take,), s[row[take]])
    return out


def _total_rows(shards: list[Tensor], partition_strategy: str) -> int:
    """All rows of the partitioned table; the shards must have the sizes both strategies assume
    (TensorFlow's: the first total % P shards one row more than the others)."""
    if partition_strategy not in ("mod", "div"):
        raise ValueError(f"partition_strategy must be 'mod' or 'div', got {partition_strategy!r}")
    total = sum(s.shape[0] for s in shards)
    q, r = divmod(total, len(shards))
    for p, s in enumerate(shards):
        if s.shape[0] != q + (p < r):
            raise BadArgumentError(f"shard {p} has {s.shape[0]} rows; {len(shards)} shards of {total} rows in all "
                                   f"hold {q + 1} rows each in the first {r} and {q} in the others")
    return total


def embedding_lookup(params: Params, ids: Tensor, partition_strategy: str = "mod",
                     max_norm: Optional[float] = None) -> Tensor:
    """`tf.nn.embedding_lookup`: rows of `params` (one table or a list of shards) for `ids` of any
    shape; output `ids.shape + [D]`."""
    shards = _shards(params, "embedding_lookup")
    if ids.dtype not in (torch.int32, torch.int64):
        raise BadDtypeError(f"ids must be int32 or int64, got {ids.dtype}")
    flat = ids.reshape(-1).long()
    _check_ids(flat, _total_rows(shards, partition_strategy), "embedding_lookup")
    rows = _clip(_gather(shards, flat, partition_strategy), max_norm)
    return rows.reshape(*ids.shape, shards[0].shape[1])


def sparse_parts(sp: Tensor, what: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    if not isinstance(sp, Tensor) or sp.layout != torch.sparse_coo:
        raise TypeError(f"{what} must be a torch sparse COO tensor (TensorFlow's SparseTensor), got "
                        f"{getattr(sp, 'layout', type(sp).__name__)}")
    if sp.sparse_dim() < 2 or sp.dense_dim() != 0:
        raise BadArgumentError(f"{what} must have rank 2 or more with scalar values, got shape {tuple(sp.shape)}")
    return sp._indices(), sp._values(), tuple(sp.shape)


def weights_of(sp_weights: Optional[Tensor], indices: Tensor, grad: bool = False) -> Optional[Tensor]:
    """The weights' values, checked against the ids' indices. `grad`: the caller can give them a
    gradient (the composed path): they come differentiable then, which torch allows only for a
    coalesced sparse tensor."""
    if sp_weights is None:
        return None
    w_idx, w, _ = sparse_parts(sp_weights, "sparse_weights")
    # (the same index tensor, as when both were built from one: no device read to compare them)
    if w_idx.shape != indices.shape or (w_idx.data_ptr() != indices.data_ptr() and not torch.equal(w_idx, indices)):
        raise BadArgumentError("sparse_weights must have the same indices as sparse_ids")
    if not w.is_floating_point():
        raise BadDtypeError(f"sparse_weights must be floating point, got {w.dtype}")
    if sp_weights.requires_grad and torch.is_grad_enabled():  # (no silent zero gradient: _values() is detached)
        if not grad:
            raise UnsupportedError("sparse_weights get no gradient from SafeEmbeddingBag or keyed_batch; detach "
                                   "them, or use embfuse.tf.safe_embedding_lookup_sparse, which gives them one")
        if not sp_weights.is_coalesced():
            raise UnsupportedError("sparse_weights that require a gradient must be coalesced (torch differentiates "
                                   "a sparse tensor's values() only then): .coalesce() them and sparse_ids alike")
        return sp_weights.values()
    return w


def combine_reference(shards, rows, ids, weights, num_rows, combiner, partition_strategy, max_norm):
    """The composed form (what TensorFlow's graph does): gather, clip, weight, segment sums,
    divide where the divisor is not 0. Accumulates in fp32 (fp64 for fp64 tables)."""
    table = shards[0]
    acc = accumulation(table)
    e = _clip(_gather(shards, ids, partition_strategy), max_norm).to(acc)
    w = torch.ones(ids.numel(), dtype=acc, device=ids.device) if weights is None else weights.to(acc)
    out = index_sum(num_rows, rows, e * w[:, None])
    if combiner == "mean":
        div = index_sum(num_rows, rows, w)
    elif combiner == "sqrtn":
        div = index_sum(num_rows, rows, w * w).sqrt()
    else:
        return out.to(table.dtype)
    return torch.where(div[:, None] != 0, out / torch.where(div != 0, div, 1)[:, None], 0).to(table.dtype)


def _wants_grad(weights: Optional[Tensor]) -> bool:
    """Whether the weights (from weights_of: differentiable only when a gradient is asked for)
    take a gradient: the lookup then takes the composed path (torch ops, TensorFlow's graph),
    which autograd differentiates with respect to them too."""
    return weights is not None and weights.requires_grad


def _combiner(combiner: Optional[str]) -> str:
    combiner = "mean" if combiner is None else combiner
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner


def embedding_lookup_sparse(params: Params, sp_ids: Tensor, sp_weights: Optional[Tensor] = None,
                            combiner: Optional[str] = None, max_norm: Optional[float] = None,
                            partition_strategy: str = "mod") -> Tensor:
    """`tf.compat.v1.nn.embedding_lookup_sparse`: a 2-D sparse batch pooled per row; the output
    has (largest row holding an id) + 1 rows, inner rows without ids zeros. combiner None is
    "mean", as TensorFlow's."""
    combiner = _combiner(combiner)
    shards = _shards(params, "embedding_lookup_sparse")
    indices, ids, shape = sparse_parts(sp_ids, "sp_ids")
    if len(shape) != 2:
        raise BadArgumentError(f"sp_ids must be 2-D (use safe_embedding_lookup_sparse for higher ranks), got {shape}")
    weights = weights_of(sp_weights, indices, grad=True)
    ids = ids.long()
    _check_ids(ids, _total_rows(shards, partition_strategy), "embedding_lookup_sparse")
    rows = indices[0].contiguous()
    num_rows = int(rows.max()) + 1 if rows.numel() else 0
    if len(shards) == 1 and max_norm is None and not _wants_grad(weights):  # every entry kept, ids checked above
        return pool_one_table(shards[0], rows, ids, weights, num_rows, combiner, None, ordered=sp_ids.is_coalesced(),
                              checked=True)
    return combine_reference(shards, rows, ids, weights, num_rows, combiner, partition_strategy, max_norm)


def entry_rows(indices: Tensor, shape) -> Tensor:
    """Each entry's row in the flattened [prod(shape[:-1]), shape[-1]] form (row-major). No host read."""
    rows = indices[0]
    for d in range(1, len(shape) - 1):
        rows = rows * shape[d] + indices[d]
    return rows.contiguous()


def safe_entries(indices: Tensor, ids: Tensor, shape, weights: Optional[Tensor], combiner: str):
    """(entry_rows, ids as int64, whether safe_embedding_lookup_sparse keeps each entry: id >= 0;
    weight > 0 unless the combiner is sum). No host read."""
    ids = ids.long()
    keep = ids >= 0
    if weights is not None and combiner != "sum":
        keep &= weights > 0
    return entry_rows(indices, shape), ids, keep


def safe_embedding_lookup_sparse(embedding_weights: Params, sparse_ids: Tensor,
                                 sparse_weights: Optional[Tensor] = None, combiner: str = "mean",
                                 default_id: Optional[int] = None, max_norm: Optional[float] = None,
                                 partition_strategy: str = "div") -> Tensor:
    """`tf.compat.v1.nn.safe_embedding_lookup_sparse`: ids < 0 dropped (and weights <= 0 unless
    combiner is "sum"), rows without ids given `default_id` or zeros; sparse_ids of rank R > 2
    flattened to 2-D and the output shaped `sparse_ids.shape[:-1] + [D]`."""
    combiner = _combiner(combiner)
    shards = _shards(embedding_weights, "safe_embedding_lookup_sparse")
    indices, ids, shape = sparse_parts(sparse_ids, "sparse_ids")
    weights = weights_of(sparse_weights, indices, grad=True)
    total = _total_rows(shards, partition_strategy)
    if default_id is not None and not 0 <= default_id < total:
        raise BadIdError(f"default_id {default_id} is out of range for a table of {total} rows")
    batch = 1
    for s in shape[:-1]:
        batch *= s
    if len(shards) == 1 and max_norm is None and not _wants_grad(weights):
        out = pool_one_table(shards[0], entry_rows(indices, shape), ids, weights, batch, combiner,
                             safe_rule(combiner, weights is not None, default_id), ordered=sparse_ids.is_coalesced())
        return out.reshape(*shape[:-1], shards[0].shape[1])
    rows, ids, keep = safe_entries(indices, ids, shape, weights, combiner)
    rows, ids = rows[keep], ids[keep]
    weights = None if weights is None else weights[keep]
    _check_ids(ids, total, "safe_embedding_lookup_sparse")
    empty = torch.ones(batch, dtype=torch.bool, device=ids.device)
    empty[rows] = False
    if default_id is not None:  # each empty row gets the default id, weight 1 (TF's fill_empty_rows)
        filled = empty.nonzero()[:, 0]
        order = torch.argsort(torch.cat([rows, filled]), stable=True)
        rows = torch.cat([rows, filled])[order]
        ids = torch.cat([ids, torch.full_like(filled, default_id)])[order]
        if weights is not None:
            weights = torch.cat([weights, weights.new_ones(filled.numel())])[order]
    out = combine_reference(shards, rows, ids, weights, batch, combiner, partition_strategy, max_norm)
    return out.reshape(*shape[:-1], shards[0].shape[1])


def _plan(rows: int, dim: int, pooling: str, rule: Optional[tuple], device) -> Plan:
    return Plan([(rows, dim)], [(0, pooling, 0)], device, None if rule is None else [rule])


_plan_cached = functools.lru_cache(maxsize=64)(_plan)


def one_table_plan(table: Tensor, combiner: str, rule: Optional[tuple]) -> Plan:
    """The collection plan of one table pooled by `combiner` under `rule` (cached in eager code)."""
    args = (table.shape[0], table.shape[1], POOLING[combiner], rule, table.device)
    return _plan(*args) if tracing() else _plan_cached(*args)


def bags_of(rows: Tensor, ids: Tensor, weights: Optional[Tensor], num_rows: int, ordered: bool,
            dtype) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """(ids, offsets, weights in `dtype`, order) of the num_rows bags that entries (row `rows`,
    id, weight) make. `ordered`: the entries are in row order already (a coalesced sparse tensor:
    sorted, unique indices, TensorFlow's canonical order; order None); otherwise a stable sort
    puts them so (the caller's order within a row is kept) and `order` gives each sorted entry's
    position among the caller's, for error messages."""
    order = None
    if not ordered:
        rows, order = torch.sort(rows, stable=True)
        ids = ids[order]
        weights = None if weights is None else weights[order]
    offsets = torch.searchsorted(rows, torch.arange(num_rows + 1, device=rows.device))
    return ids, offsets, None if weights is None else weights.to(dtype), order


def lookup_bags(flat: Tensor, ids: Tensor, offsets: Tensor, weights: Optional[Tensor], plan: Plan, B: int,
                bounds_check: str = "deferred", fused=None, fresh: bool = True,
                positions: Optional[Tensor] = None) -> Tensor:
    """B bags of one table (`flat`: its weight as one flat view, so that a gradient reaches it)
    through the collection path: the deferred check (ids < 0 let through where the plan's rule
    drops them), the safe pass (ops/safe.py), one pooling launch; its backward, or with `fused`
    (a FusedOptimizer of the table) the update inside it, touches no row a dropped id named.
    `positions`: bags_of's order (errors name the caller's position of a bad id)."""
    ids, offsets, weights, check = validate_collection(ids, offsets, weights, plan.limits, B, ["sparse_ids"],
                                                       ["embedding_weights"], bounds_check, fresh=fresh,
                                                       positions=positions)
    status = None if check is None else check.status
    if plan.rules is not None:
        ids, offsets, weights = safe_bags(ids, offsets, weights, plan.rules, B, status, accumulation(flat))
    if fused is not None:
        return fused_embedding_bag_collection(fused, flat, ids, offsets, weights, plan, B, None, check)
    return embedding_bag_collection(flat, ids, offsets, weights, plan, B, status)


def pool_one_table(table: Tensor, rows: Tensor, ids: Tensor, weights: Optional[Tensor], num_rows: int,
                   combiner: str, rule: Optional[tuple], ordered: bool = False, checked: bool = False) -> Tensor:
    """One table without max_norm, with no host read and a fixed number of launches: the
    entries' bags (bags_of) through `lookup_bags` in the combiner's pooling (mean: wmean, over
    the weights' sum). `checked`: the caller has checked the ids already."""
    ids, offsets, w, order = bags_of(rows, ids, weights, num_rows, ordered, accumulation(table))
    return lookup_bags(table.reshape(-1), ids, offsets, w, one_table_plan(table, combiner, rule), num_rows,
                       "off" if checked else "deferred", fresh=needs_op(table), positions=order)
