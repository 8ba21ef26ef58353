"""Jagged keyed features: the batch container of every sparse feature (TorchRec's layout)."""

from embfuse.sparse.jagged import JaggedTensor, KeyedJaggedTensor
from embfuse.sparse.keyed_tensor import KeyedTensor
from embfuse.sparse.padded import PaddedKeyedJaggedTensor
from embfuse.sparse import pytree

pytree.register()

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "PaddedKeyedJaggedTensor"]
