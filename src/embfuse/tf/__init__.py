"""TensorFlow / DeepRec semantics: `embfuse.tf.safe_embedding_lookup_sparse` and friends give
TensorFlow's numbers (combiners sum / mean / sqrtn, pruning, default ids, max_norm clipping,
partitioned tables) on torch tensors. See lookup.py for the exact rules; module.py's
SafeEmbeddingBag is a trainable table with the same lookup and embfuse's fused optimizers; for
many features, `keyed_batch` makes one KeyedJaggedTensor of their SparseTensors for an
EmbeddingBagCollection whose tables say `combiner=` (one launch each way for all features)."""

from embfuse.tf.batch import keyed_batch
from embfuse.tf.lookup import embedding_lookup, embedding_lookup_sparse, safe_embedding_lookup_sparse
from embfuse.tf.module import SafeEmbeddingBag

__all__ = ["SafeEmbeddingBag", "embedding_lookup", "embedding_lookup_sparse", "keyed_batch",
           "safe_embedding_lookup_sparse"]
