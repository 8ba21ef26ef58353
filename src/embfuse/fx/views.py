"""Where a rewritten module was, a view that keeps its name: the original's tensors are now
slices of a combined one (a collection's flat table, a (N, D) stack of LayerNorm affines), and
a view module at the original path shows them under the original attribute names, and saves
and loads them under the original state_dict keys. The combined tensors are what train (they
are the parameters); the views hold no parameters of their own."""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor


class _View(torch.nn.Module):
    """Subclasses say what the view shows in `_tensors()`: name -> a view of the owner's tensor.
    The owner is held in a list, so that it is not registered twice (it is a module elsewhere)."""

    def __init__(self, owner: torch.nn.Module):
        super().__init__()
        self._owner = [owner]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self._tensors().items():
            destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, t in self._tensors().items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(t.shape):
                error_msgs.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(t.shape)} here")
                continue
            with torch.no_grad():
                t.copy_(value)


class TableView(_View):
    """A batched nn.EmbeddingBag: `weight` is its table in the LookupBatch's collection."""

    def __init__(self, batch: torch.nn.Module, name: str):
        super().__init__(batch)
        self._name = name

    def _tensors(self) -> dict[str, Tensor]:
        return {"weight": self.weight}

    @property
    def weight(self) -> Tensor:
        return self._owner[0].collection.embedding_weight(self._name)


class RowView(_View):
    """A fused nn.LayerNorm: `weight` / `bias` are row `index` of the FusedChain's (N, D) stacks
    `weight_<op>` / `bias_<op>` (None where the original had none)."""

    def __init__(self, chain: torch.nn.Module, op: int, index: int):
        super().__init__(chain)
        self._op, self._index = op, index

    def _row(self, kind: str):
        stack = getattr(self._owner[0], f"{kind}_{self._op}", None)
        return None if stack is None else stack[self._index]

    def _tensors(self) -> dict[str, Tensor]:
        return {k: t for k in ("weight", "bias") if (t := self._row(k)) is not None}

    @property
    def weight(self):
        return self._row("weight")

    @property
    def bias(self):
        return self._row("bias")


def hide_shown(owner: torch.nn.Module) -> None:
    """Keep `owner`'s shown tensors out of its state_dict (its views save them under the original
    keys), and let a checkpoint without them (an eager model's) load: what it lacks of `owner`'s
    own state keeps its current value. `owner._shown()`: key (below the owner) -> the tensor a
    view shows."""
    owner.register_state_dict_post_hook(_drop_shown)
    owner.register_load_state_dict_pre_hook(_keep_current)


def _drop_shown(module, state_dict, prefix, local_metadata):
    for key in module._shown():
        state_dict.pop(prefix + key, None)


def _keep_current(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for key, value in module.state_dict(prefix=prefix, keep_vars=True).items():
        state_dict.setdefault(key, value.detach())
    for key, t in module._shown().items():  # (the views load the checkpoint's values after this)
        state_dict[prefix + key] = t.detach()


def restore_names(gm: torch.fx.GraphModule) -> None:
    """After the passes: the modules they replaced leave `gm`, and each owner of combined tensors
    (a module with `embfuse_views()`) puts its views at the original paths."""
    gm.delete_all_unused_submodules()
    for owner in [m for m in gm.modules() if hasattr(m, "embfuse_views")]:
        for path, view in owner.embfuse_views():
            gm.add_submodule(path, view)
