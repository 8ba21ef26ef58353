"""Benchmark workloads, named and versioned in one place, and their index generators.

Change WORKLOADS_VERSION whenever a workload or a generator changes, so that result files
from different definitions are never compared by mistake.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

WORKLOADS_VERSION = 3

# a multiplier coprime with every table size used here: scatters power-law ranks over the table
_HASH = 2_654_435_761


@dataclass(frozen=True)
class Workload:
    """One lookup problem. kind: "bag" (pooled), "embedding" (plain gather) or "train" (forward,
    backward and optimizer update of `tables` tables, sum pooling) or "backward" (forward and
    backward to a dense weight gradient); "collection" / "collection-train" /
    "collection-train-rowwise": a table collection fed one keyed batch (bench/collection.py).

    dist: "uniform", "powerlaw" (continuous, exponent alpha, ranks hashed over the table),
    "ranked" (the same ranks as ids: rows numbered by frequency, the hottest first) or
    "hotset" (a fraction `alpha` of accesses to 1/1000 of the rows). layout: "fixed" (2-D ids,
    L per bag) or "csr" (lengths uniform in [0, 2L]). tables > 1: that many tables looked up
    with the same batch shape (the DLRM case)."""

    name: str
    kind: str
    rows: int
    dim: int
    batch: int
    hotness: int = 1
    dist: str = "uniform"
    alpha: float = 0.0
    layout: str = "fixed"
    dtype: str = "float32"
    mode: str = "sum"
    tables: int = 1
    group: str = "grid"

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def generate_ids(w: Workload, n: int, device, generator: torch.Generator) -> torch.Tensor:
    """n int64 ids in [0, w.rows) drawn from the workload's distribution."""
    if w.dist == "uniform":
        return torch.randint(0, w.rows, (n,), device=device, generator=generator)
    u = torch.rand(n, device=device, generator=generator, dtype=torch.float64)
    if w.dist in ("powerlaw", "ranked"):
        # inverse CDF of p(x) ~ x^-alpha on [1, rows + 1)
        a = 1.0 - w.alpha
        rank = (1.0 + u * ((w.rows + 1.0) ** a - 1.0)) ** (1.0 / a) - 1.0
        rank = rank.long().clamp_(0, w.rows - 1)
    elif w.dist == "hotset":
        hot = max(1, w.rows // 1000)
        cold = torch.randint(0, w.rows, (n,), device=device, generator=generator)
        rank = torch.where(u < w.alpha, (u / w.alpha * hot).long().clamp_(max=hot - 1), cold)
    else:
        raise ValueError(f"unknown distribution {w.dist!r}")
    return rank if w.dist == "ranked" else (rank * _HASH) % w.rows


def generate_batch(w: Workload, device, seed: int = 0):
    """(ids, offsets or None): 2-D ids for fixed hotness, 1-D ids + B+1 offsets for CSR."""
    g = torch.Generator(device=device).manual_seed(seed)
    if w.kind == "embedding":
        return generate_ids(w, w.batch, device, g), None
    if w.layout == "fixed":
        return generate_ids(w, w.batch * w.hotness, device, g).view(w.batch, w.hotness), None
    lengths = torch.randint(0, 2 * w.hotness + 1, (w.batch,), device=device, generator=g)
    offsets = torch.zeros(w.batch + 1, dtype=torch.int64, device=device)
    offsets[1:] = lengths.cumsum(0)
    return generate_ids(w, int(offsets[-1]), device, g), offsets


def _grid(quick: bool) -> list[Workload]:
    out = []
    dims = (32, 128) if quick else (32, 64, 128, 256)
    batches = (2048, 65536) if quick else (2048, 16384, 65536)
    dists = (("uniform", 0.0), ("powerlaw", 1.05)) if quick else (("uniform", 0.0), ("powerlaw", 1.05),
                                                                   ("powerlaw", 1.15))
    for dim in dims:
        for batch in batches:
            for dist, alpha in dists:
                out.append(Workload(f"bag D{dim} B{batch} {dist}{alpha or ''}", "bag", 10_000_000, dim, batch, 64,
                                    dist, alpha))
    # the other layout and dtypes, on the largest batch of the grid
    for dim in (32, 128):
        for dist, alpha in (("uniform", 0.0), ("powerlaw", 1.05)):
            out.append(Workload(f"bag csr D{dim} B65536 {dist}{alpha or ''}", "bag", 10_000_000, dim, 65536, 64,
                                dist, alpha, layout="csr", group="csr"))
            for dtype in ("float16", "bfloat16"):
                out.append(Workload(f"bag {dtype} D{dim} B65536 {dist}{alpha or ''}", "bag", 10_000_000, dim, 65536,
                                    64, dist, alpha, dtype=dtype, group="half"))
    if not quick:
        for mode in ("mean", "max"):
            out.append(Workload(f"bag {mode} D128 B16384 uniform", "bag", 10_000_000, 128, 16384, 64, mode=mode,
                                group="modes"))
        out.append(Workload("bag hotset0.9 D128 B16384", "bag", 10_000_000, 128, 16384, 64, "hotset", 0.9,
                            group="modes"))
    return out


def workloads(quick: bool = False) -> list[Workload]:
    """The suite: the cuEmbed grid, torch's embedding cases, DLRM inference, small-batch latency."""
    out = _grid(quick)
    for n in ((8192, 307200) if quick else (8192, 131072, 307200)):
        for dim in (32, 128):
            out.append(Workload(f"embedding {n} x D{dim}", "embedding", 1_000_000, dim, n, group="embedding"))
    out.append(Workload("dlrm 12 x 500K x 128, B2048 L150", "bag", 500_000, 128, 2048, 150, tables=12, group="dlrm"))
    if not quick:
        out.append(Workload("train 26 x 1M x 128, B16384 L20 powerlaw1.05", "train", 1_000_000, 128, 16384, 20,
                            "powerlaw", 1.05, tables=26, group="train"))
        out.append(Workload("train 8 x 10M x 64, B65536 L32 uniform", "train", 10_000_000, 64, 65536, 32,
                            tables=8, group="train"))
        for dist, alpha in (("uniform", 0.0), ("powerlaw", 1.05)):
            out.append(Workload(f"backward 1M x 128, B16384 L64 {dist}{alpha or ''}", "backward", 1_000_000, 128,
                                16384, 64, dist, alpha, group="backward"))
    # 26 tables with Criteo's row counts (capped at 10M), bag lengths 1..99, one keyed batch
    for batch in (16384,) if quick else (16384, 65536):
        for kind in ("collection", "collection-train") + (() if quick else ("collection-train-rowwise",)):
            out.append(Workload(f"{kind} 26 criteo x 128, B{batch} L1-99 powerlaw1.05", kind, 10_000_000, 128, batch,
                                50, "powerlaw", 1.05, tables=26, group="collection"))
    out.append(Workload("latency D64 B512 L8", "bag", 100_000, 64, 512, 8, group="latency"))
    return out
