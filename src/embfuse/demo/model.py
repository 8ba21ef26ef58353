"""A DLRM-style click model (Naumov et al., 2019) with two interchangeable sparse front ends.

    dense -> bottom MLP -> d;  sparse features -> one pooled embedding each -> e_1..e_F
    z = [d, pairwise dot products of (d, e_1, ..., e_F)] -> top MLP -> logit

`EmbfuseSparse` looks every feature up in one embfuse.EmbeddingBagCollection whose backward
applies the optimizer (fused); `TorchSparse` is the same thing built from one torch
nn.EmbeddingBag per feature with sparse gradients and torch.optim.Adagrad.
"""

from __future__ import annotations

import torch
from torch import nn

import embfuse


def mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class EmbfuseSparse(nn.Module):
    def __init__(self, rows: dict[str, int], dim: int, lr: float, device, multi_hot: set[str]):
        super().__init__()
        tables = [embfuse.EmbeddingBagConfig(n, dim, name=f, feature_names=[f],
                                             pooling="mean" if f in multi_hot else "sum") for f, n in rows.items()]
        self.ebc = embfuse.EmbeddingBagCollection(tables, device=device, optimizer=embfuse.optim.Adagrad(lr=lr))
        self.dim = dim

    def forward(self, kjt) -> torch.Tensor:
        """(B, F, dim): the collection's pooled rows, every feature's side by side in one tensor, viewed
        per feature (as TorchRec's DLRM reads its KeyedTensor): no split and no copy."""
        return self.ebc(kjt).values().unflatten(1, (-1, self.dim))

    def step(self):
        """Nothing: the backward already updated the touched rows."""

    def tables(self) -> list[torch.Tensor]:
        return self.ebc.table_weights()

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ebc.weights, *self.ebc.buffers()))


class TorchSparse(nn.Module):
    def __init__(self, rows: dict[str, int], dim: int, lr: float, device, multi_hot: set[str]):
        super().__init__()
        self.bags = nn.ModuleDict({f: nn.EmbeddingBag(n, dim, mode="mean" if f in multi_hot else "sum", sparse=True,
                                                      device=device) for f, n in rows.items()})
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=lr)

    def forward(self, kjt) -> list[torch.Tensor]:
        """One (B, dim) tensor a feature."""
        parts = kjt.to_dict()
        return [bag(parts[f].values(), parts[f].offsets()[:-1]) for f, bag in self.bags.items()]

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tables(self) -> list[torch.Tensor]:
        return [b.weight for b in self.bags.values()]

    def memory_bytes(self) -> int:
        state = [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in [*self.bags.parameters(), *state])


class DLRM(nn.Module):
    def __init__(self, sparse: nn.Module, n_dense: int, n_sparse: int, dim: int):
        super().__init__()
        self.sparse = sparse
        self.bottom = mlp([n_dense, 64, dim])
        n = n_sparse + 1
        self.top = mlp([dim + n * (n - 1) // 2, 128, 64, 1], last_relu=False)
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        d = self.bottom(dense)
        e = self.sparse(kjt)  # (B, F, dim), or F tensors of (B, dim): each front end's own form
        z = torch.cat([d.unsqueeze(1), e], 1) if torch.is_tensor(e) else torch.stack([d, *e], 1)  # (B, 1 + F, dim)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([d, dots], 1)).squeeze(1)

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("sparse.")]
