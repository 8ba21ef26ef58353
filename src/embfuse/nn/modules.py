"""Drop-in modules: subclasses of torch's, so constructors, `from_pretrained`, `reset_parameters`
and state_dicts are torch's own; only the forward runs through embfuse's ops.

With `optimizer=` (an embfuse.optim rule) the backward updates the touched rows in place and
`weight.grad` stays None. The optimizer state then joins the state_dict as
`optimizer_<name>` buffers (fp32) with the step count as `optimizer_step`, so a checkpoint resumes
bitwise where it left off; loading a plain torch state_dict then needs `strict=False`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Optional

from embfuse._triton import needs_op
from embfuse.ops import embedding, embedding_bag
from embfuse.ops.embedding_bag import lookup_bags
from embfuse.ops.residency import Residency, ResidencyReport
from embfuse.ops.validate import DEFAULT_BOUNDS_CHECK, sparse_layout
from embfuse.optim.lookup import FusedOptimizer, fused_embedding, fused_embedding_bag


def fused_table(weight: torch.nn.Parameter) -> None:
    """A table the backward updates in place gets no gradient: it asks for none (requires_grad
    False), so torch optimizers and DDP pass it over, and torch.compile (2.11) lets the compiled
    backward write it (AOTAutograd refuses in-place writes to leaves that require grad)."""
    weight.requires_grad_(False)


class FusedModule:
    """What every embfuse module with `optimizer=` shares: the fused optimizer, its state
    buffers (moved by .to(), kept fp32 by .half()) and its step count in the state_dict."""

    def _init_fused(self, bounds_check, optimizer):
        self.bounds_check = bounds_check
        self._fused = None
        if optimizer is not None:
            self.set_optimizer(optimizer)

    def set_optimizer(self, optimizer) -> None:
        """Update this table inside the backward with `optimizer` from now on (fresh state)."""
        if getattr(self, "mode", "sum") == "max" or self.scale_grad_by_freq or self.sparse:
            raise ValueError(f"a fused optimizer supports sum, mean, sqrtn and wmean pooling without "
                             f"scale_grad_by_freq or sparse; "
                             f"this module has mode={getattr(self, 'mode', None)!r}, "
                             f"scale_grad_by_freq={self.scale_grad_by_freq}, sparse={self.sparse}")
        fused = FusedOptimizer(optimizer, self.num_embeddings, self.embedding_dim, self.weight.device)
        for name, tensor in fused.state.items():
            self.register_buffer(f"optimizer_{name}", tensor)
        self._fused = fused
        fused_table(self.weight)

    def _apply(self, fn, recurse=True):
        """module.to() / .cuda() move the optimizer state; .half() / .double() / .to(dtype)
        leave it float32 (the state is fp32 whatever the table's dtype)."""
        names = [f"optimizer_{k}" for k in self._fused.state] if self._fused is not None else []
        state = {n: self._buffers.pop(n) for n in names}
        try:
            result = super()._apply(fn, recurse)
        finally:
            for n, t in state.items():
                moved = fn(t)
                self._buffers[n] = moved if moved.dtype == t.dtype else t.to(moved.device)
        return result

    @property
    def optimizer(self):
        return self._fused.optimizer if self._fused is not None else None

    def _fused_now(self):
        """The fused optimizer pointed at this module's current state buffers (module.to() and
        load_state_dict replace them), or None when this forward is not training."""
        if self._fused is None or not torch.is_grad_enabled():
            return None
        self._fused.state = {k: getattr(self, f"optimizer_{k}") for k in self._fused.state}
        return self._fused

    # the step count is a host int (bias corrections are host scalars: no device read per step);
    # it joins the state_dict as "optimizer_step" only when there is an optimizer, so plain
    # modules keep torch's keys exactly
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._fused is not None:
            destination[prefix + "optimizer_step"] = torch.tensor(self._fused.step)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "optimizer_step"
        if self._fused is not None:
            if key in state_dict:
                step = state_dict[key]
                if torch.is_tensor(step) and (step.is_floating_point() or step.numel() != 1) or int(step) < 0:
                    error_msgs.append(f"{key}: the step count must be a non-negative integer, got {step}")
                else:
                    self._fused.set_step(int(step))
            elif strict:
                missing_keys.append(key)
        state_dict = {k: v for k, v in state_dict.items() if k != key or self._fused is None}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class Embedding(FusedModule, torch.nn.Embedding):
    """`torch.nn.Embedding` with embfuse's lookup. `bounds_check` as in `embfuse.embedding`."""

    def __init__(self, *args, bounds_check: str = DEFAULT_BOUNDS_CHECK, optimizer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused(bounds_check, optimizer)

    def forward(self, input: Tensor) -> Tensor:
        args = (input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                self.sparse)
        fused = self._fused_now()
        if fused is not None:
            return fused_embedding(fused, *args, bounds_check=self.bounds_check)
        return embedding(*args, bounds_check=self.bounds_check)


class EmbeddingBag(FusedModule, torch.nn.EmbeddingBag):
    """`torch.nn.EmbeddingBag` with embfuse's pooled lookup. `pin_hot_rows_in_l2` and
    `l2_refresh`: as in EmbeddingBagCollection (GPU lookups that train nothing read the most
    looked-up rows from a copy held in a persisting L2 window, or from the table itself when they
    are one run of it; `l2_residency` reports it). Not
    with max_norm (it changes rows in the lookup), padding_idx or max pooling (they compare ids,
    and a rewritten id reads a row of the copy)."""

    def __init__(self, *args, bounds_check: str = DEFAULT_BOUNDS_CHECK, optimizer=None,
                 pin_hot_rows_in_l2: bool = False, l2_refresh: int = 1000, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused(bounds_check, optimizer)
        self._residency = Residency(l2_refresh) if pin_hot_rows_in_l2 else None

    @property
    def l2_residency(self) -> Optional[ResidencyReport]:
        return None if self._residency is None else self._residency.report

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        args = (input, self.weight, offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.mode,
                self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
        fused = self._fused_now()
        if fused is not None:
            return fused_embedding_bag(fused, *args, bounds_check=self.bounds_check)
        if (self._residency is not None and self.max_norm is None and self.padding_idx is None and self.mode != "max"
                and not needs_op(self.weight, per_sample_weights)):
            return self._resident_forward(*args)
        return embedding_bag(*args, bounds_check=self.bounds_check)

    def _resident_forward(self, input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                          per_sample_weights, include_last_offset, padding_idx):
        """embedding_bag's lookup, hot rows read from their copy (ops/residency.py)."""
        step = self._fused.step if self._fused is not None else 0
        resident = self._residency.resident(weight, lambda: [weight], [0, self.num_embeddings],
                                            lambda: input.reshape(-1), [0], step)
        return lookup_bags(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode,
                           sparse_layout(sparse), per_sample_weights, include_last_offset, padding_idx,
                           self.bounds_check, "input", resident)
