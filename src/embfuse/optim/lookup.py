"""Lookups whose backward applies the optimizer: what modules built with `optimizer=` run.

The weight is not an autograd input (its .grad stays None); a scalar `anchor` that requires
grad makes autograd call the backward, which updates the touched rows in place. The backward
reads the ids saved by the forward, so a batch rejected by validation never reaches it: weights
and state stay bitwise unchanged.
"""

from __future__ import annotations

import torch

from embfuse._triton import use_kernels
from embfuse.ops.embedding import _forward_impl as _gather
from embfuse.ops.embedding import prepare_ids
from embfuse.ops.embedding_bag import backward_inputs, per_sample_weights_grad, prepare_bags
from embfuse.ops.embedding_bag import _forward_impl as _pool
from embfuse.ops.collection import _forward_impl as _pool_collection
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


class _FusedBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weight, indices, offsets, psw, mode, padding_idx, fused):
        out, _ = _pool(weight, indices, offsets, psw, mode, padding_idx, with_max_ids=False)
        ctx.save_for_backward(indices, offsets, psw)
        ctx.weight, ctx.mode, ctx.padding_idx, ctx.fused = weight, mode, padding_idx, fused
        return out

    @staticmethod
    def backward(ctx, grad):
        indices, offsets, psw = ctx.saved_tensors
        grad_psw = None
        if psw is not None and ctx.needs_input_grad[4]:  # before the rows change
            grad_psw = per_sample_weights_grad(grad, ctx.weight, indices, offsets, psw, ctx.padding_idx)
        fused = ctx.fused
        fused.step += 1
        if offsets.numel() > 1:
            ids, bag, scale = backward_inputs(indices, offsets, psw, ctx.mode, ctx.padding_idx,
                                              num_weights=ctx.weight.shape[0])
            apply_sparse_update(ctx.weight, fused.state, fused.optimizer, ids, grad.contiguous(), bag, scale,
                                fused.step, ctx.padding_idx)
        return None, None, None, None, grad_psw, None, None, None


class _FusedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weight, ids, keep, padding_idx, fused):
        ctx.save_for_backward(ids, keep)
        ctx.weight, ctx.padding_idx, ctx.fused = weight, padding_idx, fused
        out = _gather(weight, ids)
        return out if keep is None else out * keep.reshape(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        ids, keep = ctx.saved_tensors
        fused = ctx.fused
        fused.step += 1
        if keep is not None:
            ids = torch.where(keep.reshape(-1), ids.long(), -1)
        apply_sparse_update(ctx.weight, fused.state, fused.optimizer, ids.long(), grad.contiguous(), None, None,
                            fused.step, ctx.padding_idx)
        return None, None, None, None, None, None


class _FusedCollection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weights, values, offsets, psw, plan, B, fused, hot):
        ctx.save_for_backward(values, offsets, psw)
        ctx.weights, ctx.plan, ctx.B, ctx.fused, ctx.hot = weights, plan, B, fused, hot
        return _pool_collection(weights, values, offsets, psw, plan.meta, B, plan.total_dim, plan.max_dim,
                                plan.layout.vec)

    @staticmethod
    def backward(ctx, grad):
        values, offsets, psw = ctx.saved_tensors
        fused, weights, hot = ctx.fused, ctx.weights, ctx.hot
        fused.step += 1
        # the hot-row path reads the host (see optim/hot.py): eager steps only, never while a
        # CUDA graph is captured
        if (hot is not None and psw is None and values.numel() >= hot.min_values and use_kernels(weights)
                and weights.dtype != torch.float64 and not torch.cuda.is_current_stream_capturing()):
            hot.maybe_refresh(values, offsets, ctx.plan, ctx.B, fused.step)
            hot_update(weights, list(fused.state.values()), fused.optimizer, values, offsets, ctx.plan, ctx.B,
                       grad.contiguous(), fused.step, hot)
        else:
            collection_update(weights, fused.state, fused.optimizer, values, offsets, psw, ctx.plan, ctx.B, grad,
                              fused.step)
        return None, None, None, None, None, None, None, None, None


def fused_embedding_bag_collection(fused: FusedOptimizer, weights, values, offsets, psw, plan, B, hot=None):
    """`embedding_bag_collection` whose backward updates `weights` with `fused` (the hot rows
    of `hot`, a HotRows, densely: optim/hot.py)."""
    return _FusedCollection.apply(fused.anchor, weights.detach(), values, offsets, psw, plan, B, fused, hot)


def _unsupported(scale_grad_by_freq, sparse, mode="sum"):
    if scale_grad_by_freq or sparse or mode == "max":
        raise ValueError("a fused optimizer supports sum and mean pooling without scale_grad_by_freq or sparse")


def fused_embedding_bag(fused: FusedOptimizer, input, weight, offsets=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False, per_sample_weights=None,
                        include_last_offset=False, padding_idx=None, *, bounds_check="raise", name="input"):
    """`embfuse.embedding_bag` whose backward updates `weight` with `fused` instead of a gradient."""
    _unsupported(scale_grad_by_freq, sparse, mode)
    indices, offsets, psw, mode, padding_idx = prepare_bags(
        input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx, bounds_check, name)
    return _FusedBag.apply(fused.anchor, weight.detach(), indices, offsets, psw, mode, padding_idx, fused)


def fused_embedding(fused: FusedOptimizer, input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                    scale_grad_by_freq=False, sparse=False, *, bounds_check="raise", name="input"):
    """`embfuse.embedding` whose backward updates `weight` with `fused` instead of a gradient."""
    _unsupported(scale_grad_by_freq, sparse)
    flat, keep, padding_idx = prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name)
    out = _FusedEmbedding.apply(fused.anchor, weight.detach(), flat, keep, padding_idx, fused)
    return out.view(*input.shape, weight.shape[1])
