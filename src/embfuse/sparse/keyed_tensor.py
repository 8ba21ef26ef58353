"""KeyedTensor: the pooled outputs of several features side by side (TorchRec's), with its
regroup functions. torch.fx traces through all of it as TorchRec's does: a KeyedTensor made
from traced values is one node (sparse/tracing.py), and regroup / regroup_as_dict of traced
KeyedTensors one call each (torch.fx.wrap)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
from torch import Tensor

from embfuse.sparse.tracing import Traceable


class KeyedTensor(metaclass=Traceable):
    """Pooled outputs of several features side by side: values (B, sum of widths)."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor, key_dim: int = 1):
        self._keys, self._length_per_key = list(keys), list(length_per_key)
        self._values, self._key_dim = values, key_dim

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return list(itertools.accumulate(self._length_per_key, initial=0))

    def to_dict(self) -> dict[str, Tensor]:
        return dict(zip(self._keys, torch.split(self._values, self._length_per_key, dim=self._key_dim)))

    def __getitem__(self, key: str) -> Tensor:
        return self.to_dict()[key]

    def _key_indices(self) -> dict[str, int]:
        """key -> its position: TorchRec's own functions over KeyedTensors (regroup_kts,
        permute_multi_embedding) read it, so they take embfuse's KeyedTensor too."""
        return {k: i for i, k in enumerate(self._keys)}

    @staticmethod
    def from_tensor_list(keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1,
                         cat_dim: int = 1) -> "KeyedTensor":
        """TorchRec's: one tensor a key, concatenated along `cat_dim`; each key's length is its
        tensor's size along `key_dim`."""
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        return KeyedTensor(keys, [t.shape[key_dim] for t in tensors], torch.cat(list(tensors), dim=cat_dim),
                           key_dim)

    @staticmethod
    def regroup(keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]]) -> list[Tensor]:
        """TorchRec's: for each group of keys, those keys' columns (from whichever KeyedTensor holds
        them; all share their other dimensions) concatenated in the group's order."""
        return _regroup(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]],
                        keys: Sequence[str]) -> dict[str, Tensor]:
        """`regroup`, each group named by keys[i]."""
        return _regroup_as_dict(keyed_tensors, groups, keys)

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values})"

    def __str__(self) -> str:
        """TorchRec's layout: each key's block as nested lists."""
        if not self._keys:
            return "KeyedTensor()\n"
        blocks = ",\n".join(f'    "{k}": {v.tolist()}' for k, v in self.to_dict().items())
        return f"KeyedTensor({{\n{blocks}\n}})\n"


def _regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    if not keyed_tensors:
        raise ValueError("regroup needs at least one KeyedTensor")
    dim = keyed_tensors[0].key_dim()
    where = {}
    for kt in keyed_tensors:
        if kt.key_dim() != dim:
            raise ValueError(f"KeyedTensors of key_dim {dim} and {kt.key_dim()} cannot be regrouped together")
        for key, part in kt.to_dict().items():
            where.setdefault(key, part)  # the first KeyedTensor holding a key gives it
    out = []
    for group in groups:
        missing = [k for k in group if k not in where]
        if missing:
            raise KeyError(f"no KeyedTensor holds key {missing[0]!r}")
        out.append(torch.cat([where[k] for k in group], dim=dim))
    return out


def _regroup_as_dict(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]],
                     keys: Sequence[str]) -> dict[str, Tensor]:
    if len(groups) != len(keys):
        raise ValueError(f"{len(groups)} groups but {len(keys)} names")
    return dict(zip(keys, _regroup(keyed_tensors, groups)))


torch.fx.wrap("_regroup")
torch.fx.wrap("_regroup_as_dict")
