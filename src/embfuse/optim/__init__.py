"""Fused sparse optimizers: touched rows are updated inside the backward, in place."""

from embfuse.optim.fused import apply_sparse_update, apply_sparse_update_reference
from embfuse.optim.rules import SGD, Adagrad, Adam, RowWiseAdagrad, init_state

__all__ = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "init_state", "apply_sparse_update",
           "apply_sparse_update_reference", "apply_optimizer_in_backward"]


def apply_optimizer_in_backward(optimizer, modules) -> None:
    """TorchRec's `apply_optimizer_in_backward`, for embfuse modules: from now on each module's
    backward updates its own touched rows with `optimizer` (state allocated here)."""
    for m in modules:
        m.set_optimizer(optimizer)
