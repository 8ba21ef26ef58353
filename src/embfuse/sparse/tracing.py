"""torch.fx support shared by the jagged classes."""

import torch
import torch.fx._symbolic_trace as _symbolic_trace


class Traceable(torch.fx.ProxyableClassMeta):
    """torch.fx's ProxyableClassMeta (an instance made from traced values is one node of the
    graph), asking whether fx traces only while it does: torch's own check logs a warning the
    first time any program asks, traced or not."""

    def __call__(cls, *args, **kwargs):
        if not _symbolic_trace._is_fx_tracing_flag:
            return type.__call__(cls, *args, **kwargs)
        return super().__call__(*args, **kwargs)
