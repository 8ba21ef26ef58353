"""Sharding plans: which rank holds which rows and columns of each table.

Three ways to place a table over W ranks (TorchRec's names):
- `table_wise`: the whole table on one rank; every lookup of it runs there.
- `row_wise`: rows split in W contiguous blocks of ceil(rows / W); an id goes to the rank of its
  block, which pools its part of the bag; the partial sums are added back on the sample's rank
  (mean and sqrtn divide there, by the whole bag's count or weights).
- `column_wise`: columns split in min(W, dim) near-equal pieces; every id goes to every piece,
  the pooled pieces are concatenated back.
Table-row-wise (row blocks within one host's ranks) is row-wise over a sub-group: it would take
a group per host and a two-level exchange; it is not built.

`plan=None` picks with this cost model (documented in the README):
- a table costs its bytes (weights plus fp32 optimizer state) and its lookups a batch (its
  features' ids, when a sample batch is given; else one a feature);
- a table larger than one rank's fair share of all bytes (total / W) is row-wise: that spreads
  both its bytes and its lookups evenly;
- every other table is table-wise, placed largest first on the rank with the least lookup work
  (lookups times width: what a step's time follows) among those it still fits on (bytes are a
  limit, not a cost, while they fit), ties to the rank with fewer bytes;
- column-wise is never picked: a user asks for it (it splits bytes, not lookups: every rank sees
  every id of the table);
- a plan that leaves a rank over its memory (`memory_per_rank`, default: the GPU's) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_end) and columns [col_start, col_end) of `table`, held by `rank`."""

    table: str
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def dim(self) -> int:
        return self.col_end - self.col_start


@dataclass
class ShardingPlan:
    """Per table (in the collection's order): its sharding type and shards (row or column order)."""

    world_size: int
    types: dict[str, str]
    shards: dict[str, list[Shard]]

    def local(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, in table order."""
        return [s for t in self.shards for s in self.shards[t] if s.rank == rank]

    def describe(self) -> list[tuple]:
        """A comparable form (for checking that every rank holds the same plan)."""
        return [(t, self.types[t], [(s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in self.shards[t]])
                for t in self.shards]

    def __str__(self) -> str:
        rows = [("table", "type", "rank: rows x columns")]
        for t, shards in self.shards.items():
            where = ", ".join(f"{s.rank}: [{s.row_start}:{s.row_end}) x [{s.col_start}:{s.col_end})" for s in shards)
            rows.append((t, self.types[t], where))
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"ShardingPlan over {self.world_size} rank(s)"]
        lines += [f"  {a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows]
        return "\n".join(lines)


def _element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def table_bytes(table, dtype, optimizer=None) -> int:
    """The bytes of one table: its weights and its fp32 optimizer state."""
    rows, dim = table.num_embeddings, table.embedding_dim
    total = rows * dim * _element_size(dtype)
    if optimizer is not None:
        for per, _ in optimizer.state_spec().values():
            total += 4 * (rows if per == "row" else rows * dim)
    return total


def _shards(table, kind: str, world: int, rank: int = 0) -> list[Shard]:
    rows, dim = table.num_embeddings, table.embedding_dim
    if kind == "table_wise":
        return [Shard(table.name, rank, 0, rows, 0, dim)]
    if kind == "row_wise":
        block = -(-rows // world)
        return [Shard(table.name, r, r * block, min(rows, (r + 1) * block), 0, dim)
                for r in range(world) if r * block < rows]
    pieces = min(world, dim)
    bounds = [dim * i // pieces for i in range(pieces + 1)]
    return [Shard(table.name, r, 0, rows, bounds[r], bounds[r + 1]) for r in range(pieces)]


def _parse(table: str, spec) -> tuple[str, Optional[int]]:
    """'table_wise' / 'row_wise' / 'column_wise', or ('table_wise', rank) to place it."""
    kind, rank = (spec, None) if isinstance(spec, str) else tuple(spec)
    if kind not in SHARDING_TYPES:
        raise ValueError(f"table {table!r}: sharding type must be one of {SHARDING_TYPES}, got {spec!r}")
    if rank is not None and kind != "table_wise":
        raise ValueError(f"table {table!r}: only a table_wise table takes a rank, got {spec!r}")
    return kind, rank


def plan_shards(tables, world_size: int, plan: Optional[dict] = None, dtype=torch.float32, optimizer=None,
                lookups: Optional[dict[str, int]] = None, memory_per_rank: Optional[int] = None) -> ShardingPlan:
    """A ShardingPlan for `tables` (EmbeddingBagConfigs) over `world_size` ranks.

    `plan`: table name -> "table_wise" | "row_wise" | "column_wise" | ("table_wise", rank); tables
    it leaves out (or all, when None) are chosen by the cost model above. `lookups`: ids a batch
    per table, for that model. Table-wise tables without a rank are placed by load."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    plan = dict(plan or {})
    names = [t.name for t in tables]
    unknown = [t for t in plan if t not in names]
    if unknown:
        raise ValueError(f"the plan names table {unknown[0]!r}, which the collection does not have (its tables: "
                         f"{names})")
    size = {t.name: table_bytes(t, dtype, optimizer) for t in tables}
    work = {t.name: (lookups or {}).get(t.name, len(t.feature_names)) * t.embedding_dim for t in tables}
    share = sum(size.values()) / world_size
    kinds = {t.name: _parse(t.name, plan[t.name]) for t in tables if t.name in plan}
    for t in sorted(tables, key=lambda t: -size[t.name]):
        if t.name not in kinds:
            kinds[t.name] = ("row_wise" if world_size > 1 and size[t.name] > share else "table_wise", None)
    load_bytes, load_work = [0.0] * world_size, [0.0] * world_size
    placed = {}

    def add(shards, t):
        for s in shards:
            frac = s.rows * s.dim / (t.num_embeddings * t.embedding_dim)
            load_bytes[s.rank] += size[t.name] * frac
            load_work[s.rank] += work[t.name] * (s.dim / t.embedding_dim)
        placed[t.name] = shards

    for t in tables:  # first what is fixed: spread types and table-wise tables with a rank
        kind, rank = kinds[t.name]
        if kind != "table_wise":
            add(_shards(t, kind, world_size), t)
        elif rank is not None:
            if not 0 <= rank < world_size:
                raise ValueError(f"table {t.name!r}: rank {rank} is outside the world of {world_size}")
            add(_shards(t, kind, world_size, rank), t)
    if memory_per_rank is None and torch.cuda.is_available():
        memory_per_rank = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    room = memory_per_rank if memory_per_rank is not None else float("inf")
    for t in sorted(tables, key=lambda t: (-size[t.name], t.name)):
        if t.name not in placed:
            fits = [r for r in range(world_size) if load_bytes[r] + size[t.name] <= room] or range(world_size)
            rank = min(fits, key=lambda r: (load_work[r], load_bytes[r], r))
            add(_shards(t, "table_wise", world_size, rank), t)
    if memory_per_rank is not None:
        worst = max(range(world_size), key=lambda r: load_bytes[r])
        if load_bytes[worst] > memory_per_rank:
            raise ValueError(f"the plan puts {load_bytes[worst] / 2**30:.2f} GiB of tables on rank {worst}, over its "
                             f"{memory_per_rank / 2**30:.2f} GiB; shard the largest tables row_wise")
    return ShardingPlan(world_size, {t.name: kinds[t.name][0] for t in tables},
                        {t.name: placed[t.name] for t in tables})
