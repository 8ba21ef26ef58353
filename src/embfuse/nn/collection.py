"""Table collections with TorchRec's front end: configs, EmbeddingBagCollection, EmbeddingCollection.

All tables of a collection live in ONE flat weight Parameter (`weights`), so a batch of every
feature is looked up by one launch (and trained by one sort and a few launches) whatever the
number of tables. The state_dict shows one tensor per table under TorchRec's keys
(`embedding_bags.<table>.weight`, `embeddings.<table>.weight`), so checkpoints move between
embfuse and TorchRec. With `optimizer=` the backward updates the touched rows in place; the
optimizer state is flat (`optimizer_<name>`, per element or per global row) with `optimizer_step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from embfuse import _handles
from embfuse._triton import needs_op, tracing
from embfuse.nn.modules import FusedModule, fused_table
from embfuse.nn.vbe import Expand, PinnedRing, one_stride
from embfuse.ops.bags import ROW_START, accumulation, bag_of_value
from embfuse.ops.chain import layer_norm_act
from embfuse.ops.collection import Plan, collection_layer_norm, embedding_bag_collection, ranked_rows, table_view
from embfuse.ops.residency import Residency, ResidencyReport, window
from embfuse.ops.safe import POOLING, safe_bags, safe_rule
from embfuse.ops.embedding import lookup_rows
from embfuse.ops.segments import table_starts
from embfuse.ops import tuning
from embfuse.ops.validate import DEFAULT_BOUNDS_CHECK, guard, validate_collection
from embfuse.optim.hot import HotRows
from embfuse.optim.lookup import FusedOptimizer, fused_embedding, fused_embedding_bag_collection
from embfuse.optim.rules import init_state
from embfuse.sparse.jagged import JaggedTensor, KeyedJaggedTensor
from embfuse.sparse.keyed_tensor import KeyedTensor

_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def table_dtype(data_type) -> torch.dtype:
    """A torch dtype, or TorchRec's DataType (FP32 / FP16 / BF16) by name."""
    if isinstance(data_type, torch.dtype):
        return data_type
    name = getattr(data_type, "name", str(data_type)).upper()
    if name not in _DTYPES:
        raise TypeError(f"data_type must be float32, float16 or bfloat16, got {data_type!r}")
    return _DTYPES[name]


def pooling_name(pooling) -> str:
    """"sum" / "mean" (or TorchRec's PoolingType.SUM / MEAN), or TensorFlow's combiners (ops/bags.py):
    "sqrtn" (the sum over the square root of the bag's length, or of its weights' sum of squares)
    and "wmean" (the sum over the bag's weights' sum: TensorFlow's mean)."""
    name = getattr(pooling, "name", str(pooling)).lower()
    if name not in ("sum", "mean", "sqrtn", "wmean"):
        raise ValueError(f"pooling must be sum or mean (TorchRec's pooling types), sqrtn or wmean, got {pooling!r}")
    return name


@dataclass
class TableStatistics:
    """What one batch asked of one table: ids looked up (duplicates counted), distinct rows, and
    the hottest rows as (row, times looked up), most looked-up first (ties: lower row first)."""

    lookups: int
    distinct: int
    hottest: list[tuple[int, int]]


@dataclass
class EmbeddingConfig:
    """One table (TorchRec's field names). Default init: uniform in +-sqrt(1 / num_embeddings)."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: object = torch.float32
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    init_fn: Optional[Callable[[Tensor], None]] = None


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """A pooled table. `pooling`: TorchRec's (sum, mean) or embfuse's sqrtn / wmean. `combiner`
    (TensorFlow's "sum", "mean" or "sqrtn", instead of `pooling`): the table's features are looked
    up as tf.nn.safe_embedding_lookup_sparse does: ids < 0 dropped (and, for mean and sqrtn in a
    weighted collection, weights <= 0), the mean over the weights' sum (wmean), bags left without
    ids given `default_id` with weight 1, or zeros."""

    pooling: object = "sum"
    combiner: Optional[str] = None
    default_id: Optional[int] = None


def _tf_rules(t: EmbeddingBagConfig) -> Optional[str]:
    """The table's pooling when it has TensorFlow's combiner (checked), else None."""
    combiner, default = getattr(t, "combiner", None), getattr(t, "default_id", None)
    if combiner is None:
        if default is not None:
            raise ValueError(f"table {t.name!r}: default_id is TensorFlow's safe lookup rule; give combiner= too")
        return None
    if combiner not in POOLING:
        raise ValueError(f"table {t.name!r}: combiner must be 'sum', 'mean' or 'sqrtn', got {combiner!r}")
    if pooling_name(t.pooling) != "sum":
        raise ValueError(f"table {t.name!r}: give combiner= (TensorFlow's) or pooling= (TorchRec's), not both")
    if default is not None and (isinstance(default, bool) or not isinstance(default, int)
                                or not 0 <= default < t.num_embeddings):
        raise ValueError(f"table {t.name!r}: default_id {default!r} is out of range for {t.num_embeddings} rows")
    return POOLING[combiner]


class TableView(torch.nn.Module):
    """One table of a collection as TorchRec's per-table module shows it: `weight` is a (rows,
    dim) view of the collection's flat buffer (so writes to it are the collection's), with
    `num_embeddings` and `embedding_dim`. Made on each access; not a submodule (the state_dict
    already names each table as TorchRec's does)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape


def embedding_names_by_table(tables) -> list[list[str]]:
    """Each table's output names: its feature names, or f"{feature}@{table}" for a feature that
    several tables look up (TorchRec's names)."""
    count = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]


@torch.compiler.assume_constant_result
def _build_plan(collection: int, keys: tuple, device: str, tail: bool = False) -> bool:
    """Make and keep a collection's Plan for (keys, device, tail) if it has none: plain Python
    even while torch.compile traces (a Plan is host data and device constants, not graph work);
    the arguments are trace constants (`collection`: its _handles name). `tail`: the plan of
    padded batches (Plan.tail)."""
    collection = _handles.lookup(collection)
    key = (keys, torch.device(device), tail)
    if key not in collection._plans:
        plan = collection._new_plan(keys, key[1])
        plan.tail = tail
        plan.table_names = [collection.tables[t].name for t in plan.feature_table]
        collection._plans[key] = plan
        _handles.register(plan)
    return True


class _Collection(FusedModule, _handles.Named, torch.nn.Module):
    """Shared by both collections: the flat buffer, the per-table views, the state_dict keys."""

    _prefix = ""  # "embedding_bags" / "embeddings"

    def __init__(self, tables, device=None, optimizer=None, bounds_check=DEFAULT_BOUNDS_CHECK):
        super().__init__()
        if not tables:
            raise ValueError("a collection needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names) or "" in names:
            raise ValueError(f"tables need distinct, non-empty names; got {names}")
        for t in tables:
            if not t.feature_names:
                t.feature_names = [t.name]  # TorchRec's rule (it sets the config's field too)
            if len(set(t.feature_names)) != len(t.feature_names):
                raise ValueError(f"table {t.name!r} lists a feature twice: {t.feature_names}")
        dtypes = {table_dtype(t.data_type) for t in tables}
        if len(dtypes) > 1:
            raise TypeError(f"the tables of one collection share one buffer and one dtype; got {dtypes}")
        for t in tables:
            for size in ("num_embeddings", "embedding_dim"):
                if isinstance(getattr(t, size), bool) or not isinstance(getattr(t, size), int):
                    raise TypeError(f"table {t.name!r}: {size} must be an int, got {getattr(t, size)!r}")
            if t.num_embeddings <= 0 or t.embedding_dim <= 0:
                raise ValueError(f"table {t.name!r}: num_embeddings and embedding_dim must be positive")
        self.tables = list(tables)
        # a feature of several tables is looked up in each; its outputs are named f"{feature}@{table}"
        # (TorchRec's embedding names). The batch seen by the kernels has one key an output.
        self._names_by_table = embedding_names_by_table(tables)
        self._slots = [(f, name) for t, names in zip(tables, self._names_by_table)
                       for f, name in zip(t.feature_names, names)]
        self.feature_names = list(dict.fromkeys(f for f, _ in self._slots))
        self.embedding_names = [name for _, name in self._slots]
        self._table_of = {name: i for i, names in enumerate(self._names_by_table) for name in names}
        self._shapes = [(t.num_embeddings, t.embedding_dim) for t in tables]
        self._row_starts, self._starts = table_starts(*zip(*self._shapes))
        self.weights = torch.nn.Parameter(torch.empty(self._starts[-1], dtype=dtypes.pop(), device=device))
        self.reset_parameters()
        self._plans = {}
        _handles.register(self)
        self._vbe_ring = PinnedRing()  # (variable batches: their small per-feature host data)
        self._init_fused(bounds_check, optimizer)

    def _plan(self, keys: list[str], device, tail: bool = False) -> Plan:
        """The Plan of a batch with these keys (its features in this order), made once; `tail`:
        of a padded batch. `device`: a torch.device with its index, as the weights'."""
        key = (tuple(keys), device, tail)
        plan = None if tracing() else self._plans.get(key)  # (eager: no _build_plan call once made)
        if plan is None:
            _build_plan(self._embfuse_handle, key[0], str(device), tail)  # (first: a trace sees _plans as it is)
            plan = self._plans[key]
        return plan

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for t, w in zip(self.tables, self.table_weights()):
                if t.init_fn is not None:
                    t.init_fn(w)
                else:
                    bound = math.sqrt(1.0 / t.num_embeddings)
                    hi = bound if t.weight_init_max is None else t.weight_init_max
                    lo = -bound if t.weight_init_min is None else t.weight_init_min
                    w.uniform_(lo, hi)

    def table_weights(self) -> list[Tensor]:
        """Each table as a (rows, dim) view of the flat buffer."""
        return [table_view(self.weights, s, r, d) for s, (r, d) in zip(self._starts, self._shapes)]

    def embedding_weight(self, name: str) -> Tensor:
        return self.table_weights()[[t.name for t in self.tables].index(name)]

    def _table_views(self) -> torch.nn.ModuleDict:
        return torch.nn.ModuleDict({t.name: TableView(w) for t, w in zip(self.tables, self.table_weights())})

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output names (TorchRec's method): f"{feature}@{table}" where tables share a feature."""
        return [list(names) for names in self._names_by_table]

    # --- the optimizer in the backward (flat state; the step count is FusedModule's) ---
    def set_optimizer(self, optimizer) -> None:
        state = init_state(optimizer, self._row_starts[-1], 0, self.weights.device, self.weights.numel())
        for name, tensor in state.items():
            self.register_buffer(f"optimizer_{name}", tensor)
        self._fused = FusedOptimizer(optimizer, 0, 0, self.weights.device, state=state)
        fused_table(self.weights)

    # --- TorchRec's state_dict keys ---
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        del destination[prefix + "weights"]
        for t, w in zip(self.tables, self.table_weights()):
            destination[f"{prefix}{self._prefix}.{t.name}.weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        parts = []
        for t, w in zip(self.tables, self.table_weights()):
            key = f"{prefix}{self._prefix}.{t.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                parts.append(w.detach().reshape(-1))
                continue
            value = state_dict.pop(key)
            if tuple(value.shape) != tuple(w.shape):
                error_msgs.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(w.shape)} here")
                value = w.detach()
            parts.append(value.reshape(-1).to(w.dtype))
        state_dict[prefix + "weights"] = torch.cat(parts)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def statistics(self, features: KeyedJaggedTensor, top_k: int = 5) -> dict[str, TableStatistics]:
        """Per table, what the batch `features` looks up (see TableStatistics), features that
        share a table counted together. On request only: the lookups never compute it. A few
        device ops over the batch and one host read; bad ids raise as in the forward."""
        kjt = self._features(features.unpad() if features._padded else features)
        keys, B = kjt.keys(), kjt.stride()
        plan = self._plan(keys, self.weights.device)
        values, offsets, _, _ = validate_collection(kjt.values(), kjt.offsets(), None, plan.limits, B, keys,
                                                    plan.table_names, "sync")
        T, dev = len(self.tables), values.device
        starts = torch.tensor(self._row_starts, device=dev)
        feature = bag_of_value(offsets, values.numel()) // max(B, 1)
        table = torch.tensor(plan.feature_table, dtype=torch.int64, device=dev)[feature]
        kept = values >= 0  # (TensorFlow-style features drop ids < 0: not looked up)
        feature, table, values = feature[kept], table[kept], values[kept]
        rows, counts, row_table, order, rank = ranked_rows(plan.meta[:, ROW_START][feature] + values.long(), starts)
        lookups = torch.bincount(table, minlength=T)
        distinct = torch.bincount(row_table, minlength=T)
        top = order[rank < top_k]
        local = rows[top] - starts[row_table[top]]
        lookups, distinct, top_table, local, top_counts = (
            t.tolist() for t in (lookups, distinct, row_table[top], local, counts[top]))
        out = {t.name: TableStatistics(lookups[i], distinct[i], []) for i, t in enumerate(self.tables)}
        for i, r, c in zip(top_table, local, top_counts):
            out[self.tables[i].name].hottest.append((r, c))
        return out

    def _traced(self, features) -> Optional[torch.fx.Proxy]:
        """Under torch.fx symbolic tracing (a Proxy for the batch): the collection as one node of
        the graph, since its lookup reads the batch's keys on the host. A submodule becomes a
        call_module node, as a leaf module would; a traced collection alone, a call of its
        forward. None when not traced."""
        if not isinstance(features, torch.fx.Proxy):
            return None
        tracer = features.tracer
        path = tracer.path_of_module(self)
        if path:
            return tracer.create_proxy("call_module", path, (features,), {})
        return tracer.create_proxy("call_function", self.forward, (features,), {})

    def _features(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch restricted to this collection's features (extra keys dropped); one whose
        features have their own batch sizes (TorchRec's VBE) padded to one stride."""
        if kjt.variable_stride_per_key():
            return one_stride(kjt, self._slots, self.embedding_names, self._vbe_ring, expand=False)[0]
        keys = kjt.keys()
        if keys == self.embedding_names:
            return kjt
        missing = [f for f in self.feature_names if f not in keys]
        if missing:
            raise KeyError(f"the batch has no feature {missing[0]!r} (its keys: {keys})")
        if len(self.embedding_names) == len(self.feature_names):  # no feature shared by tables
            return kjt if len(keys) == len(self.feature_names) else kjt.permute(
                [keys.index(f) for f in self.feature_names])
        return self._slot_batch(kjt.permute([keys.index(f) for f, _ in self._slots]))

    def _slot_batch(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """`kjt` (one key a slot, in slot order) with the slots' output names as its keys."""
        return KeyedJaggedTensor(self.embedding_names, kjt.values(), kjt.weights_or_none(), lengths=kjt.lengths(),
                                 stride=kjt.stride(), length_per_key=kjt.length_per_key_or_none())


class EmbeddingBagCollection(_Collection):
    """TorchRec's EmbeddingBagCollection: pooled lookups of every feature of a KeyedJaggedTensor,
    returned as a KeyedTensor (B, sum of widths) in table order, then feature order.

    `hot_rows=K` (with a fused optimizer, unweighted): the training step takes the gradient of
    each table's K most looked-up rows as a dense product instead of a gather a value, the hot
    set taken from the batch every `hot_refresh` steps (optim/hot.py; eager steps only: a step
    captured in a CUDA graph takes the sparse path, as do batches of fewer than
    `hot_min_values` values, where the path costs more than it saves). The update is the same
    up to rounding.

    `pin_hot_rows_in_l2=True` (GPU lookups that train nothing: inference, evaluation): each
    table's most looked-up rows, counted from a batch every `l2_refresh` lookups, are copied into
    one small buffer that the lookup reads through a persisting L2 window (ops/residency.py), or,
    when the lookups crowd into one run of rows (ids numbered by frequency), the window lies over
    that run of the table itself. Outputs are bitwise the same; `l2_residency` reports the hit
    rate, window and mode, or why it is off (no GPU, no persisting L2, nothing hot)."""

    _prefix = "embedding_bags"

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False, device=None, optimizer=None,
                 bounds_check: str = DEFAULT_BOUNDS_CHECK, hot_rows: int = 0, hot_refresh: int = 100,
                 hot_min_values: int = tuning.HOT_MIN_VALUES, pin_hot_rows_in_l2: bool = False,
                 l2_refresh: int = 1000):
        tf_pooling = [_tf_rules(t) for t in tables]
        if any(p is not None for p in tf_pooling) and (hot_rows or pin_hot_rows_in_l2):
            raise ValueError("tables with TensorFlow's combiner take neither hot_rows nor pin_hot_rows_in_l2")
        super().__init__(tables, device, optimizer, bounds_check)
        self._is_weighted = is_weighted
        self._hot = None
        if hot_rows and optimizer is None:
            raise ValueError("hot_rows is a path of the fused training step: it needs optimizer=")
        if hot_rows:
            if is_weighted:
                raise ValueError("hot_rows needs an unweighted collection: per-sample weights do not fold into "
                                 "the dense product")
            self._hot = HotRows(hot_rows, hot_refresh, self._row_starts[-1], len(tables), self.weights.device,
                                hot_min_values)
            # buffers, so that module.to() moves them; not in the state_dict (taken from batches)
            self.register_buffer("hot_slot", self._hot.slot, persistent=False)
            self.register_buffer("hot_keys", self._hot.keys, persistent=False)
        self._residency = Residency(l2_refresh) if pin_hot_rows_in_l2 else None
        self._feature = {}  # output name -> (table index, pooling, first output column)
        self._safe = {}  # output name -> TensorFlow's rules (ops/safe.py), for tables with a combiner
        # batches that come after the safe pass elsewhere (a sharded collection's shards): ids < 0 to pass over
        self._safe_passed = False
        col = 0
        for i, (t, tf, names) in enumerate(zip(tables, tf_pooling, self._names_by_table)):
            for name in names:
                self._feature[name] = (i, tf or pooling_name(t.pooling), col)
                col += t.embedding_dim
                if tf is not None:
                    self._safe[name] = safe_rule(t.combiner, is_weighted, t.default_id)
        self._dims = [self.tables[self._feature[e][0]].embedding_dim for e in self.embedding_names]

    embedding_bags = property(_Collection._table_views, doc="table name -> TableView (TorchRec's ModuleDict)")

    def is_weighted(self) -> bool:
        """Whether the batch's weights scale the pooled rows (TorchRec's method)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.tables

    def _new_plan(self, keys, device) -> Plan:
        plan = Plan(self._shapes, [self._feature[k] for k in keys], device, [self._safe.get(k) for k in keys])
        plan.skips = plan.skips or self._safe_passed
        return plan

    def _checked(self, features: KeyedJaggedTensor, fresh: bool, trains: bool = True, strides=None):
        """The batch restricted to this collection's features and checked (validate_collection;
        `fresh` as there): (B, plan, values, offsets, weights, check, resident). A lookup that
        `trains` nothing with pin_hot_rows_in_l2 gets the ids to read (hot rows from their copy,
        rewritten by the check's pass, unless read in place) and the Resident whose window it runs
        in (else None)."""
        kjt = self._features(features)
        keys, B = kjt.keys(), kjt.stride()
        plan = self._plan(keys, self.weights.device, kjt._padded)
        psw = kjt.weights_or_none() if self._is_weighted else None
        if self._is_weighted and psw is None:
            raise ValueError("a weighted collection (is_weighted=True) needs a batch with weights")
        if kjt._padded and (plan.rules is not None or (trains and self._hot is not None)):
            raise NotImplementedError("a padded batch cannot be looked up with TensorFlow's safe rules or trained "
                                      "with hot_rows; unpad() it")
        resident = None if trains else self._resident(plan, kjt.values(), kjt.offsets(), B)
        # a large forward reads its int64 ids as the int32 the check writes (benchmarks/NOTES.md, session 35)
        narrow = not trains and plan.rules is None and tuning.narrows(plan.narrow_dim, kjt.values().numel())
        values, offsets, psw, check = validate_collection(
            kjt.values(), kjt.offsets(), psw, plan.limits, B, keys,
            plan.table_names, self.bounds_check, fresh=fresh,
            remap=None if resident is None else resident.remap, tail=kjt._padded, narrow=narrow)
        if plan.rules is not None:  # TensorFlow's safe rules: one pass, sizes known on the host
            values, offsets, psw = safe_bags(values, offsets, psw, plan.rules, B,
                                             None if check is None else check.status, accumulation(self.weights),
                                             strides=strides)
        return B, plan, values, offsets, psw, check, resident

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        traced = self._traced(features)
        if traced is not None:
            return traced
        rows = strides = None
        if features.variable_stride_per_key():  # TorchRec's variable batch size per feature
            features, rows, strides = one_stride(features, self._slots, self.embedding_names, self._vbe_ring)
        fused = self._fused_now()
        trains = fused is not None or needs_op(self.weights)
        B, plan, values, offsets, psw, check, resident = self._checked(features, trains, trains, strides)
        if fused is not None:
            hot = self._hot
            if hot is not None:
                hot.slot, hot.keys = self.hot_slot, self.hot_keys
            out = fused_embedding_bag_collection(fused, self.weights, values, offsets, psw, plan, B, hot, check)
        else:
            status = None if check is None else check.status
            with window(resident):
                out = embedding_bag_collection(self.weights, values, offsets, psw, plan, B, status)
        if rows is not None:
            out = Expand.apply(out, rows, self._dims)
        return KeyedTensor(self.embedding_names, self._dims, out)

    @property
    def l2_residency(self) -> Optional[ResidencyReport]:
        """What `pin_hot_rows_in_l2` does now (hit rate, window, or why it is off); None when off."""
        return None if self._residency is None else self._residency.report

    def _resident(self, plan: Plan, values, offsets, B):
        """The hot rows' Resident for a lookup that trains nothing, or None (ops/residency.py).
        The batch is not checked yet: counting keeps the ids inside the tables."""
        if self._residency is None:
            return None
        F = plan.meta.shape[0]

        def global_rows():  # (-1 past the last bag: a padded batch's padding is no lookup)
            bag = bag_of_value(offsets, values.numel())
            rows = plan.meta[:, ROW_START][(bag // max(B, 1)).clamp(0, F - 1)] + values.long()
            return torch.where(bag < offsets.numel() - 1, rows, -1)

        step = self._fused.step if self._fused is not None else 0
        return self._residency.resident(self.weights, self.table_weights, self._row_starts, global_rows,
                                        plan.feature_table, step)

    def forward_layer_norm(self, features: KeyedJaggedTensor, weight: Optional[Tensor], bias: Optional[Tensor],
                           eps: float = 1e-5, activation: str = "none") -> Tensor:
        """`forward(features).values()` seen as (B, F, D), through embfuse.ops.chain's
        `layer_norm_act` (weight, bias: (F, D) or None), flattened back to (B, F * D). For
        inference (no autograd), every feature D wide (D <= 256): one op (on a GPU the chain in
        the pooling kernel's epilogue, one launch and one write). Otherwise: the lookup, then
        the chain."""
        dims = set(self._dims)
        D = self._dims[0] if len(dims) == 1 else 0
        recorded = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                   for t in (self.weights, weight, bias))
        if recorded or self._fused_now() is not None or not 0 < D <= 256 or features.variable_stride_per_key():
            x = self(features).values()
            return layer_norm_act(x.view(x.shape[0], -1, max(dims)), weight, bias, eps, activation).flatten(1)
        F = len(self.embedding_names)
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and (tuple(t.shape) != (F, D) or t.device != self.weights.device):
                raise ValueError(f"{name} must be ({F}, {D}) on {self.weights.device}, got "
                                 f"{tuple(t.shape)} on {t.device}")
        B, plan, values, offsets, psw, check, resident = self._checked(features, fresh=False, trains=False)
        with window(resident):
            return collection_layer_norm(self.weights, values, offsets, psw, plan, B,
                                         None if check is None else check.status, weight, bias, eps, activation)


class EmbeddingCollection(_Collection):
    """TorchRec's EmbeddingCollection: unpooled lookups, one JaggedTensor of (n_f, D) rows per
    feature. Tables share one width (as in TorchRec), so the flat buffer is a (rows, D) table and
    one gather of global rows (table start + id) serves every feature."""

    _prefix = "embeddings"

    def __init__(self, tables: list[EmbeddingConfig], device=None, need_indices: bool = False, optimizer=None,
                 bounds_check: str = DEFAULT_BOUNDS_CHECK):
        dims = {t.embedding_dim for t in tables}
        if len(dims) > 1:
            raise ValueError(f"the tables of an EmbeddingCollection share one embedding_dim; got {sorted(dims)}")
        super().__init__(tables, device, optimizer, bounds_check)
        self._embedding_dim = dims.pop()
        self._need_indices = need_indices

    embeddings = property(_Collection._table_views, doc="table name -> TableView (TorchRec's ModuleDict)")

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self.tables

    def embedding_dim(self) -> int:
        """The width every table shares (TorchRec's method)."""
        return self._embedding_dim

    def need_indices(self) -> bool:
        """Whether each output JaggedTensor carries its ids as its weights (TorchRec's)."""
        return self._need_indices

    def _new_plan(self, keys, device) -> Plan:
        return Plan(self._shapes, [(self._table_of[k], "sum", 0) for k in keys], device)

    def set_optimizer(self, optimizer) -> None:
        super().set_optimizer(optimizer)
        # the flat buffer is one (rows, D) table here: element state takes that shape
        for name, (per, _) in optimizer.state_spec().items():
            if per == "element":
                dim = self._shapes[0][1]  # (set before EmbeddingCollection's own attributes)
                self.register_buffer(f"optimizer_{name}", getattr(self, f"optimizer_{name}").view(-1, dim))

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        traced = self._traced(features)
        if traced is not None:
            return traced
        if features._padded:
            raise NotImplementedError("EmbeddingCollection's outputs have the batch's own sizes: unpad() the batch")
        strides = None  # (features with their own batch sizes: each output keeps its feature's)
        if features.variable_stride_per_key():
            own = dict(zip(features.keys(), features.stride_per_key()))
            strides = [own[f] for f, _ in self._slots]
        kjt = self._features(features)
        keys, B = kjt.keys(), kjt.stride()
        plan = self._plan(keys, self.weights.device)
        fused = self._fused_now()
        values, offsets, _, check = validate_collection(
            kjt.values(), kjt.offsets(), None, plan.limits, B, keys,
            plan.table_names,
            self.bounds_check, fresh=fused is not None or needs_op(self.weights))
        status = None if check is None else check.status
        # a bad batch's offsets and bags could index anywhere: guarded to 0 (its lookup gives zeros)
        safe = offsets if status is None else guard(offsets, status, 0)
        lengths = offsets[1:] - offsets[:-1]
        bag = bag_of_value(safe, values.numel())
        if status is not None:
            bag = guard(bag, status, 0)
        rows = plan.meta[:, ROW_START][bag // max(B, 1)] + values.long()
        table = self.weights.view(-1, self._embedding_dim)
        if fused is not None:
            out = fused_embedding(fused, rows, table, bounds_check="off", check=check)
        else:
            out = lookup_rows(table, rows, status)
        counts = kjt.length_per_key() if values is kjt.values() else lengths.reshape(len(keys), B).sum(1).tolist()
        ids = torch.split(values, counts) if self._need_indices else [None] * len(keys)
        jts = {k: JaggedTensor(v, ids[i], lengths=lengths[i * B:i * B + (B if strides is None else strides[i])])
               for i, (k, v) in enumerate(zip(keys, torch.split(out, counts)))}
        # in table order, then feature order, as TorchRec's (the batch's keys may come in any order)
        return jts if keys == self.embedding_names else {k: jts[k] for k in self.embedding_names}
