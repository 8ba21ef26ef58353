"""Backward fused with the optimizer: the gradient never materialises as a dense table.

The ids are sorted stably and each run of equal ids reduced in a fixed order (ops/_segment.py:
hot rows in pieces, then the pieces in order); the program that finishes a row's gradient reads
the row's weight and state, applies the rule and writes them back. In place, deterministic, no
atomics.
"""

from __future__ import annotations

import torch

from embfuse._triton import next_pow2, tl, triton, use_kernels
from embfuse.ops._segment import Runs, launch_runs, run_gradient
from embfuse.optim.rules import ROWWISE_ADAGRAD_KIND


def apply_sparse_update_reference(weight, state, optimizer, ids, src, src_row, scale, step, padding_idx=-1):
    """Pure torch: sum the gradient rows per distinct id (in input order), update those rows."""
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    keep = ids >= 0
    if padding_idx >= 0:
        keep &= ids != padding_idx
    rows = src.to(acc) if src_row is None else src.to(acc)[src_row]
    if scale is not None:
        rows = rows * scale.to(acc)[:, None]
    touched, inverse = torch.unique(ids[keep], return_inverse=True)
    g = torch.zeros(touched.numel(), src.shape[1], dtype=acc, device=src.device).index_add_(0, inverse, rows[keep])
    w, st = optimizer.update(weight[touched].to(acc), g, {k: v[touched].to(acc) for k, v in state.items()}, step)
    with torch.no_grad():
        weight[touched] = w.to(weight.dtype)
        for k, v in st.items():
            state[k][touched] = v.to(state[k].dtype)


@triton.jit
def _fused_update_kernel(
    sorted_ids, src_row, scale, run_start, run_end, slot, partial, src, weight, state1, state2, D,
    stride_src, stride_w, padding_idx, lr, eps, weight_decay, beta1, beta2, bc2_sqrt,
    PHASE: tl.constexpr, HAS_SCALE: tl.constexpr, KIND: tl.constexpr,
    PIECE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    row, g, length, done = run_gradient(PHASE, sorted_ids, src_row, scale, run_start, run_end, slot, partial,
                                        src, j, cols, cmask, stride_src, padding_idx, D,
                                        HAS_SCALE, PIECE, BLOCK_K, BLOCK_D)
    if done != 0:
        w_ptr = weight + row * stride_w + cols
        w = tl.load(w_ptr, mask=cmask, other=0.0).to(tl.float32)
        g = g + weight_decay * w
        if KIND == 0:  # SGD
            w = w - lr * g
        elif KIND == 1:  # Adagrad
            s_ptr = state1 + row * D + cols
            s = tl.load(s_ptr, mask=cmask, other=0.0) + g * g
            tl.store(s_ptr, s, mask=cmask)
            w = w - lr * g / (tl.sqrt(s) + eps)
        elif KIND == 2:  # row-wise Adagrad: the whole row is in this program (BLOCK_D >= D)
            s = tl.load(state1 + row) + tl.sum(g * g, axis=0) / D
            tl.store(state1 + row, s)
            w = w - lr * g / (tl.sqrt(s) + eps)
        else:  # Adam; lr arrives divided by the first bias correction
            m_ptr = state1 + row * D + cols
            v_ptr = state2 + row * D + cols
            m = tl.load(m_ptr, mask=cmask, other=0.0)
            m = m + (1.0 - beta1) * (g - m)
            v = tl.load(v_ptr, mask=cmask, other=0.0) * beta2 + (1.0 - beta2) * g * g
            tl.store(m_ptr, m, mask=cmask)
            tl.store(v_ptr, v, mask=cmask)
            w = w - lr * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(w_ptr, w.to(weight.dtype.element_ty), mask=cmask)


def apply_sparse_update(weight, state, optimizer, ids, src, src_row=None, scale=None, step=1, padding_idx=-1,
                        kernel=None):
    """Update `weight` (and `state`) in place from per-position gradients.

    ids[p]: the row position p updates (-1: none); its gradient is src[src_row[p]] * scale[p]
    (src_row None: src[p]; scale None: 1). Duplicates are summed before the update. `step` is
    the optimizer step (from 1) for learning-rate schedules and bias corrections. `kernel`
    forces the Triton kernel (True, e.g. interpreted on the CPU in tests) or the reference.
    """
    if kernel is None:
        kernel = use_kernels(weight) and weight.dtype != torch.float64
    if not kernel:
        return apply_sparse_update_reference(weight, state, optimizer, ids, src, src_row, scale, step, padding_idx)
    n, D = ids.numel(), weight.shape[1]
    if n == 0 or D == 0:
        return None
    whole_row = optimizer.kind == ROWWISE_ADAGRAD_KIND
    runs = Runs(ids, src_row, scale, block_d=next_pow2(D) if whole_row else min(next_pow2(D), 128))
    states = list(state.values()) + [weight] * (2 - len(state))  # unused pointers: any tensor
    src = src.contiguous()
    launch_runs(_fused_update_kernel, runs, D, src, weight, states[0], states[1], D, src.stride(0),
                weight.stride(0), padding_idx, *optimizer.scalars(step), KIND=optimizer.kind)
    return None
