"""A keyed batch of fixed shapes whatever its bag lengths: values padded to a capacity.

CUDA graphs and `torch.compile(mode="reduce-overhead")` replay fixed shapes. A KeyedJaggedTensor
of B samples has fixed-size lengths, but its values change size with every batch, so each batch
would be a new graph (recorded again, or compiled again). `PaddedKeyedJaggedTensor.from_kjt(kjt,
capacity)` keeps the lengths and puts the values (and weights) in a buffer of `capacity` entries:
the batch's values, then padding that no bag holds. Every batch of at most `capacity` values
then has the same shapes, and one graph replays them all.

An EmbeddingBagCollection looks a padded batch up as the batch itself: the same outputs,
gradients and fused updates, to rounding (on a GPU the pooling kernel's launch shape is picked
from the value count, padding included, which can change the order of a bag's sum). The padding is
neither checked nor read: the check stops at the last bag, the lookup pools bags, and the
backward gives padding no row. Key-by-key views (`to_dict`, `split`, `permute`, `[key]`) hold
the batch's values only; `unpad()` gives the plain batch back (one host read on a GPU).
`statistics()` and sharded collections unpad it (they read the host anyway); pin_hot_rows_in_l2
counts no padding. Not taken: a batch size per feature (VBE), TensorFlow's safe rules, hot_rows
training, and EmbeddingCollection (its outputs have the batch's own sizes).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from embfuse.sparse.jagged import KeyedJaggedTensor


def _pad(t: Optional[Tensor], capacity: int) -> Optional[Tensor]:
    if t is None:
        return None
    return torch.cat([t, t.new_zeros(capacity - t.shape[0], *t.shape[1:])])


class PaddedKeyedJaggedTensor(KeyedJaggedTensor):
    """A KeyedJaggedTensor whose values (and weights) hold `capacity()` entries, of which the
    lengths take the first sum(lengths) (see the module docstring)."""

    _padded = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.variable_stride_per_key():
            raise ValueError("a padded batch has one batch size for every feature (no stride_per_key_per_rank)")

    @staticmethod
    def from_kjt(kjt: KeyedJaggedTensor, capacity: int) -> "PaddedKeyedJaggedTensor":
        """`kjt` with its values and weights padded with zeros to `capacity` entries. Raises if
        the batch holds more values than that."""
        n = kjt.values().shape[0]
        if n > capacity:
            raise ValueError(f"the batch has {n} values, more than the capacity {capacity}")
        return PaddedKeyedJaggedTensor(kjt.keys(), _pad(kjt.values(), capacity),
                                       _pad(kjt.weights_or_none(), capacity), lengths=kjt.lengths(),
                                       stride=kjt.stride(), length_per_key=kjt.length_per_key_or_none())

    def capacity(self) -> int:
        return self._values.shape[0]

    def unpad(self) -> KeyedJaggedTensor:
        """The batch without its padding (a plain KeyedJaggedTensor; one host read on a GPU)."""
        n = sum(self.length_per_key())
        weights = self.weights_or_none()
        return KeyedJaggedTensor(self.keys(), self._values[:n], None if weights is None else weights[:n],
                                 lengths=self.lengths(), stride=self.stride(), length_per_key=self.length_per_key())

    def __repr__(self) -> str:
        return "Padded" + super().__repr__()
