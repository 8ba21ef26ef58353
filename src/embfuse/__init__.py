"""embfuse: fast embedding lookups for PyTorch recommendation models.

Importing embfuse needs neither a GPU nor Triton: CUDA tensors run Triton kernels when Triton
is there, everything else runs torch ops (torch's own CPU pooling where its rule is embfuse's,
else the pure-torch references).
"""

from embfuse.ops import BadBatchError, BadIdError, check_errors, embedding, embedding_bag
from embfuse.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, PaddedKeyedJaggedTensor
from embfuse.nn import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse import nn, optim, tf

__version__ = "0.1.0"


def __getattr__(name: str):
    """`embfuse.fx` and `embfuse.distributed` on first use (they import more of torch)."""
    if name in ("fx", "distributed"):
        import importlib

        return importlib.import_module(f"embfuse.{name}")
    raise AttributeError(f"module 'embfuse' has no attribute {name!r}")


__all__ = ["embedding", "embedding_bag", "check_errors", "BadIdError", "BadBatchError", "JaggedTensor",
           "KeyedJaggedTensor", "KeyedTensor", "PaddedKeyedJaggedTensor", "EmbeddingBagCollection",
           "EmbeddingBagConfig", "EmbeddingCollection", "EmbeddingConfig", "nn", "optim", "tf", "__version__"]
