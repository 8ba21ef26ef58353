"""`embfuse.fx.optimize(model)`: an eager recommendation model rewritten into its fast form.

The model is traced with torch.fx (`example_inputs` lets lists and dicts of tensors become one
input each), then the passes run in this order:
1. lookups (passes/lookups.py): nn.EmbeddingBag calls -> one collection lookup per group;
2. horizontal (passes/horizontal.py): split -> per-feature chain -> cat -> one op on (B, N, D);
3. copies (passes/copies.py): the remaining per-tensor `.to(device)` -> one combined copy.
The result is a GraphModule with the model's call signature, outputs and gradients, and its
state_dict keys and shapes. It owns its parameters (copies of the model's at the time of the
call); the model itself is not changed.

What cannot be traced, or has nothing to rewrite, is refused: a warning names the construct and
the model comes back unchanged. `fast.embfuse_report` lists what each pass did and left.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Sequence

import torch
import torch.fx
from torch.fx._symbolic_trace import PH
from torch.utils import _pytree as pytree

from embfuse.fx.passes.copies import combine_copies
from embfuse.fx.passes.horizontal import fuse_horizontal
from embfuse.fx.passes.lookups import batch_lookups
from embfuse.fx.views import restore_names

PASSES = ("lookups", "horizontal", "copies")


class Tracer(torch.fx.Tracer):
    """torch.fx's tracer with embfuse's modules kept whole (as torch.nn's are) and, given example
    inputs, each node's value computed alongside (no grad): then `len()` of a proxy and iteration
    over it (the pieces of a split, zip over a list input) follow the example. Branches on data
    (`if x.sum() > 0`) still fail, as they must: the graph would bake in one side."""

    def __init__(self, examples: list | None = None):
        super().__init__()
        self._examples = None if examples is None else list(examples)
        self.values: dict[torch.fx.Node, object] = {}

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return type(m).__module__.startswith("embfuse.") or super().is_leaf_module(m, qualname)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _ValueProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self._examples is not None and isinstance(proxy, torch.fx.Proxy):
            self._plain_attrs = True  # (module attributes as they are, not as proxies)
            try:
                with torch.no_grad():
                    self.values[proxy.node] = self._run(kind, target, args, kwargs)
            except Exception:  # no value: len() and iteration over this node fail as in torch.fx
                pass
            finally:
                self._plain_attrs = False
        return proxy

    def _run(self, kind, target, args, kwargs):
        if kind == "placeholder":
            return self._examples.pop(0)
        if kind == "get_attr":
            return self._attr(target)
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), self._value)
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            return self._forward(*args, **kwargs)
        raise KeyError(kind)

    def call_module(self, m, forward, args, kwargs):
        self._forward = forward
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if getattr(self, "_plain_attrs", False):
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _attr(self, target: str):
        value = self.root
        for atom in target.split("."):
            value = getattr(value, atom)
        return value

    def _value(self, a):
        if not isinstance(a, torch.fx.Proxy):
            return a
        if a.node not in self.values and a.node.op == "get_attr":  # (made by create_node, not create_proxy)
            self.values[a.node] = self._attr(a.node.target)
        value = self.values[a.node]
        if isinstance(value, torch.fx.Proxy):
            raise KeyError(a.node)
        return value

    def iter(self, obj: torch.fx.Proxy):
        value = self.values.get(obj.node)
        if isinstance(value, (tuple, list)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)


class _ValueProxy(torch.fx.Proxy):
    def __len__(self):
        value = self.tracer.values.get(self.node)
        if isinstance(value, (tuple, list, torch.Size)):
            return len(value)
        return super().__len__()


def trace(model: torch.nn.Module, example_inputs: Sequence | None = None) -> torch.fx.GraphModule:
    """`model` as a GraphModule. With `example_inputs` (the forward's positional arguments), every
    tensor inside a list, tuple or dict argument becomes its own graph input (the containers'
    lengths and keys are fixed to those of the example), the GraphModule takes the same
    arguments, and the trace follows the example where torch.fx alone cannot (Tracer)."""
    concrete, examples = None, None
    if example_inputs is not None:
        params = list(inspect.signature(model.forward).parameters)
        concrete, examples = {}, []
        for name, value in zip(params, example_inputs):
            if isinstance(value, (list, tuple, dict)):
                concrete[name] = pytree.tree_map(lambda v: PH if isinstance(v, torch.Tensor) else v, value)
                examples += [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
            else:
                examples.append(value)
    graph = Tracer(examples).trace(model, concrete_args=concrete or None)
    gm = torch.fx.GraphModule(model, graph, type(model).__name__)
    gm.train(model.training)
    return gm


def optimize(model: torch.nn.Module, example_inputs: Sequence | None = None, *, optimizer=None,
             passes: Sequence[str] = PASSES) -> torch.nn.Module:
    """`model` rewritten by `passes` (module docstring). `optimizer` (an embfuse.optim rule): the
    batched tables update their touched rows inside the backward (their `weight.grad` stays
    None, so a torch optimizer over `fast.parameters()` trains the rest)."""
    unknown = set(passes) - set(PASSES)
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)}; the passes are {PASSES}")
    report: list[str] = []
    try:
        gm = trace(model, example_inputs)
        if "lookups" in passes:
            batch_lookups(gm, optimizer, report)
        if "horizontal" in passes:
            fuse_horizontal(gm, report)
        if "copies" in passes:
            combine_copies(gm, report)
    except Exception as e:  # what torch.fx cannot trace, or a construct a pass does not know
        warnings.warn(f"embfuse.fx.optimize: {type(model).__name__} is returned unchanged: {type(e).__name__}: {e}",
                      stacklevel=2)
        return model
    done = [line for line in report if not line.startswith("left ")]
    if not done:
        why = "; ".join(report) or "no nn.EmbeddingBag lookups, fusable chains or device copies were found"
        warnings.warn(f"embfuse.fx.optimize: nothing to rewrite in {type(model).__name__} ({why}); it is "
                      f"returned unchanged", stacklevel=2)
        return model
    _own(gm)
    restore_names(gm)
    gm.embfuse_report = report
    return gm


def _own(module: torch.nn.Module, memo: dict | None = None) -> None:
    """Give the GraphModule its own copies of the model's modules and tensors. torch.fx shares
    them: its intermediate containers are fresh plain Modules, its leaves the model's objects."""
    memo = {} if memo is None else memo
    for store in (module._parameters, module._buffers):
        for name, t in list(store.items()):
            if t is not None:
                store[name] = copy.deepcopy(t, memo)
    for name, child in list(module.named_children()):
        if hasattr(child, "embfuse_views"):  # made by a pass: already its own
            continue
        if type(child) is torch.nn.Module:
            _own(child, memo)
        else:
            setattr(module, name, copy.deepcopy(child, memo))
