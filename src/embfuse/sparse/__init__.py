"""Jagged keyed features: the batch container of every sparse feature (TorchRec's layout)."""

from embfuse.sparse.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
