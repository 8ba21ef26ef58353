"""pytest plugin: embfuse's embedding, embedding_bag, Embedding and EmbeddingBag in torch's place
(SWAP=0: stock torch), for PyTorch's own test/nn/test_embedding.py."""
import os

if os.environ.get("SWAP", "1") == "1":
    import torch.nn
    import torch.nn.functional

    import embfuse

    torch.nn.functional.embedding, torch.nn.functional.embedding_bag = embfuse.embedding, embfuse.embedding_bag
    torch.nn.Embedding, torch.nn.EmbeddingBag = embfuse.nn.Embedding, embfuse.nn.EmbeddingBag
