from embfuse.nn.collection import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                                   TableStatistics)
from embfuse.nn.modules import Embedding, EmbeddingBag

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingBagConfig",
           "EmbeddingConfig", "TableStatistics"]
