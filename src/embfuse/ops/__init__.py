"""Lookup ops: each file holds the reference, the Triton kernel, its launcher and the op.

bags.py is the one home of pooling (modes, a value's bag, the backward's inputs) for single
tables and collections; tuning.py holds every launch rule; validate.py, deferred.py and
check_kernels.py check batches; segments.py is the deterministic gradient reduction every backward shares.
"""

from embfuse.ops.deferred import check_errors
from embfuse.ops.embedding import embedding
from embfuse.ops.embedding_bag import embedding_bag
from embfuse.ops.errors import BadBatchError, BadIdError

__all__ = ["embedding", "embedding_bag", "check_errors", "BadIdError", "BadBatchError"]
