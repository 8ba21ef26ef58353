"""Tracing support shared by the jagged classes: torch.fx's, and whether a tensor's values can
be read on the host."""

from typing import Optional

import torch
import torch.fx._symbolic_trace as _symbolic_trace
from torch._subclasses.fake_tensor import is_fake

from embfuse._triton import tracing


def host_data(t: torch.Tensor) -> bool:
    """Whether `t`'s values can be read on the host for free (construction checks): a CPU tensor
    outside any trace, and not a fake one (strict torch.export rebuilds its inputs from fake
    leaves outside any trace)."""
    return t.device.type == "cpu" and not tracing() and not is_fake(t)


def assert_counts(counts, fits) -> None:
    """A traced keyed batch's per-key `counts` may be data-dependent values read from its traced
    lengths: the graph asserts at run time that each is >= 0 and that they `fits` its values, which
    also keeps each key's slice inside them, as Inductor asks of a slice with data-dependent
    bounds. (No message: strict torch.export refuses a message function.)"""
    for count in counts:
        torch._check(count >= 0)
    torch._check(fits)


class Traceable(torch.fx.ProxyableClassMeta):
    """torch.fx's ProxyableClassMeta (an instance made from traced values is one node of the
    graph), asking whether fx traces only while it does: torch's own check logs a warning the
    first time any program asks, traced or not."""

    def __call__(cls, *args, **kwargs):
        if not _symbolic_trace._is_fx_tracing_flag:
            return type.__call__(cls, *args, **kwargs)
        return super().__call__(*args, **kwargs)


def kept(t: Optional[torch.Tensor], keep: torch.Tensor) -> Optional[torch.Tensor]:
    """t[keep], or None without t (one call when traced, torch.fx.wrap-ped where it is called:
    the weights may be None)."""
    return None if t is None else t[keep]
