"""Per-feature LayerNorm and activation over N features at once:

    y[b, f, :] = act(xhat[b, f, :] * weight[f, :] + bias[f, :]),
    xhat = (x - mean(x)) / sqrt(var(x) + eps)   over the last dim D (biased variance, as torch's),

for x (B, N, D) and act one of none / tanh / sigmoid / relu. What `split(D) -> LayerNorm_f ->
act -> cat` computes, in one read of x and one write of y (torch runs LayerNorm, the affine and
the activation as three passes). The backward recomputes xhat from x (nothing else is saved) and
sums the affine's gradient in fp32 partials per block of samples, then over the blocks: the
same order every run.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from embfuse._triton import (cdiv, eager_autograd, kernel_op, launch, needs_op, next_pow2, tl,
                              tracing, triton, use_kernels)

ACTIVATIONS = ("none", "tanh", "sigmoid", "relu")
NONE, TANH, SIGMOID, RELU = range(4)
BLOCK_B = 32  # samples a program: the (BLOCK_B, D) tile of one feature shares its affine row


def layer_norm_act_reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                             act: str) -> Tensor:
    """Pure torch, in x's dtype (fp32 statistics for fp16/bf16, as torch's LayerNorm)."""
    y = torch.nn.functional.layer_norm(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x,
                                       (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = {"none": lambda t: t, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu}[act](y)
    return y.to(x.dtype)


@triton.jit
def chain_activation(z, ACT: tl.constexpr):
    if ACT == 1:
        e = tl.exp(-2.0 * tl.abs(z))  # tanh without overflow
        t = (1.0 - e) / (1.0 + e)
        return tl.where(z < 0, -t, t)
    if ACT == 2:
        return 1.0 / (1.0 + tl.exp(-z))
    if ACT == 3:
        return tl.maximum(z, 0.0)
    return z


@triton.jit
def _tile_at(b0, f, B, N, D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """The addresses and mask of feature f's (BLOCK_B, D) tile from row b0. (Apart from _tile:
    where a traced kernel stores at an address a called function returned, torch's analysis
    takes every tensor handed to that function as written, and Inductor copies it before the
    launch; ops/bags.py program_bags.)"""
    rows = b0 + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    return (rows.to(tl.int64) * N + f)[:, None] * D + cols[None, :], (rows < B)[:, None] & (cols < D)[None, :]


@triton.jit
def _tile(x, weight, bias, at, mask, f, D, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """One feature's tile (`_tile_at`): xhat, rstd and the pre-activation z."""
    cols = tl.arange(0, BLOCK_D)
    v = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(v, axis=1) / D
    diff = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    xhat = diff * rstd[:, None]
    z = xhat
    if HAS_W:
        w = tl.load(weight + f * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        z = z * w[None, :]
    if HAS_B:
        z = z + tl.load(bias + f * D + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    return xhat, rstd, z


# (a batch's size is not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["B"])
def _layer_norm_act_fwd_kernel(x, weight, bias, y, B, N, D, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                               ACT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    b0 = tl.program_id(0) * BLOCK_B
    f = tl.program_id(1)
    at, mask = _tile_at(b0, f, B, N, D, BLOCK_B, BLOCK_D)
    _, _, z = _tile(x, weight, bias, at, mask, f, D, eps, HAS_W, HAS_B, BLOCK_D)
    tl.store(y + at, chain_activation(z, ACT).to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _layer_norm_act_bwd_kernel(dy, x, weight, bias, dx, dw_part, db_part, B, N, D, eps, HAS_W: tl.constexpr,
                               HAS_B: tl.constexpr, ACT: tl.constexpr, BLOCK_B: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    pb = tl.program_id(0)
    f = tl.program_id(1)
    at, mask = _tile_at(pb * BLOCK_B, f, B, N, D, BLOCK_B, BLOCK_D)
    xhat, rstd, z = _tile(x, weight, bias, at, mask, f, D, eps, HAS_W, HAS_B, BLOCK_D)
    g = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        t = chain_activation(z, ACT)
        g = g * (1.0 - t * t)
    if ACT == 2:
        s = chain_activation(z, ACT)
        g = g * s * (1.0 - s)
    if ACT == 3:
        g = tl.where(z > 0, g, 0.0)
    g = tl.where(mask, g, 0.0)
    cols = tl.arange(0, BLOCK_D)
    part = (pb.to(tl.int64) * N + f) * D + cols
    if HAS_W:
        tl.store(dw_part + part, tl.sum(g * xhat, axis=0), mask=cols < D)
        w = tl.load(weight + f * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        g_hat = g * w[None, :]
    else:
        g_hat = g
    if HAS_B:
        tl.store(db_part + part, tl.sum(g, axis=0), mask=cols < D)
    c1 = tl.sum(g_hat * xhat, axis=1) / D
    c2 = tl.sum(g_hat, axis=1) / D
    d = (g_hat - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    tl.store(dx + at, d.to(dx.dtype.element_ty), mask=mask)


def _shape(x: Tensor):
    B, N, D = x.shape
    return B, N, D, next_pow2(D)


def layer_norm_act_forward(x, weight, bias, eps, act):
    """Triton launcher: same result as the reference (x contiguous (B, N, D))."""
    B, N, D, block_d = _shape(x)
    y = torch.empty_like(x)
    if x.numel():
        launch(_layer_norm_act_fwd_kernel)[(cdiv(B, BLOCK_B), N)](
            x, weight, bias, y, B, N, D, eps,
            HAS_W=weight is not None, HAS_B=bias is not None, ACT=ACTIVATIONS.index(act), BLOCK_B=BLOCK_B,
            BLOCK_D=block_d)
    return y


def layer_norm_act_backward(grad, x, weight, bias, eps, act):
    """(dx, dweight, dbias): the affine's gradients summed over fp32 per-block partials."""
    B, N, D, block_d = _shape(x)
    blocks = cdiv(B, BLOCK_B)
    dx = torch.empty_like(x)
    dw = torch.zeros(blocks, N, D, dtype=torch.float32, device=x.device) if weight is not None else None
    db = torch.zeros(blocks, N, D, dtype=torch.float32, device=x.device) if bias is not None else None
    if x.numel():
        launch(_layer_norm_act_bwd_kernel)[(blocks, N)](
            grad.contiguous(), x, weight, bias, dx, dw, db, B, N, D, eps, HAS_W=weight is not None,
            HAS_B=bias is not None, ACT=ACTIVATIONS.index(act), BLOCK_B=BLOCK_B, BLOCK_D=block_d)
    return (dx, None if dw is None else dw.sum(0).to(weight.dtype), None if db is None else db.sum(0).to(bias.dtype))


def layer_norm_act_backward_reference(grad, x, weight, bias, eps, act):
    """(dx, dweight, dbias) in torch ops, the kernel's formulas (fp32 for fp16/bf16 inputs):
    g = grad * act'(z), ghat = g * weight, dx = rstd * (ghat - mean(ghat) - xhat * mean(ghat * xhat))."""
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    v = x.to(acc)
    mean = v.mean(-1, keepdim=True)
    rstd = torch.rsqrt((v - mean).square().mean(-1, keepdim=True) + eps)
    xhat = (v - mean) * rstd
    z = xhat * weight.to(acc) if weight is not None else xhat
    z = z + bias.to(acc) if bias is not None else z
    g = grad.to(acc)
    if act == "tanh":
        g = g * (1 - torch.tanh(z).square())
    elif act == "sigmoid":
        s = torch.sigmoid(z)
        g = g * s * (1 - s)
    elif act == "relu":
        g = torch.where(z > 0, g, 0)
    ghat = g * weight.to(acc) if weight is not None else g
    dx = rstd * (ghat - ghat.mean(-1, keepdim=True) - xhat * (ghat * xhat).mean(-1, keepdim=True))
    dw = (g * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db = g.sum(0).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw, db


def _layer_norm_act_body(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                         act: str) -> Tensor:
    if use_kernels(x) and x.dtype != torch.float64:
        return layer_norm_act_forward(x, weight, bias, eps, act)
    return layer_norm_act_reference(x, weight, bias, eps, act)


_layer_norm_act_op = kernel_op("embfuse::layer_norm_act")(_layer_norm_act_body)


@_layer_norm_act_op.register_fake
def _(x, weight, bias, eps, act):
    return torch.empty_like(x)


def _layer_norm_act_backward_body(grad: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                  eps: float, act: str) -> list[Tensor]:
    """[dx, dweight (if weight), dbias (if bias)]."""
    if use_kernels(x) and x.dtype != torch.float64:
        grads = layer_norm_act_backward(grad, x, weight, bias, eps, act)
    else:
        grads = layer_norm_act_backward_reference(grad, x, weight, bias, eps, act)
    return [t for t in grads if t is not None]


_layer_norm_act_backward_op = kernel_op("embfuse::layer_norm_act_backward")(_layer_norm_act_backward_body)


@_layer_norm_act_backward_op.register_fake
def _(grad, x, weight, bias, eps, act):
    return [torch.empty_like(t) for t in (x, weight, bias) if t is not None]


def _setup(ctx, inputs, output):
    x, weight, bias, eps, act = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps, ctx.act = eps, act


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    # (a batched gradient takes the body too: the op has no batching rule, the torch ops do)
    run = _layer_norm_act_backward_op if needs_op(grad) else _layer_norm_act_backward_body
    grads = iter(run(grad, x, weight, bias, ctx.eps, ctx.act))
    dx = next(grads)
    dw = next(grads) if weight is not None else None
    db = next(grads) if bias is not None else None
    return dx, dw, db, None, None


_layer_norm_act_op.register_autograd(_backward, setup_context=_setup)
_eager_layer_norm_act = eager_autograd(_layer_norm_act_body, _setup, _backward)


def layer_norm_act(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5,
                   act: str = "none") -> Tensor:
    """The module docstring's y for x (B, N, D), weight and bias (N, D) or None."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be (B, N, D), got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != tuple(x.shape[1:]):
            raise ValueError(f"{name} must be (N, D) = {tuple(x.shape[1:])}, got {tuple(t.shape)}")
    run = _layer_norm_act_op  # under tracing; eager calls skip the dispatch (_triton.needs_op)
    if not tracing():
        run = _eager_layer_norm_act if needs_op(x, weight, bias) else _layer_norm_act_body
    return run(x.contiguous(), weight, bias, float(eps), act)
