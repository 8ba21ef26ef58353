"""An eager recommendation model written the usual way, the input of `embfuse.fx.optimize` in
the tests and in `embfuse bench --fx`: one `nn.EmbeddingBag` per feature, each input moved to
the device on its own, then split -> LayerNorm -> tanh -> cat and an MLP (the shape of Meta's
seed models)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class EagerModel(nn.Module):
    """forward(ids, offsets): one host (or device) tensor per feature in each list, torch's
    EmbeddingBag inputs (1-D ids, B offsets). Returns (B, 1) logits."""

    def __init__(self, sizes: list[int], dim: int, mode: str = "mean", hidden=(512, 256), affine: bool = True,
                 sparse: bool = True, device=None):
        super().__init__()
        self.dim = dim
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=mode, sparse=sparse, device=device) for n in sizes)
        self.norms = nn.ModuleList(nn.LayerNorm(dim, elementwise_affine=affine, device=device) for _ in sizes)
        widths = [len(sizes) * dim, *hidden]
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b, device=device), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(widths[-1], 1, device=device))
        if affine:  # not the identity init, so that a test sees each feature's own affine
            with torch.no_grad():
                for norm in self.norms:
                    norm.weight.uniform_(0.5, 1.5)
                    norm.bias.uniform_(-0.5, 0.5)

    def forward(self, ids: list[Tensor], offsets: list[Tensor]) -> Tensor:
        device = self.mlp[0].weight.device
        pooled = [emb(i.to(device), o.to(device)) for emb, i, o in zip(self.embs, ids, offsets)]
        x = torch.cat(pooled, dim=1)
        parts = torch.split(x, self.dim, dim=1)
        x = torch.cat([torch.tanh(norm(p)) for norm, p in zip(self.norms, parts)], dim=1)
        return self.mlp(x)


def eager_batch(sizes: list[int], batch: int, mean_length: int, generator: torch.Generator | None = None):
    """Host inputs for EagerModel: per feature, int64 ids (power-law-ish: squared uniforms skew to
    low rows) and B offsets, bag lengths uniform in [0, 2 * mean_length]."""
    ids, offsets = [], []
    for n in sizes:
        lengths = torch.randint(0, 2 * mean_length + 1, (batch,), generator=generator)
        o = torch.zeros(batch, dtype=torch.int64)
        torch.cumsum(lengths[:-1], 0, out=o[1:])
        u = torch.rand(int(lengths.sum()), generator=generator)
        ids.append((u * u * n).long().clamp_(max=n - 1))
        offsets.append(o)
    return ids, offsets
