"""Lookup ops: each file holds the reference, the Triton kernel, its launcher and the op."""

from embfuse.ops.validate import BadBatchError, BadIdError, check_errors
from embfuse.ops.embedding import embedding
from embfuse.ops.embedding_bag import embedding_bag

__all__ = ["embedding", "embedding_bag", "check_errors", "BadIdError", "BadBatchError"]
