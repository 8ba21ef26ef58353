"""Lookups whose backward applies the optimizer: what modules built with `optimizer=` run.

The weight is not an autograd input (its .grad stays None); a scalar `anchor` that requires
grad makes autograd call the backward, which updates the touched rows in place. The backward
reads the ids saved by the forward, so a batch rejected by validation never reaches it, and one
whose deferred check fails on the device updates nothing (its kernels read the check's status):
weights and state stay bitwise unchanged, and the host undoes the step count when it learns of it.
"""

from __future__ import annotations

import contextlib

import torch

from embfuse._triton import use_kernels
from embfuse.ops.bags import accumulation
from embfuse.ops.collection import pool_collection
from embfuse.ops.deferred import known_good
from embfuse.ops.embedding import gather, guarded_ids, prepare_ids
from embfuse.ops.embedding_bag import per_sample_weights_grad, pool, prepare_bags, table_backward_inputs
from embfuse.ops.validate import DEFAULT_BOUNDS_CHECK
from embfuse.optim.fused import apply_sparse_update, collection_update
from embfuse.optim.hot import hot_update
from embfuse.optim.rules import init_state


class FusedOptimizer:
    """An optimizer bound to one table (or a collection's flat buffer): fp32 state, step count."""

    def __init__(self, optimizer, num_embeddings: int, dim: int, device, state=None):
        self.optimizer = optimizer
        self.state = init_state(optimizer, num_embeddings, dim, device) if state is None else state
        self.step = 0
        self.anchor = torch.ones((), requires_grad=True)

    @contextlib.contextmanager
    def stepping(self, check):
        """The step number of one backward's update, whose batch had `check` (a deferred Check,
        or None); None when the batch is already known bad (nothing to do). A step counts once
        the update returns: an update that raises leaves the count as it was, and one whose
        batch is found bad later is taken back then (ops/validate.py calls the undo)."""
        if check is not None and check.bad:
            yield None
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and self._changes_every_step():
            raise RuntimeError(
                f"{type(self.optimizer).__name__}: a CUDA graph replays the hyper-parameters of the step it "
                f"captured, and this rule's change every step (bias corrections, lr_decay, stochastic rounding's "
                f"seed): its fused update cannot be captured. SGD and Adagrad / RowWiseAdagrad without lr_decay "
                f"can (replays do not advance the host's step count, which they do not read).")
        self.step += 1
        try:
            yield self.step
        except BaseException:
            self.step -= 1
            raise
        if check is not None and check.bad is None:
            check.undo.append(self._undo_step)

    def _changes_every_step(self) -> bool:
        rule = self.optimizer
        return getattr(rule, "stochastic_rounding", False) or rule.hyper(1) != rule.hyper(2)

    def _undo_step(self):
        self.step -= 1


def _status(check):
    return None if check is None else check.status


class _FusedBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weight, indices, offsets, psw, mode, padding_idx, fused, check):
        out, _ = pool(weight, indices, offsets, psw, mode, padding_idx, with_max_ids=False, status=_status(check))
        ctx.save_for_backward(indices, offsets, psw, out)
        ctx.weight, ctx.mode, ctx.padding_idx, ctx.fused, ctx.check = weight, mode, padding_idx, fused, check
        return out

    @staticmethod
    def backward(ctx, grad):
        indices, offsets, psw, out = ctx.saved_tensors
        status = _status(ctx.check)
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[4]:  # before the rows change
            grad_psw = per_sample_weights_grad(grad, ctx.weight, indices, offsets, psw, ctx.padding_idx, status,
                                               ctx.mode, out)
        fused = ctx.fused
        with fused.stepping(ctx.check) as step:
            if step is not None and offsets.numel() > 1:
                ids, bag, scale = table_backward_inputs(indices, offsets, psw, ctx.mode, ctx.padding_idx,
                                                        *ctx.weight.shape, status=status,
                                                        dtype=accumulation(ctx.weight))
                apply_sparse_update(ctx.weight, fused.state, fused.optimizer, ids, grad.contiguous(), bag, scale,
                                    step, ctx.padding_idx)
        return None, None, None, None, grad_psw, None, None, None, None


class _FusedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weight, ids, keep, padding_idx, fused, check):
        ctx.save_for_backward(ids, keep)
        ctx.weight, ctx.padding_idx, ctx.fused, ctx.check = weight, padding_idx, fused, check
        out = gather(weight, ids, _status(check))
        return out if keep is None else torch.where(keep.reshape(-1, 1), out, 0)

    @staticmethod
    def backward(ctx, grad):
        ids, keep = ctx.saved_tensors
        fused = ctx.fused
        with fused.stepping(ctx.check) as step:
            if step is not None:
                ids = guarded_ids(ids, _status(ctx.check))
                if keep is not None:
                    ids = torch.where(keep.reshape(-1), ids, -1)
                apply_sparse_update(ctx.weight, fused.state, fused.optimizer, ids, grad.contiguous(), None, None,
                                    step, ctx.padding_idx)
        return None, None, None, None, None, None, None


class _FusedCollection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weights, values, offsets, psw, plan, B, fused, hot, check):
        ctx.save_for_backward(values, offsets, psw)
        ctx.weights, ctx.plan, ctx.B, ctx.fused, ctx.hot, ctx.check = weights, plan, B, fused, hot, check
        return pool_collection(weights, values, offsets, psw, plan, B, _status(check))

    @staticmethod
    def backward(ctx, grad):
        values, offsets, psw = ctx.saved_tensors
        fused, weights, hot, status = ctx.fused, ctx.weights, ctx.hot, _status(ctx.check)
        with fused.stepping(ctx.check) as step:
            if step is None:
                pass
            # the hot-row path reads the host (see optim/hot.py): eager steps only, never while a
            # CUDA graph is captured; it reads the check's status first (its passes index by id)
            elif (hot is not None and psw is None and values.numel() >= hot.min_values and use_kernels(weights)
                    and weights.dtype != torch.float64 and not torch.cuda.is_current_stream_capturing()):
                if known_good(status):
                    hot.maybe_refresh(values, offsets, ctx.plan, ctx.B, step)
                    hot_update(weights, list(fused.state.values()), fused.optimizer, values, offsets, ctx.plan,
                               ctx.B, grad.contiguous(), step, hot)
            else:
                collection_update(weights, fused.state, fused.optimizer, values, offsets, psw, ctx.plan, ctx.B,
                                  grad, step, status=status)
        return (None,) * 10


def fused_embedding_bag_collection(fused: FusedOptimizer, weights, values, offsets, psw, plan, B, hot=None,
                                   check=None):
    """`embedding_bag_collection` whose backward updates `weights` with `fused` (the hot rows
    of `hot`, a HotRows, densely: optim/hot.py); `check`: the batch's deferred Check."""
    return _FusedCollection.apply(fused.anchor, weights.detach(), values, offsets, psw, plan, B, fused, hot, check)


def _unsupported(scale_grad_by_freq, sparse, mode="sum"):
    if scale_grad_by_freq or sparse or mode == "max":
        raise ValueError("a fused optimizer supports sum, mean, sqrtn and wmean pooling without scale_grad_by_freq or "
                         "sparse")


def fused_embedding_bag(fused: FusedOptimizer, input, weight, offsets=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False, per_sample_weights=None,
                        include_last_offset=False, padding_idx=None, *, bounds_check=DEFAULT_BOUNDS_CHECK,
                        name="input"):
    """`embfuse.embedding_bag` whose backward updates `weight` with `fused` instead of a gradient."""
    _unsupported(scale_grad_by_freq, sparse, mode)
    indices, offsets, psw, mode, padding_idx, check = prepare_bags(
        input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx, bounds_check, name)
    return _FusedBag.apply(fused.anchor, weight.detach(), indices, offsets, psw, mode, padding_idx, fused, check)


def fused_embedding(fused: FusedOptimizer, input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                    scale_grad_by_freq=False, sparse=False, *, bounds_check=DEFAULT_BOUNDS_CHECK, name="input",
                    check=None):
    """`embfuse.embedding` whose backward updates `weight` with `fused` instead of a gradient.
    `check`: a deferred Check already made for these ids (EmbeddingCollection's), if any."""
    _unsupported(scale_grad_by_freq, sparse)
    flat, keep, padding_idx, own = prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name)
    out = _FusedEmbedding.apply(fused.anchor, weight.detach(), flat, keep, padding_idx, fused, check or own)
    return out.view(*input.shape, weight.shape[1])
