"""Drop-in modules: subclasses of torch's, so constructors, `from_pretrained`, `reset_parameters`
and state_dicts are torch's own; only the forward runs through embfuse's ops."""

from __future__ import annotations

import torch
from torch import Tensor

from embfuse.ops import embedding, embedding_bag


class Embedding(torch.nn.Embedding):
    """`torch.nn.Embedding` with embfuse's lookup. `bounds_check` as in `embfuse.embedding`."""

    def __init__(self, *args, bounds_check: str = "raise", **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds_check = bounds_check

    def forward(self, input: Tensor) -> Tensor:
        return embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                         self.scale_grad_by_freq, self.sparse, bounds_check=self.bounds_check)


class EmbeddingBag(torch.nn.EmbeddingBag):
    """`torch.nn.EmbeddingBag` with embfuse's pooled lookup."""

    def __init__(self, *args, bounds_check: str = "raise", **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds_check = bounds_check

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        return embedding_bag(input, self.weight, offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                             self.mode, self.sparse, per_sample_weights, self.include_last_offset,
                             self.padding_idx, bounds_check=self.bounds_check)
