"""Data for `embfuse demo`: MovieLens-100K from the recbole wheel, or a Criteo-shaped synthetic set.

A `Dataset` holds per-sample tensors: `dense` (N, n_dense) floats, `label` (N,) 0/1, and for
each sparse feature either one id per sample or, for multi-hot features, an (N, max_len) id
matrix with -1 padding. `batch()` turns sample indices into (dense, KeyedJaggedTensor, label).
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from embfuse.sparse.jagged import KeyedJaggedTensor

MISSING = ("MovieLens-100K ships inside the recbole wheel, which is not installed. Install it without its "
           "dependencies:  pip install --no-deps recbole==1.2.1  (scripts/setup.sh does this), or run "
           "`embfuse demo --data synthetic`.")


@dataclass
class Dataset:
    name: str
    dense: torch.Tensor
    label: torch.Tensor
    sparse: dict[str, torch.Tensor]  # feature -> (N,) ids or (N, max_len) ids padded with -1
    rows: dict[str, int]  # feature -> table size

    def __len__(self) -> int:
        return self.label.numel()

    def batch(self, idx: torch.Tensor):
        keys, values, lengths = [], [], []
        for key, ids in self.sparse.items():
            x = ids[idx]
            if x.dim() == 1:
                values.append(x)
                lengths.append(torch.ones_like(x))
            else:
                keep = x >= 0
                values.append(x[keep])
                lengths.append(keep.sum(1))
            keys.append(key)
        kjt = KeyedJaggedTensor(keys, torch.cat(values), lengths=torch.cat(lengths), stride=idx.numel(),
                                length_per_key=[v.numel() for v in values])
        return self.dense[idx], kjt, self.label[idx]

    def split(self, test_fraction: float, seed: int):
        """(train indices, test indices), a seeded random split."""
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        n_test = int(len(self) * test_fraction)
        return perm[n_test:], perm[:n_test]


def movielens_dir() -> Path:
    """The ml-100k folder of the installed recbole wheel (found without importing recbole)."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(MISSING)
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k"
    if not (path / "ml-100k.inter").exists():
        raise FileNotFoundError(MISSING)
    return path


def _read(path: Path) -> list[dict[str, str]]:
    """RecBole's atomic files: tab-separated, header fields named "name:type"."""
    with open(path, newline="", encoding="latin-1") as f:
        rows = csv.reader(f, delimiter="\t")
        header = [h.split(":")[0] for h in next(rows)]
        return [dict(zip(header, r)) for r in rows]


def _vocab(values) -> dict[str, int]:
    return {v: i for i, v in enumerate(sorted(set(values)))}


AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups


def load_movielens(path: Path | None = None) -> Dataset:
    """User id, item id, age bucket, gender, occupation, zip prefix and the item's genres (a
    multi-hot bag) as sparse features; age, release year and rating time as dense features;
    label: rating >= 4."""
    path = movielens_dir() if path is None else Path(path)
    inter, users, items = (_read(path / f"ml-100k.{x}") for x in ("inter", "user", "item"))
    user = {u["user_id"]: u for u in users}
    item = {i["item_id"]: i for i in items}
    inter = [r for r in inter if r["user_id"] in user and r["item_id"] in item]
    uid, iid = _vocab(u["user_id"] for u in users), _vocab(i["item_id"] for i in items)
    occ, gender = _vocab(u["occupation"] for u in users), _vocab(u["gender"] for u in users)
    zips = _vocab(u["zip_code"][:2] for u in users)
    genres = _vocab(g for i in items for g in i["class"].split())
    max_genres = max(len(i["class"].split()) for i in items)
    item_genres = {k: [genres[g] for g in v["class"].split()] + [-1] * (max_genres - len(v["class"].split()))
                   for k, v in item.items()}

    years = {k: float(v["release_year"]) if v["release_year"].isdigit() else 1990.0 for k, v in item.items()}
    user_cols = {k: (uid[k], sum(int(u["age"]) >= a for a in AGE_BUCKETS), gender[u["gender"]], occ[u["occupation"]],
                     zips[u["zip_code"][:2]], float(u["age"])) for k, u in user.items()}
    ids, multi, dense = [], [], []
    for r in inter:  # one pass over the 100K ratings
        u, i = user_cols[r["user_id"]], r["item_id"]
        ids.append((u[0], iid[i], *u[1:5]))
        multi.append(item_genres[i])
        dense.append((u[5], years[i], float(r["timestamp"]), float(r["rating"]) >= 4))
    ids, dense = torch.tensor(ids), torch.tensor(dense, dtype=torch.float64)
    label, dense = dense[:, 3].float(), dense[:, :3]
    dense = ((dense - dense.mean(0)) / dense.std(0).clamp(min=1e-6)).float()
    names = ("user_id", "item_id", "age", "gender", "occupation", "zip_prefix")
    sparse = {name: ids[:, k].contiguous() for k, name in enumerate(names)}
    sparse["genres"] = torch.tensor(multi)
    rows = {"user_id": len(uid), "item_id": len(iid), "age": len(AGE_BUCKETS) + 1, "gender": len(gender),
            "occupation": len(occ), "zip_prefix": len(zips), "genres": len(genres)}
    return Dataset("MovieLens-100K", dense, label, sparse, rows)


def synthetic(samples: int, rows: int, seed: int, features: int = 26, dense: int = 13, alpha: float = 1.05) -> Dataset:
    """Criteo-shaped: `features` one-hot features with power-law ids over `rows` rows each,
    `dense` normal features; labels drawn from a hidden logistic model of both, so there is
    something to learn."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(samples, features, generator=g, dtype=torch.float64)
    a = 1.0 - alpha
    rank = ((1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a) - 1.0).long().clamp_(0, rows - 1)
    ids = (rank * 2_654_435_761) % rows
    x = torch.randn(samples, dense, generator=g)
    hidden = torch.randn(features, rows, generator=g) * 0.5
    logit = hidden.gather(1, ids.t()).sum(0) / features ** 0.5 + x @ torch.randn(dense, generator=g) * 0.3
    label = (torch.rand(samples, generator=g) < torch.sigmoid(logit)).float()
    sparse = {f"C{i + 1}": ids[:, i].contiguous() for i in range(features)}
    return Dataset(f"synthetic {features} x {rows:,} rows", x, label, sparse, {k: rows for k in sparse})
