"""The overlap pass: each sharded collection's call becomes a request and a wait, so that the
ops that do not need its result run while its all-to-alls are in flight.

A traced call `out = sparse(kjt)` becomes three nodes (ShardedEmbeddingBagCollection's stages):
    incoming = sparse.input_dist(kjt)        # route, headers, start the ids' all-to-alls
    sent = sparse.lookup_and_send(incoming)  # wait for them, look up, start the pooled rows' all-to-all
    out = sparse.output_wait(sent)           # wait for them, assemble
scheduled by these rules:
- the request goes as early as its inputs allow (right after the last node it reads);
- the wait goes as late as its first use (right before the first node that reads `out`; the
  accessors of its KeyedTensor, `.values()`, `["feature"]`, `.to_dict()`, move down with it);
- the middle stage goes halfway (by node count) between the two, so the ops that are
  independent of the lookup are split between the two exchanges they can hide.
Every other node keeps its order, and no node moves before an input: the graph computes what
the original computes, in the same order per data path (so results are bitwise the same).

Under torch.compile the three stages stay where the pass put them and run eagerly (they read the
exchange's sizes on the host and hold in-flight work handles); the ops between them compile. The
collectives are torch.distributed's asynchronous ones, not functional collectives inside the
graphs: see benchmarks/NOTES.md, session 18.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from embfuse.distributed.sharded import ShardedEmbeddingBagCollection


class ShardedTracer(torch.fx.Tracer):
    """symbolic_trace with sharded collections kept whole (their forward reads the host)."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, ShardedEmbeddingBagCollection) or super().is_leaf_module(m, qualname)


def trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    """`model` as a GraphModule whose sharded collections are single call_module nodes."""
    graph = ShardedTracer().trace(model)
    return torch.fx.GraphModule(model, graph, type(model).__name__)


# under torch.compile each stage runs eagerly where the pass put it, the ops between two stages
# compiled: the stages read the host (the exchange's sizes) and hold in-flight work handles
@torch.compiler.disable
def _input_dist(module, kjt):
    return module.input_dist(kjt)


@torch.compiler.disable
def _lookup_and_send(module, incoming):
    return module.lookup_and_send(incoming)


@torch.compiler.disable
def _output_wait(module, sent):
    return module.output_wait(sent)


STAGES = (_input_dist, _lookup_and_send, _output_wait)


def split_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite every sharded collection's call in `gm` as request / lookup / wait, scheduled as the
    module docstring says. Returns `gm`, recompiled."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), ShardedEmbeddingBagCollection):
            continue
        if len(node.args) != 1 or node.kwargs:
            raise ValueError(f"{node.target}: a sharded collection takes one KeyedJaggedTensor, got "
                             f"args={node.args} kwargs={node.kwargs}")
        with graph.inserting_before(node):
            module = graph.get_attr(node.target)
            request = graph.call_function(_input_dist, (module, node.args[0]))
            middle = graph.call_function(_lookup_and_send, (module, request))
            wait = graph.call_function(_output_wait, (module, middle))
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        _schedule(graph, module, request, middle, wait)
    graph.lint()
    gm.recompile()
    return gm


def _schedule(graph: torch.fx.Graph, module, request, middle, wait) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the request (and the module it reads) right after the last node the request reads
    last_input = max((a for a in request.args[1:] if isinstance(a, torch.fx.Node)), key=order.__getitem__,
                     default=None)
    anchor = last_input if last_input is not None else next(n for n in graph.nodes if n.op != "placeholder")
    if last_input is not None:
        anchor.append(module)
    else:
        anchor.prepend(module)
    module.append(request)
    # the wait right before its first real use: accessors of its KeyedTensor (values(),
    # ["feature"], to_dict()) sink with it, each right before its own first user
    chain, todo = [wait], [wait]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_method" or (user.op == "call_function" and user.target is operator.getitem):
                if user not in chain:
                    chain.append(user)
                    todo.append(user)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(chain, key=order.__getitem__, reverse=True):
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_use = min(node.users, key=order.__getitem__, default=None)
        (first_use if first_use is not None else graph.output_node()).prepend(node)
    # the lookup halfway between the request and the wait
    order = {n: i for i, n in enumerate(graph.nodes)}
    between = [n for n in graph.nodes if order[request] < order[n] < order[wait] and n is not middle]
    if between:
        between[(len(between) - 1) // 2].append(middle)
    else:
        wait.prepend(middle)


def overlap_collectives(model: torch.nn.Module) -> torch.fx.GraphModule:
    """`model` traced (ShardedTracer) with the overlap pass applied: same call signature, same
    parameters and sharded collections (shared, not copied), same results."""
    return split_collectives(trace(model))


__all__ = ["ShardedTracer", "STAGES", "overlap_collectives", "split_collectives", "trace"]
