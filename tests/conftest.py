"""One suite for both machines: without CUDA the Triton kernels run under TRITON_INTERPRET=1
on CPU tensors (small shapes); with CUDA they run on the GPU. Tests marked `gpu` need CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before embfuse defines its kernels

import embfuse._triton as _t  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# where the kernels run: the GPU, or the interpreter on the CPU
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_kernels = pytest.mark.skipif(not (_t.HAS_TRITON and (torch.cuda.is_available() or _t.interpreting())),
                                      reason="needs Triton (GPU or interpreter)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    # run on the GPU machine (the same command); without CUDA there is nothing they could test
    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # a deferred error a failing test left unreported must not surface in the next test
    from embfuse.ops.deferred import _LOGS

    for log in _LOGS.values():
        log.pending.clear()
        log.graph_checks.clear()


@pytest.fixture
def pooling_warps(monkeypatch) -> list:
    """The num_warps of every pooling launch shape chosen during the test (tuning.pooling_shape)."""
    from embfuse.ops import tuning

    chosen, shape = [], tuning.pooling_shape

    def spy(*args, **kwargs):
        cfg = shape(*args, **kwargs)
        chosen.append(cfg["num_warps"])
        return cfg

    monkeypatch.setattr(tuning, "pooling_shape", spy)
    return chosen
