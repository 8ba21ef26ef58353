"""The overlap pass: each sharded collection's call becomes a request and a wait, so that the
ops that do not need its result run while its all-to-alls are in flight.

A traced call `out = sparse(kjt)` becomes four nodes (ShardedEmbeddingBagCollection's stages):
    incoming = sparse.input_dist(kjt)        # route, headers, start the ids' all-to-alls
    pooled = sparse.pooled(incoming)         # wait for them, look up
    sent = sparse.send(pooled, incoming)     # start the pooled rows' all-to-all
    out = sparse.output_wait(sent)           # wait for them, assemble
scheduled by these rules:
- the request goes as early as its inputs allow (right after the last node it reads);
- the wait goes as late as its first use (right before the first node that reads `out`; the
  accessors of its KeyedTensor, `.values()`, `["feature"]`, `.to_dict()`, move down with it);
- the lookup goes halfway (by node count) between the two, the send right after it, so the ops
  that are independent of the lookup are split between the two exchanges they can hide.
Every other node keeps its order, and no node moves before an input: the graph computes what
the original computes, in the same order per data path (so results are bitwise the same).

Under torch.compile the four stages run eagerly where the pass put them, with the ops between
them compiled: the request and the lookup read the exchange's sizes on the host, and the eager
send and wait keep the pooled rows' all-to-all in flight across the compiled ops between them
(torch.distributed's asynchronous all-to-all). `functional=True` traces the send and the wait
into the compiled region after the lookup instead, the all-to-all as a functional collective
(torch.distributed._functional_collectives), and Inductor places its wait. Its default places the
wait right after the send; with `torch._inductor.config.reorder_for_compute_comm_overlap = True`
and the "sink_waits" pass, the compiled ops that do not read the pooled rows run before it (both
read from Inductor's generated code, torch 2.13 on gloo). Hence the eager pair by default.
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


# under torch.compile the request and the lookup run eagerly where the pass put them (they read
# the host and hold in-flight work handles); the send and the wait too, unless `functional`
@torch.compiler.disable
def _input_dist(module, kjt):
    return module.input_dist(kjt)


@torch.compiler.disable
def _pooled(module, incoming):
    return module.pooled(incoming)


def _send_traced(module, pooled, incoming):
    return module.send(pooled, incoming)


def _output_wait_traced(module, sent):
    return module.output_wait(sent)


_send = torch.compiler.disable(_send_traced)
_output_wait = torch.compiler.disable(_output_wait_traced)
STAGES = (_input_dist, _pooled, _send, _output_wait)
FUNCTIONAL_STAGES = (_input_dist, _pooled, _send_traced, _output_wait_traced)


def split_collectives(gm: torch.fx.GraphModule, functional: bool = False) -> torch.fx.GraphModule:
    """Rewrite every sharded collection's call in `gm` as request / lookup / send / wait, scheduled
    as the module docstring says (`functional`: the send and the wait traced by torch.compile).
    Returns `gm`, recompiled."""
    request_f, pooled_f, send_f, wait_f = FUNCTIONAL_STAGES if functional else STAGES
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), ShardedEmbeddingBagCollection):
            continue
        if len(node.args) != 1 or node.kwargs:
            raise ValueError(f"{node.target}: a sharded collection takes one KeyedJaggedTensor, got "
                             f"args={node.args} kwargs={node.kwargs}")
        with graph.inserting_before(node):
            module = graph.get_attr(node.target)
            request = graph.call_function(request_f, (module, node.args[0]))
            middle = graph.call_function(pooled_f, (module, request))
            send = graph.call_function(send_f, (module, middle, request))
            wait = graph.call_function(wait_f, (module, send))
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        _schedule(graph, module, request, middle, send, wait)
    graph.lint()
    gm.recompile()
    return gm


def _schedule(graph: torch.fx.Graph, module, request, middle, send, wait) -> None:
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
    # the lookup halfway between the request and the wait, the send right after it
    order = {n: i for i, n in enumerate(graph.nodes)}
    between = [n for n in graph.nodes if order[request] < order[n] < order[wait] and n not in (middle, send)]
    if between:
        between[(len(between) - 1) // 2].append(middle)
    else:
        wait.prepend(middle)
    middle.append(send)


def overlap_collectives(model: torch.nn.Module, functional: bool = False) -> torch.fx.GraphModule:
    """`model` traced (ShardedTracer) with the overlap pass applied: same call signature, same
    parameters and sharded collections (shared, not copied), same results. `functional`: under
    torch.compile the pooled rows' all-to-all is a functional collective of the compiled graph
    (module docstring)."""
    return split_collectives(trace(model), functional)


__all__ = ["FUNCTIONAL_STAGES", "ShardedTracer", "STAGES", "overlap_collectives", "split_collectives", "trace"]
