"""Per-feature LayerNorm + activation (ops/chain.py): kernels (GPU, or the interpreter on small
shapes) and the registered op against a float64 reference, gradients included."""

import sys

import pytest
import torch

from embfuse.ops.chain import (ACTIVATIONS, layer_norm_act, layer_norm_act_backward, layer_norm_act_forward,
                               layer_norm_act_reference)
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels

chain = sys.modules["embfuse.ops.chain"]

# the fp16/bf16 outputs round once at the store; their inputs are themselves rounded
CHAIN_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(B, N, D, dtype, device, affine, g):
    x = (torch.randn(B, N, D, generator=g) * 3 + 1).to(device, dtype)
    w = (torch.rand(N, D, generator=g) + 0.5).to(device, dtype) if affine else None
    b = (torch.randn(N, D, generator=g) * 0.5).to(device, dtype) if affine else None
    return x, w, b


def _double(t):
    return None if t is None else t.double()


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(5, 3, 1), (33, 2, 3), (7, 4, 64), (3, 2, 129)])
@pytest.mark.parametrize("affine", [True, False])
def test_kernels_against_float64(dtype, act, shape, affine):
    g = torch.Generator().manual_seed(sum(shape))
    x, w, b = _inputs(*shape, dtype, KERNEL_DEVICE, affine, g)
    y = layer_norm_act_forward(x, w, b, 1e-5, act)
    ref = layer_norm_act_reference(x.double(), _double(w), _double(b), 1e-5, act)
    rtol, atol = CHAIN_TOL[dtype]
    torch.testing.assert_close(y.double().cpu(), ref.cpu(), rtol=rtol, atol=atol)
    grad = torch.randn(shape, generator=g).to(KERNEL_DEVICE, dtype)
    dx, dw, db = layer_norm_act_backward(grad, x, w, b, 1e-5, act)
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = layer_norm_act_reference(leaves[0], leaves[1], leaves[2], 1e-5, act)
    expected = torch.autograd.grad(out, [t for t in leaves if t is not None], grad.double())
    got = [dx] + ([dw, db] if affine else [])
    for a, e in zip(got, expected):  # dw, db sum over the B samples
        torch.testing.assert_close(a.double().cpu(), e.cpu(), rtol=rtol, atol=atol * shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_op_and_its_gradients(device, act):
    g = torch.Generator().manual_seed(1)
    x, w, b = (t.requires_grad_() for t in _inputs(6, 3, 8, torch.float32, device, True, g))
    y = layer_norm_act(x, w, b, 1e-3, act)
    ref = layer_norm_act_reference(x.double(), w.double(), b.double(), 1e-3, act)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(y.square().sum(), (x, w, b))
    want = torch.autograd.grad(ref.square().sum(), (x, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), rtol=1e-4, atol=1e-5)
    B = torch.ops.embfuse.layer_norm_act
    torch.library.opcheck(B.default, (x.detach(), w.detach(), b.detach(), 1e-3, act))


def _refuse(*args, **kwargs):
    raise AssertionError("an eager call went through the registered op")


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_skip_the_op_dispatch_and_agree_with_the_op(device, monkeypatch):
    """Eager calls, recorded or not, run the op's body (recorded: in eager_autograd's Function):
    outputs and gradients bitwise the registered op's; gradcheck's batched gradients too."""
    g = torch.Generator().manual_seed(2)
    x, w, b = _inputs(6, 3, 8, torch.float64 if device == "cpu" else torch.float32, device, True, g)
    grad = torch.randn(x.shape, generator=g).to(device, x.dtype)
    leaves = [[t.clone().requires_grad_() for t in (x, w, b)] for _ in range(2)]
    ref = torch.ops.embfuse.layer_norm_act(*leaves[0], 1e-3, "tanh")
    ref.backward(grad)
    with monkeypatch.context() as m:
        m.setattr(chain, "_layer_norm_act_op", _refuse)
        m.setattr(chain, "_layer_norm_act_backward_op", _refuse)
        y = layer_norm_act(*leaves[1], 1e-3, "tanh")
        y.backward(grad)
        with torch.no_grad():
            assert torch.equal(layer_norm_act(x, w, b, 1e-3, "tanh"), ref)
    assert torch.equal(y, ref)
    for a, e in zip(leaves[1], leaves[0]):
        assert torch.equal(a.grad, e.grad)
    if device == "cpu":
        assert torch.autograd.gradcheck(lambda *t: layer_norm_act(*t, 1e-3, "tanh"), tuple(leaves[1]),
                                        check_batched_grad=True)


def test_bad_arguments():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="act must be"):
        layer_norm_act(x, act="gelu")
    with pytest.raises(ValueError, match=r"weight must be \(N, D\)"):
        layer_norm_act(x, torch.ones(3, 5))
    with pytest.raises(ValueError, match="x must be"):
        layer_norm_act(torch.randn(2, 12))
