"""TensorFlow / DeepRec semantics: `embfuse.tf.safe_embedding_lookup_sparse` and friends give
TensorFlow's numbers (combiners sum / mean / sqrtn, pruning, default ids, max_norm clipping,
partitioned tables) on torch tensors. See lookup.py for the exact rules."""

from embfuse.tf.lookup import embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "safe_embedding_lookup_sparse"]
