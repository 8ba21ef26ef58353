"""Combine input copies: the `x.to(device)` / `x.cuda()` calls of one forward become one
`copy_to_device` call (a single move too: from pinned memory the host need not wait for the
GPU) (fx/staging.py: one pinned buffer, one non-blocking copy, device views).

A move joins when its target is a device the pass can see: a constant ("cuda", torch.device) or
`tensor.device`. Moves to the same device whose inputs all exist before the first of them
become one call; tensors that are already on the device, or require grad, are moved as before.
"""

from __future__ import annotations

import builtins
import operator

import torch
import torch.fx

from embfuse.fx.staging import copy_to_device

MOVE_KWARGS = {"non_blocking", "copy"}


def _device_arg(node: torch.fx.Node):
    """The device a move node targets, or None when it is not a plain device move."""
    if node.op != "call_method" or node.target not in ("to", "cuda") or not isinstance(node.args[0], torch.fx.Node):
        return None
    if set(node.kwargs) - MOVE_KWARGS - {"device"}:
        return None
    rest = node.args[1:]
    if node.target == "cuda":
        if len(rest) > 1:
            return None
        return rest[0] if rest else node.kwargs.get("device", "cuda")
    if len(rest) > 1 or (rest and "device" in node.kwargs):
        return None
    device = rest[0] if rest else node.kwargs.get("device")
    if isinstance(device, (str, torch.device)):
        return device
    if (isinstance(device, torch.fx.Node) and device.op == "call_function" and device.target is builtins.getattr
            and device.args[1:] == ("device",)):
        return device
    return None


def combine_copies(gm: torch.fx.GraphModule, report: list[str] | None = None) -> torch.fx.GraphModule:
    """Rewrite `gm`'s device moves as combined copies (module docstring). Returns `gm`, recompiled."""
    report = [] if report is None else report
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[object, list[list[torch.fx.Node]]] = {}
    for node in list(graph.nodes):
        device = _device_arg(node)
        if device is None:
            continue
        key = device if isinstance(device, torch.fx.Node) else str(torch.device(device))
        runs = groups.setdefault(key, [[]])
        if runs[-1] and any(order[a] >= order[runs[-1][0]] for a in node.all_input_nodes):
            runs.append([])
        runs[-1].append(node)
    for runs in groups.values():
        for run in runs:
            with graph.inserting_before(run[0]):
                both = graph.call_function(copy_to_device, (tuple(n.args[0] for n in run), _device_arg(run[0])))
            for j, node in enumerate(run):
                with graph.inserting_after(both):
                    part = graph.call_function(operator.getitem, (both, j))
                node.replace_all_uses_with(part)
                graph.erase_node(node)
            report.append(f"combined {len(run)} host-to-device copies into one" if len(run) > 1 else
                          "moved 1 host tensor through pinned memory (no wait for the GPU)")
    graph.lint()
    gm.recompile()
    return gm
