"""pytest plugin: embfuse's containers and collections in TorchRec's place (SWAP=0: stock TorchRec)."""
import os

if os.environ.get("SWAP", "1") == "1":
    import embfuse
    import torchrec
    import torchrec.sparse
    import torchrec.sparse.jagged_tensor as tjt
    import torchrec.modules.embedding_configs as ec
    import torchrec.modules.embedding_modules as em
    import torchrec.modules as tm

    for mod in (tjt, torchrec.sparse, torchrec):
        for name in ("JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"):
            if hasattr(mod, name):
                setattr(mod, name, getattr(embfuse, name))
    for mod in (ec, em, tm, torchrec):
        for name in ("EmbeddingBagConfig", "EmbeddingConfig", "EmbeddingBagCollection", "EmbeddingCollection"):
            if hasattr(mod, name):
                setattr(mod, name, getattr(embfuse, name))
