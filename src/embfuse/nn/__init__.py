from embfuse.nn.modules import Embedding, EmbeddingBag

__all__ = ["Embedding", "EmbeddingBag"]
