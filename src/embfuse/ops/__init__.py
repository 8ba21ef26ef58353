"""Lookup ops: each file holds the reference, the Triton kernel, its launcher and the op."""

from embfuse.ops._validate import validate_bags
from embfuse.ops.embedding import embedding
from embfuse.ops.embedding_bag import embedding_bag

__all__ = ["embedding", "embedding_bag", "validate_bags"]
