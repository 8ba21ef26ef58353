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

from embfuse.ops import embedding, embedding_bag
from embfuse.ops.validate import DEFAULT_BOUNDS_CHECK
from embfuse.optim.lookup import FusedOptimizer, fused_embedding, fused_embedding_bag


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
            raise ValueError(f"a fused optimizer supports sum, mean and sqrtn pooling without scale_grad_by_freq or "
                             f"sparse; "
                             f"this module has mode={getattr(self, 'mode', None)!r}, "
                             f"scale_grad_by_freq={self.scale_grad_by_freq}, sparse={self.sparse}")
        fused = FusedOptimizer(optimizer, self.num_embeddings, self.embedding_dim, self.weight.device)
        for name, tensor in fused.state.items():
            self.register_buffer(f"optimizer_{name}", tensor)
        self._fused = fused

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
                    self._fused.step = int(step)
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
    """`torch.nn.EmbeddingBag` with embfuse's pooled lookup."""

    def __init__(self, *args, bounds_check: str = DEFAULT_BOUNDS_CHECK, optimizer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused(bounds_check, optimizer)

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        args = (input, self.weight, offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.mode,
                self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
        fused = self._fused_now()
        if fused is not None:
            return fused_embedding_bag(fused, *args, bounds_check=self.bounds_check)
        return embedding_bag(*args, bounds_check=self.bounds_check)
