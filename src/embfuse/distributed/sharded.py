"""A sharded EmbeddingBagCollection: each rank holds its shards of the tables (planner.py) in a
local embfuse collection, and a batch crosses ranks twice.

Forward, on every rank, for its own batch of B samples:
1. Route: a feature of a table-wise table goes whole to its rank, one of a column-wise table
   whole to every piece's rank; only a row-wise feature's ids are sorted by their row block
   (stably, so its bags keep their order) and made local, which needs its ids' place in the
   batch (the batch's per-key counts: a host read only if it does not carry them). The batch
   is checked here too, into a status; every slot's lengths are counted on the device.
2. One all-to-all of a small header per rank pair (the status, B, the ids per feature), then the
   one host read of the forward: sizes for the next collectives, and every rank's status. If any
   rank's batch is bad, every rank raises that rank's error (the same text everywhere); nothing
   has been looked up or updated anywhere. The send buffer is then one copy of slices of the
   batch: each destination's lengths, ids and weights (as fp32 bits) in one int64 part.
3. It goes out in one asynchronous all-to-all; each rank then looks up what it received with
   its local collection (one launch, fused optimizer included): the sources' samples one after
   another, so the bag order is the concatenated batch's.
4. The pooled rows go back by one all-to-all (PooledAllToAll, whose backward is the reverse),
   waited on only when the output is assembled (`forward` = `input_dist`, `lookup_and_send`
   (`pooled` + `send`), `output_wait`: embfuse.fx's overlap pass moves the requests early and
   the waits late);
   the sample's rank moves column runs into place (assembly.py) or adds row-wise partial sums
   (in a fixed order: deterministic), then divides row-wise mean / sqrtn features by the whole
   bag's norm.
A world of one runs no collective: everything sent would come back to itself. A batch whose
features have their own batch sizes (TorchRec's VBE) is padded to one stride first and its
output samples take their pooled rows by its inverse indices at the end, as the unsharded
collection's (nn/vbe.py).

The backward carries gradients to the shards' owners; their local fused optimizers update in
place. Every rank must call backward (as with DistributedDataParallel)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from embfuse.distributed.assembly import SideBySide, move_table
from embfuse.distributed.comm import CommTimer, InputDist, OutputDist, PooledAllToAll, timed, all_to_all
from embfuse.distributed.pieces import PieceUpdate
from embfuse.distributed.planner import ShardingPlan, plan_shards
from embfuse.distributed.routing import BATCH, COUNTS, STATUS, Routing, unpack_weights
from embfuse.nn.collection import EmbeddingBagCollection, EmbeddingBagConfig, pooling_name, table_dtype
from embfuse.nn.vbe import Expand, PinnedRing, one_stride
from embfuse.ops import errors
from embfuse.ops.bags import (POOLINGS, SUM, accumulation, bag_of_value, divide_reference, index_sum,
                              pool_norm_reference, pooled_values, weight_term)
from embfuse.ops.safe import POOLING
from embfuse.ops.validate import validate_collection
from embfuse.sparse.jagged import KeyedJaggedTensor
from embfuse.sparse.keyed_tensor import KeyedTensor

_BAD_ARGUMENT = 4  # a status (collection_status's are 1 and 2)
_ERRORS = {c.__name__: c for c in (errors.BadIdError, errors.BadBatchError, errors.BadDtypeError,
                                   errors.BadArgumentError, ValueError, TypeError, KeyError, IndexError)}


def shard(ebc: EmbeddingBagCollection, plan=None, group=None, lookups: Optional[dict[str, int]] = None,
          memory_per_rank: Optional[int] = None, comm_dtype: Optional[torch.dtype] = None
          ) -> "ShardedEmbeddingBagCollection":
    """Shard `ebc` over the ranks of `group` (the default process group when None).

    `plan`: a ShardingPlan, or table name -> "table_wise" | "row_wise" | "column_wise" |
    ("table_wise", rank), tables left out chosen by planner.plan_shards's cost model (`lookups`,
    `memory_per_rank` feed it). `comm_dtype` (torch.float16 or torch.bfloat16): the pooled rows
    and their gradients cross ranks in it, rounded once each way (TorchRec's quantized comms):
    half the bytes of fp32 tables; None sends the tables' dtype, exact. Every rank must pass the
    same tables, options and plan; the tables start as rank 0's `ebc` (its weights and optimizer
    state)."""
    world = dist.get_world_size(group)
    if not isinstance(plan, ShardingPlan):
        plan = plan_shards(ebc.tables, world, plan, ebc.weights.dtype, ebc.optimizer, lookups, memory_per_rank)
    if plan.world_size != world:
        raise ValueError(f"the plan is for {plan.world_size} ranks; the group has {world}")
    return ShardedEmbeddingBagCollection(ebc, plan, group, comm_dtype)


def _describe(ebc: EmbeddingBagCollection, plan: ShardingPlan, comm_dtype) -> dict:
    return {
        "tables": [(t.name, t.num_embeddings, t.embedding_dim, str(table_dtype(t.data_type)), pooling_name(t.pooling),
                    t.combiner, t.default_id, list(t.feature_names)) for t in ebc.tables],
        "is_weighted": ebc.is_weighted(), "optimizer": repr(ebc.optimizer),
        "hot_rows": None if ebc._hot is None else (ebc._hot.k, ebc._hot.refresh, ebc._hot.min_values),
        "plan": plan.describe(), "comm_dtype": str(comm_dtype),
    }


def _pooling(t: EmbeddingBagConfig) -> str:
    """A table's pooling: its TensorFlow combiner's (ops/safe.py POOLING) when it has one."""
    return POOLING[t.combiner] if t.combiner is not None else pooling_name(t.pooling)


def _first_difference(a, b):
    """The first place two descriptions differ: (path, a's value, b's value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if a[k] != b.get(k):
                path, x, y = _first_difference(a[k], b.get(k))
                return (k + path, x, y)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                path, x, y = _first_difference(x, y)
                return (f"[{i}]{path}", x, y)
    return "", a, b


class ShardedEmbeddingBagCollection(torch.nn.Module):
    """An EmbeddingBagCollection whose tables are spread over ranks (see the module docstring):
    `forward(kjt)` takes this rank's batch and returns this rank's pooled KeyedTensor, as the
    unsharded collection would for these samples. `local` is this rank's collection of shards
    (None when the plan gives it none); `plan` says who holds what."""

    def __init__(self, ebc: EmbeddingBagCollection, plan: ShardingPlan, group=None,
                 comm_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if comm_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"comm_dtype must be None, torch.float16 or torch.bfloat16, got {comm_dtype}")
        self.group, self.plan, self.comm_dtype = group, plan, comm_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = ebc.weights.device
        if dist.get_backend(group) == "gloo" and self.device.type != "cpu":
            raise ValueError("gloo exchanges CPU tensors: shard a CPU collection on gloo, a CUDA one on nccl")
        mine = _describe(ebc, plan, comm_dtype)
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=group)
        for r, theirs in enumerate(every):
            if theirs != every[0]:
                path, a, b = _first_difference(every[0], theirs)
                raise ValueError(f"ranks were given different collections or plans: {path} is {a!r} on rank 0 and "
                                 f"{b!r} on rank {r}")
        rowwise_state = ebc.optimizer is not None and any(p == "row" for p, _ in ebc.optimizer.state_spec().values())
        # column-wise pieces of a table whose optimizer keeps one state a row: the state is fed the
        # whole row's squared gradient, summed across the pieces (see PieceUpdate)
        self._exact = {t.name for t in ebc.tables if rowwise_state and plan.types[t.name] == "column_wise"
                       and len(plan.shards[t.name]) > 1}
        # a feature looked up by several tables is one slot a table, named as the collection names
        # its outputs (f"{feature}@{table}"): the shards see those names as their features
        self._sources = [f for f, _ in ebc._slots]
        self._vbe_ring = PinnedRing()
        self.tables = [dataclasses.replace(t, feature_names=list(names)) for t, names in
                       zip(ebc.tables, ebc._names_by_table)]
        self.feature_names, self._dims = list(ebc.embedding_names), list(ebc._dims)
        self._is_weighted = ebc.is_weighted()
        # each feature's TensorFlow rule (its table's combiner=) or None: the routing applies them,
        # and the shards then pool batches with ids < 0 (routing.py)
        self._safe = [ebc._safe.get(f) for f in self.feature_names]
        self._has_rules = any(r is not None for r in self._safe)
        self._optimizer = ebc.optimizer
        self._table_index = {t.name: i for i, t in enumerate(self.tables)}
        self._build_local(ebc)
        self._build_routes()
        self.comm_timer: Optional[CommTimer] = None
        self._assembly = None
        self.load_full_state_dict(self._broadcast_state(ebc))

    # ---- what lives where ----
    def _local_configs(self, rank: int) -> list[EmbeddingBagConfig]:
        """This rank's shards as tables: those its fused collection updates first, then the
        column pieces PieceUpdate updates."""
        out = []
        shards = self.plan.local(rank)
        for s in sorted(shards, key=lambda s: s.table in self._exact):
            t = self.tables[self._table_index[s.table]]
            pooling = "sum" if self.plan.types[s.table] == "row_wise" else _pooling(t)
            out.append(EmbeddingBagConfig(num_embeddings=s.rows, embedding_dim=s.dim, name=s.table,
                                          data_type=table_dtype(t.data_type), feature_names=list(t.feature_names),
                                          pooling=pooling))
        return out

    def _build_local(self, ebc) -> None:
        configs = [c for c in self._local_configs(self.rank) if c.name not in self._exact]
        hot = ebc._hot  # hot_rows: each rank's collection takes its hot set from what it looks up
        options = dict(hot_rows=hot.k, hot_refresh=hot.refresh, hot_min_values=hot.min_values) if hot else {}
        self.local = EmbeddingBagCollection(configs, self._is_weighted, self.device, ebc.optimizer,
                                            bounds_check="off", **options) if configs else None
        pieces = [c for c in self._local_configs(self.rank) if c.name in self._exact]
        groups = {}  # every rank makes every group, in one order (new_group's rule)
        for name in sorted(self._exact, key=self._table_index.__getitem__):
            ranks = tuple(self._global(s.rank) for s in self.plan.shards[name])
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks))
        self.pieces = None
        if pieces:
            self.pieces = EmbeddingBagCollection(pieces, self._is_weighted, self.device, bounds_check="off")
            self.piece_update = PieceUpdate(self.pieces, ebc.optimizer, [
                (groups[tuple(self._global(s.rank) for s in self.plan.shards[c.name])],
                 self.tables[self._table_index[c.name]].embedding_dim) for c in pieces])
            self.register_buffer("pieces_sum", self.piece_update.state)
        for shards in (self.local, self.pieces):
            if shards is not None:
                shards._safe_passed = self._has_rules

    def _build_routes(self) -> None:
        """Host tables of the routing: each rank's features (`entries`), their slots (one per
        (rank, feature)), each rank's pooled width and where each feature sits in it; `routing`."""
        W = self.world
        self.entries = [[f for c in self._local_configs(r) for f in c.feature_names] for r in range(W)]
        self.widths = [sum(c.embedding_dim * len(c.feature_names) for c in self._local_configs(r)) for r in range(W)]
        self.slot_base = [0]
        for e in self.entries:
            self.slot_base.append(self.slot_base[-1] + len(e))
        column = {}  # (rank, feature) -> first column of its piece in that rank's pooled rows
        for r in range(W):
            col = 0
            for c in self._local_configs(r):
                for f in c.feature_names:
                    column[(r, f)] = col
                    col += c.embedding_dim
        self._column = column
        table_of = {f: self.tables[self._table_index[s]] for s in self.plan.shards for f in
                    self.tables[self._table_index[s]].feature_names}
        shards = [self.plan.shards[table_of[f].name] for f in self.feature_names]
        kinds = [self.plan.types[table_of[f].name] for f in self.feature_names]
        rows = [table_of[f].num_embeddings for f in self.feature_names]
        dev = self.device
        self.routing = Routing(self.feature_names, self._sources, shards, kinds, rows, self.entries, self.slot_base,
                               self._is_weighted, dev, accumulation(self._dtype()), self._safe)
        self._shards, self._kinds = shards, kinds
        # rowwise mean / sqrtn: the sample's rank divides the summed partials by the bag's norm
        self._divide = torch.tensor([POOLINGS[_pooling(table_of[f])] if k == "row_wise" else SUM
                                     for f, k in zip(self.feature_names, kinds)], dtype=torch.int64, device=dev)
        self._needs_norm = bool((self._divide != SUM).any())
        self._dims_t = torch.tensor(self._dims, device=dev)  # the norms' repeat counts
        self._table_names = [table_of[f].name for f in self.feature_names]

    def is_weighted(self) -> bool:
        return self._is_weighted

    # ---- forward ----
    def _raise_everywhere(self, statuses: list[int], routed, error: Optional[BaseException]) -> None:
        """Every rank raises the error of the first rank whose batch is bad, with its text."""
        mine = None
        if error is not None:
            mine = (type(error).__name__, str(error.args[0]) if error.args else str(error))
        elif statuses[self.rank]:
            kjt, offsets = routed.given, routed.offsets
            try:
                validate_collection(kjt.values(), offsets, None, self.routing.limits, kjt.stride(), self.feature_names,
                                    self._table_names, "sync")
                mine = ("BadBatchError", "the batch was refused by its rank's check")
            except (errors.BadIdError, errors.BadBatchError) as e:
                mine = (type(e).__name__, str(e))
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        first = next(r for r, m in enumerate(every) if m is not None)
        cls, text = every[first]
        raise _ERRORS.get(cls, RuntimeError)(f"rank {first}'s batch: {text}")

    def input_dist(self, features: KeyedJaggedTensor) -> "InputDist":
        """The request half of the input exchange: route, exchange the headers (the one host
        read; a bad batch anywhere raises here, on every rank), start the one all-to-all of
        lengths, ids and weights, and return without waiting for it."""
        W, H = self.world, self.routing.header_width
        error, routed, rows, strides = None, None, None, None
        try:
            if features.variable_stride_per_key():
                features, rows, strides = one_stride(features, list(zip(self._sources, self.feature_names)),
                                                     self.feature_names, self._vbe_ring)
            header, routed = self.routing.route(features, strides)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # this rank's argument: every rank raises it
            error = e
            header = torch.zeros(W * H, dtype=torch.int64, device=self.device)
            header[STATUS::H] = _BAD_ARGUMENT
        timer = self.comm_timer
        with timed(timer, "input", self.device):
            got, _ = all_to_all(header, [H] * W, [H] * W, self.group)
            sent_host, got_host = torch.stack([header, got]).view(2, W, H).tolist()
        statuses = [got_host[r][STATUS] for r in range(W)]
        if any(statuses):
            self._raise_everywhere(statuses, routed, error)
        kjt, B = routed.kjt, routed.B
        E = len(self.entries[self.rank])
        batches = [got_host[r][BATCH] for r in range(W)]
        sent = [c for d in range(W) for c in sent_host[d][COUNTS:COUNTS + len(self.entries[d])]]
        recv_counts = [got_host[s][COUNTS:COUNTS + E] for s in range(W)]
        buf, send_sizes = self.routing.send_buffer(routed, sent)
        per_id = 2 if self._is_weighted else 1
        with timed(timer, "input", self.device):
            recv, work = all_to_all(buf, send_sizes, [E * b + per_id * sum(c) for b, c in zip(batches, recv_counts)],
                                    self.group, async_op=True)
        return InputDist(self, kjt, B, batches, recv_counts, recv, work, rows)

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start `features`' input exchange now (TrainPipeline calls this for the next batch
        while this one computes); the forward given this same object uses it. An error of that
        batch is raised by that forward."""
        try:
            self._prefetched = (features, self.input_dist(features), None)
        except (errors.BadIdError, errors.BadBatchError, ValueError, TypeError, KeyError, IndexError) as e:
            self._prefetched = (features, None, e)

    @torch.compiler.disable  # under torch.compile: the exchange runs eagerly between compiled regions
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ahead = getattr(self, "_prefetched", None)
        if ahead is not None and ahead[0] is features:
            self._prefetched = None
            if ahead[2] is not None:
                raise ahead[2]
            incoming = ahead[1]
        else:
            incoming = self.input_dist(features)
        return self.output_wait(self.lookup_and_send(incoming))

    def lookup(self, incoming: "InputDist") -> Tensor:
        """Wait for the input exchange and pool what arrived with this rank's shards: every
        source's samples in rank order, this rank's pooled width (its fused optimizer steps in
        the backward). `embfuse bench --distributed` times it alone: the step without the
        exchanges."""
        return self._lookup(incoming.wait(), incoming.batches, incoming.counts)

    def lookup_and_send(self, incoming: "InputDist") -> "OutputDist":
        """Wait for the input exchange, look up this rank's shards, and start sending the pooled
        rows back (the request half of the output exchange)."""
        return self.send(self.pooled(incoming), incoming)

    def pooled(self, incoming: "InputDist") -> Tensor:
        """`lookup`, ready to send: a leaf that needs grad where autograd records (every rank
        joins the backward's all-to-all), the assembly's moves made (host work, done here)."""
        pooled = self.lookup(incoming)
        if torch.is_grad_enabled() and not pooled.requires_grad:
            pooled = pooled.detach().requires_grad_()
        self._columns()
        return pooled

    def send(self, pooled: Tensor, incoming: "InputDist") -> "OutputDist":
        """Start sending the pooled rows to the ranks whose samples they are. Under torch.compile
        (embfuse.fx's overlap pass puts this inside a compiled region) the all-to-all is a
        functional collective, whose wait Inductor places at the first use; eagerly it is
        torch.distributed's asynchronous one (PooledAllToAll), waited in output_wait."""
        handle = OutputDist(incoming.kjt, incoming.B, incoming.rows)
        if self.world == 1:  # nothing to send: the pooled rows are this rank's output
            handle.recv = pooled.reshape(-1)
            return handle
        if self.comm_dtype is not None:
            pooled = pooled.to(self.comm_dtype)  # (its backward casts the gradient that comes back)
        send_splits = [b * self.widths[self.rank] for b in incoming.batches]
        recv_splits = [incoming.B * self.widths[o] for o in range(self.world)]
        if torch.compiler.is_compiling():
            handle.recv = funcol.all_to_all_single_autograd(pooled.contiguous().view(-1), recv_splits, send_splits,
                                                            self.group if self.group is not None else dist.group.WORLD)
        else:
            handle.recv = PooledAllToAll.apply(pooled, send_splits, recv_splits, self.group, self.comm_timer, handle)
        return handle

    def output_wait(self, sent: "OutputDist") -> KeyedTensor:
        """Wait for the pooled rows of this rank's samples and assemble its KeyedTensor."""
        if sent.work is not None:
            with timed(self.comm_timer, "output", self.device):
                sent.work.wait()
        out = self._assemble(sent.recv, sent.kjt, sent.B)
        return KeyedTensor(self.feature_names, self._dims, out if sent.rows is None else
                           Expand.apply(out, sent.rows, self._dims))

    def _lookup(self, recv: Tensor, batches: list[int], counts: list[list[int]]):
        """The local collection's pooled rows for every source's samples, sources in rank order.
        `recv`: each source's part of the exchange (Routing.send_buffer) one after another."""
        total = sum(batches)
        if self.local is None and self.pieces is None:
            return torch.zeros(total, 0, dtype=self._dtype(), device=self.device)
        E, W, weighted, acc = len(self.entries[self.rank]), self.world, self._is_weighted, accumulation(self._dtype())
        per_key = [sum(counts[s][e] for s in range(W)) for e in range(E)]
        if W == 1:  # one source: its lengths, ids and weights are each one slice already
            n, at = sum(counts[0]), E * total
            return self._pool(KeyedJaggedTensor(self.entries[self.rank], recv[at:at + n],
                                                unpack_weights(recv[at + n:at + 2 * n], acc) if weighted else None,
                                                lengths=recv[:at], stride=total, length_per_key=per_key))
        # source s's part: a piece of lengths a feature, then of ids (then of weights' bits); split
        # in one call, joined feature-major (every source's samples of a feature together) by one copy
        kinds = 3 if weighted else 2
        pieces = torch.split(recv, [x for s in range(W) for x in [batches[s]] * E + counts[s] * (kinds - 1)])
        flat = torch.cat([pieces[s * kinds * E + k * E + e] for k in range(kinds) for e in range(E) for s in range(W)])
        L, n = E * total, sum(per_key)
        kjt = KeyedJaggedTensor(self.entries[self.rank], flat[L:L + n],
                                unpack_weights(flat[L + n:], acc) if weighted else None, lengths=flat[:L], stride=total,
                                length_per_key=per_key)
        return self._pool(kjt)

    def _pool(self, kjt: KeyedJaggedTensor) -> Tensor:
        """The fused collection's features, then the pieces' (their order in `entries`)."""
        if self.pieces is None:
            return self.local(kjt).values()
        n = len(self.pieces.feature_names)
        fused, pieces = kjt.split([len(kjt.keys()) - n, n])
        if torch.is_grad_enabled():
            self.piece_update.saw(pieces)
        out = self.pieces(pieces).values()
        self.piece_update.watch(out)
        return out if self.local is None else torch.cat([self.local(fused).values(), out], 1)

    def _dtype(self):
        return table_dtype(self.tables[0].data_type)

    def _columns(self):
        """(P, sum of widths): for each output column, the column of the owners' pooled rows side
        by side (owner 0's, owner 1's, ...) it comes from, or the zero column after them; P = 1
        without row-wise tables, else the most row shards (one layer a partial sum). Then whether
        that is the identity, and (P = 1) SideBySide's moves (host and device), else None."""
        if self._assembly is None:
            start = [0]
            for w in self.widths:
                start.append(start[-1] + w)
            parts = max([len(s) for s, k in zip(self._shards, self._kinds) if k == "row_wise"], default=1)
            index = torch.full((parts, sum(self._dims)), start[-1], dtype=torch.int64)
            col = 0
            for f, shards, kind, dim in zip(self.feature_names, self._shards, self._kinds, self._dims):
                for j, s in enumerate(shards):
                    layer, lo = (j, 0) if kind == "row_wise" else (0, s.col_start)
                    first = start[s.rank] + self._column[(s.rank, f)]
                    index[layer, col + lo:col + lo + s.dim] = torch.arange(first, first + s.dim)
                col += dim
            identity = parts == 1 and torch.equal(index[0], torch.arange(index.shape[1]))
            moves = None
            if parts == 1:  # runs of output columns from consecutive columns of one rank
                owner = torch.bucketize(index[0], torch.tensor(start[1:]), right=True).tolist()
                moves = []
                for c, (r, at) in enumerate(zip(owner, index[0].tolist())):
                    if moves and moves[-1][0] == r and moves[-1][1] + moves[-1][2] == at - start[r]:
                        moves[-1][2] += 1
                    else:
                        moves.append([r, at - start[r], 1, c])
                moves = ([tuple(m) for m in moves], move_table(moves, self.widths, self.device))
            self._assembly = index.to(self.device), identity, moves
        return self._assembly

    def _assemble(self, recv: Tensor, kjt: KeyedJaggedTensor, B: int) -> Tensor:
        """This rank's (B, sum of widths) output from what the owners sent: column selections of
        their pooled rows side by side (no scatter: each output column has one source a layer;
        row-wise layers are added in shard order), divided by row-wise bags' norms; in the
        tables' dtype (`recv` may have come in comm_dtype)."""
        index, identity, moves = self._columns()
        dtype = self._dtype()
        if self.world == 1:
            side = recv.view(B, self.widths[0])
        elif moves is not None and not self._needs_norm:
            return SideBySide.apply(recv, B, self.widths, *moves, dtype)
        else:  # split, not slices: a slice's backward zero-fills the whole buffer
            blocks = torch.split(recv, [B * w for w in self.widths])
            side = torch.cat([b.view(B, w) for b, w in zip(blocks, self.widths)], dim=1)
        if identity and not self._needs_norm:
            return side.to(dtype)
        side = torch.cat([side, side.new_zeros(B, 1)], dim=1)
        if index.shape[0] == 1 and not self._needs_norm:
            return side.index_select(1, index[0]).to(dtype)
        acc = accumulation(dtype)
        out = side.index_select(1, index[0]).to(acc)
        for layer in index[1:]:
            out = out + side.index_select(1, layer).to(acc)
        if self._needs_norm:
            out = divide_reference(out, self._norms(kjt, B))  # (0 where wmean's weights sum to 0)
        return out.to(dtype)

    def _norms(self, kjt: KeyedJaggedTensor, B: int) -> Tensor:
        """(B, sum of widths): what each row-wise mean / sqrtn feature's summed partials are
        divided by (the whole bag's count, its weights' root sum of squares or sum); 1 elsewhere."""
        F, acc = len(self.feature_names), accumulation(self._dtype())
        lengths = kjt.lengths().long()
        psw = kjt.weights_or_none() if self._is_weighted else None
        pool = self._divide.repeat_interleave(B)
        if psw is None and self._has_rules:  # (the entries TensorFlow's rules dropped, ids < 0, are not counted)
            keep, bag = pooled_values(kjt.values(), kjt.offsets().long())
            lengths = index_sum(F * B, bag, keep.long())
        if psw is None:
            wsum = lengths.to(acc)
        else:
            bag = bag_of_value(kjt.offsets().long(), psw.numel())
            terms = weight_term(pool[bag], psw.to(acc))
            wsum = index_sum(F * B, bag, terms)
        norm = pool_norm_reference(pool, lengths, wsum).view(F, B).T
        return norm.repeat_interleave(self._dims_t, dim=1, output_size=sum(self._dims))

    # ---- checkpoints ----
    def _broadcast_state(self, ebc: EmbeddingBagCollection) -> dict[str, Tensor]:
        """Rank 0's state_dict of the unsharded collection, on every rank."""
        # (to this rank's device: NCCL moves CUDA tensors only, and the step count lives on the host)
        state = {k: v.detach().to(self.device, copy=True).contiguous() for k, v in ebc.state_dict().items()}
        for k in state:
            dist.broadcast(state[k], src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return state

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _local_pieces(self, table: str) -> dict[str, Tensor]:
        """This rank's piece of `table`: its weight and each optimizer state, shaped as the shard."""
        if table in self._exact:
            i = [c.name for c in self.pieces.tables].index(table)
            starts = self.pieces._row_starts
            return {"weight": self.pieces.table_weights()[i], "sum": self.pieces_sum[starts[i]:starts[i + 1]]}
        i = [c.name for c in self.local.tables].index(table)
        rows, dim = self.local._shapes[i]
        out = {"weight": self.local.table_weights()[i]}
        for name, (per, _) in self._state_spec().items():
            flat = getattr(self.local, f"optimizer_{name}")
            if per == "row":
                out[name] = flat[self.local._row_starts[i]:self.local._row_starts[i + 1]]
            else:
                out[name] = flat[self.local._starts[i]:self.local._starts[i + 1]].view(rows, dim)
        return out

    def _piece_steps(self) -> int:
        return self.piece_update.steps if self.pieces is not None else 0

    def _state_spec(self) -> dict:
        return self._optimizer.state_spec() if self._optimizer is not None else {}

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every table whole under the unsharded collection's keys (and its flat optimizer state
        and step), on every rank: each shard is broadcast from its owner. Loads bitwise into an
        unsharded collection, or into `load_full_state_dict` of any plan and world size."""
        spec = self._state_spec()
        out, states = {}, {name: [] for name in spec}
        for t in self.tables:
            dtype = table_dtype(t.data_type)
            full = torch.empty(t.num_embeddings, t.embedding_dim, dtype=dtype, device=self.device)
            full_state = {name: torch.empty((t.num_embeddings,) if per == "row" else
                                            (t.num_embeddings, t.embedding_dim), dtype=torch.float32,
                                            device=self.device) for name, (per, _) in spec.items()}
            for s in self.plan.shards[t.name]:
                pieces = self._local_pieces(t.name) if s.rank == self.rank else None
                for name, target in [("weight", full)] + list(full_state.items()):
                    per_row = name != "weight" and spec[name][0] == "row"
                    shape = (s.rows,) if per_row else (s.rows, s.dim)
                    buf = pieces[name].contiguous() if pieces is not None else torch.empty(
                        shape, dtype=target.dtype, device=self.device)
                    dist.broadcast(buf, src=self._global(s.rank), group=self.group)
                    if per_row:
                        target[s.row_start:s.row_end] = buf
                    else:
                        target[s.row_start:s.row_end, s.col_start:s.col_end] = buf
            out[f"embedding_bags.{t.name}.weight"] = full
            for name in spec:
                states[name].append(full_state[name].reshape(-1))
        for name in spec:
            out[f"optimizer_{name}"] = torch.cat(states[name])
        if self._optimizer is not None:
            step = torch.tensor([self.local._fused.step if self.local is not None else self._piece_steps()],
                                device=self.device)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
            out["optimizer_step"] = step[0].cpu()
        return out

    def load_full_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take this rank's shards from an unsharded collection's state_dict (full_state_dict's
        form, from any plan or world size). No collective: every rank reads its own pieces."""
        spec = self._state_spec()
        sizes = {name: [] for name in spec}
        local = {}
        for t in self.tables:
            key = f"embedding_bags.{t.name}.weight"
            if key not in state:
                raise KeyError(f"the state has no {key!r}")
            if tuple(state[key].shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} in the state, "
                                 f"({t.num_embeddings}, {t.embedding_dim}) in the collection")
            for name, (per, _) in spec.items():
                sizes[name].append(t.num_embeddings * (1 if per == "row" else t.embedding_dim))
        flat = {}
        for name in spec:
            key = f"optimizer_{name}"
            if key not in state:
                raise KeyError(f"the state has no {key!r} (the collection's optimizer keeps it)")
            flat[name] = dict(zip([t.name for t in self.tables], torch.split(state[key].reshape(-1), sizes[name])))
        state_parts = {name: [] for name in spec}
        pieces, piece_sums = {}, []
        for s in self.plan.local(self.rank):
            t = self.tables[self._table_index[s.table]]
            full = state[f"embedding_bags.{t.name}.weight"]
            if s.table in self._exact:
                pieces[f"embedding_bags.{s.table}.weight"] = full[s.row_start:s.row_end, s.col_start:s.col_end]
                piece_sums.append((s.table, flat["sum"][t.name]))
                continue
            local[f"embedding_bags.{s.table}.weight"] = full[s.row_start:s.row_end, s.col_start:s.col_end]
            for name, (per, _) in spec.items():
                if per == "row":
                    state_parts[name].append(flat[name][t.name][s.row_start:s.row_end])
                else:
                    piece = flat[name][t.name].view(t.num_embeddings, t.embedding_dim)
                    state_parts[name].append(piece[s.row_start:s.row_end, s.col_start:s.col_end].reshape(-1))
        step = state.get("optimizer_step", torch.tensor(0))
        if self.pieces is not None:
            self.pieces.load_state_dict({k: v.to(self.device) for k, v in pieces.items()})
            order = [c.name for c in self.pieces.tables]
            piece_sums.sort(key=lambda p: order.index(p[0]))
            self.pieces_sum.copy_(torch.cat([v for _, v in piece_sums]))
            self.piece_update.steps = int(step)
        if self.local is None:
            return
        for name in spec:
            local[f"optimizer_{name}"] = torch.cat(state_parts[name])
        if self._optimizer is not None:
            local["optimizer_step"] = step
        self.local.load_state_dict({k: v.to(self.device) for k, v in local.items()})
