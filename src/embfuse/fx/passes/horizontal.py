"""Horizontal fusion: `cat([f_0(x_0), ..., f_{N-1}(x_{N-1})], 1)`, where x_0 .. x_{N-1} are the
consecutive D-wide column blocks of one (B, N * D) tensor x (the pieces of `x.split(D, 1)`, or of
a batched lookup's output) and every f_i is the same chain of ops, becomes that chain applied
once to x viewed as (B, N, D), then viewed back as (B, N * D): no copy for the split, no cat,
one launch per op instead of N. Such a run may also be part of a larger cat (a dense part beside
it, or runs over several lookups' outputs, each fused on its own): the cat then takes the fused
output in the run's place. A run may cover part of a batched lookup's output too (features of
two widths in one lookup, a run a width): the chain then runs on those columns.

Chain ops (modules, functions or methods): LayerNorm over the last D (with or without a
per-feature affine: each feature's weight and bias are stacked to (N, D), so the original
parameters keep their names and get their gradients), tanh, sigmoid, relu, gelu, silu. Chains
match when their ops, eps and affine flags agree; anything else is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import embfuse.ops.chain as chain_module
from embfuse.fx.passes.lookups import CATS, LookupBatch
from embfuse.fx.views import RowView, hide_shown
from embfuse.ops.chain import ACTIVATIONS as KERNEL_ACTIVATIONS, layer_norm_act

ACTIVATIONS = {
    torch.nn.Tanh: "tanh", torch.nn.Sigmoid: "sigmoid", torch.nn.ReLU: "relu", torch.nn.SiLU: "silu",
    torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.relu: "relu", F.relu: "relu", F.tanh: "tanh",
    F.sigmoid: "sigmoid", F.silu: "silu", F.gelu: "gelu",
}
APPLY = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu, "gelu": F.gelu}


def _is_split(node) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target is torch.split)
        or (node.op == "call_method" and node.target == "split"))


def _op(gm: torch.fx.GraphModule, node: torch.fx.Node, D: int):
    """(kind, settings, per-feature parameters) of a chain node, or None when it is not a chain op."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if type(m) in ACTIVATIONS:
            return ACTIVATIONS[type(m)], (), ()
        if type(m) is torch.nn.GELU:
            return "gelu", (m.approximate,), ()
        if type(m) is torch.nn.LayerNorm and tuple(m.normalized_shape) == (D,):
            return "layer_norm", (m.eps, m.weight is not None, m.bias is not None), node.target
        return None
    if node.op == "call_method" and node.target in APPLY and len(node.args) == 1 and not node.kwargs:
        return node.target, (), ()
    if node.op == "call_function" and node.target in ACTIVATIONS:
        if node.target is F.gelu:
            return "gelu", (node.kwargs.get("approximate", "none"),), ()
        return ACTIVATIONS[node.target], (), ()
    if node.op == "call_function" and node.target is F.layer_norm:
        args = list(node.args) + [None] * (5 - len(node.args))
        shape = node.kwargs.get("normalized_shape", args[1])
        w, b = node.kwargs.get("weight", args[2]), node.kwargs.get("bias", args[3])
        eps = node.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
        if not isinstance(shape, (list, tuple)) or tuple(shape) != (D,) or not isinstance(eps, float) or any(
                p is not None and not isinstance(p, torch.fx.Node) for p in (w, b)):
            return None
        return "layer_norm", (eps, w is not None, b is not None), (w, b)
    return None


def _chain(gm, end: torch.fx.Node, D: int):
    """Walk back from `end` through single-use chain ops: (root, [op, ...] in order) or None."""
    ops, node = [], end
    while (op := _op(gm, node, D)) is not None:
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        ops.append(op)
        node = node.args[0]
        if len(node.users) != 1:
            break
    return node, ops[::-1]


def _blocks(roots: list[torch.fx.Node]):
    """(x, D, start) when `roots` are x's consecutive D-wide column blocks: covering x whole
    (start None), or, in a batched lookup's output of known width, the columns from `start` on.
    None otherwise."""
    first = roots[0]
    if first.op == "call_function" and first.target is operator.getitem:
        split = first.args[0]
        if not _is_split(split):
            return None
        size = split.kwargs.get("split_size_or_sections", split.kwargs.get("split_size"))
        x, size = split.args[0], split.args[1] if len(split.args) > 1 else size
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim not in (1, -1) or not isinstance(size, int):
            return None
        if [r.args for r in roots] != [(split, k) for k in range(len(roots))]:
            return None
        if len([u for u in split.users]) != len(roots):
            return None
        return x, size, None
    if first.op == "call_function" and first.target is torch.narrow:
        x, start, D = first.args[0], first.args[2], first.args[3]
        if [r.args for r in roots] != [(x, 1, start + k * D, D) for k in range(len(roots))]:
            return None
        width = x.meta.get("embfuse_width")  # (set by the lookup pass on its outputs)
        if width is None or start + D * len(roots) > width:
            return None
        return x, D, None if width == D * len(roots) else start
    return None


def as_blocks(x: torch.Tensor, N: int, D: int) -> torch.Tensor:
    """x (B, N * D) viewed as (B, N, D): the N column blocks side by side."""
    if x.dim() != 2 or x.shape[1] != N * D:
        raise ValueError(f"fused chains expect a (B, {N * D}) input ({N} blocks of {D}), got {tuple(x.shape)}")
    return x.reshape(x.shape[0], N, D)


def _one_op(ops):
    """(eps, activation) when a chain is LayerNorm, then at most one of tanh / sigmoid / relu:
    one embfuse.ops.chain kernel (one read, one write) instead of a pass an op."""
    kinds = [k for k, _ in ops]
    if kinds[:1] == ["layer_norm"] and len(kinds) <= 2 and set(kinds[1:]) <= set(KERNEL_ACTIVATIONS[1:]):
        return ops[0][1][0], kinds[1] if len(kinds) == 2 else "none"
    return None


class FusedChain(torch.nn.Module):
    """N features' chains as one: forward(x (B, N * D)) applies `ops` to x viewed as (B, N, D)
    (LayerNorm + one activation: the fused kernel of embfuse.ops.chain).
    A LayerNorm op k owns `weight_k` / `bias_k` (N, D): its N modules' affines stacked (copies);
    RowViews at the modules' paths show their rows under the original names and keys."""

    def __init__(self, N: int, D: int, ops, norms: dict[int, list[str]], root: torch.nn.Module):
        super().__init__()
        self.N, self.D, self.ops, self.norms = N, D, list(ops), dict(norms)
        for k, paths in self.norms.items():
            modules = [root.get_submodule(p) for p in paths]
            for kind in ("weight", "bias"):
                if getattr(modules[0], kind) is not None:
                    stacked = torch.stack([getattr(m, kind).detach() for m in modules]).clone()
                    self.register_parameter(f"{kind}_{k}", torch.nn.Parameter(stacked))
        hide_shown(self)

    def _shown(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters(recurse=False))

    def embfuse_views(self):
        return [(path, RowView(self, k, i)) for k, paths in self.norms.items() for i, path in enumerate(paths)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K = range(len(self.ops))
        return run_ops(as_blocks(x, self.N, self.D), self.ops, [getattr(self, f"weight_{k}", None) for k in K],
                       [getattr(self, f"bias_{k}", None) for k in K]).flatten(1)


def run_ops(y: torch.Tensor, ops, weights, biases) -> torch.Tensor:
    """The chain `ops` [(kind, settings)] on y (B, N, D); weights[k] / biases[k]: LayerNorm op k's
    (N, D) affines (or None). LayerNorm + at most one activation is one embfuse.ops.chain kernel."""
    one = _one_op(ops)
    if one is not None:
        return layer_norm_act(y, weights[0], biases[0], *one)
    for (kind, settings), weight, bias in zip(ops, weights, biases):
        if kind == "layer_norm":
            y = F.layer_norm(y, y.shape[-1:], None, None, settings[0])
            if weight is not None:
                y = torch.addcmul(bias, y, weight) if bias is not None else y * weight
            elif bias is not None:
                y = y + bias
        elif kind == "gelu":
            y = F.gelu(y, approximate=settings[0])
        else:
            y = APPLY[kind](y)
    return y


class PooledChain(torch.nn.Module):
    """A LookupBatch whose whole output goes through a FusedChain of LayerNorm + one activation:
    under autograd the two as they are; for inference one kernel (the chain in the pooling
    kernel's epilogue: EmbeddingBagCollection.forward_layer_norm)."""

    def __init__(self, batch: LookupBatch, chain: "FusedChain"):
        super().__init__()
        self.batch, self.chain = batch, chain

    def embfuse_views(self):
        return []  # (its two modules show their own)

    def forward(self, ids: tuple, offsets: tuple, weights: tuple) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.chain(self.batch(ids, offsets, weights))
        return self._epilogue(self.batch.features(ids, offsets, weights))

    def lookup_staged(self, values, offsets, weights, B: int) -> torch.Tensor:
        """forward for a batch staged on the device (LookupBatch.lookup_staged)."""
        if torch.is_grad_enabled():
            return self.chain(self.batch.lookup_staged(values, offsets, weights, B))
        return self._epilogue(self.batch.staged_features(values, offsets, weights, B))

    def _epilogue(self, kjt) -> torch.Tensor:
        eps, act = _one_op(self.chain.ops)
        return self.batch.collection.forward_layer_norm(kjt, getattr(self.chain, "weight_0", None),
                                                        getattr(self.chain, "bias_0", None), eps, act)


def _into_the_lookup(gm: torch.fx.GraphModule, out: torch.fx.Node, x: torch.fx.Node, report: list[str]) -> None:
    """`out = chain(x)`, x a LookupBatch call used by nothing else: both become one PooledChain."""
    if out.op != "call_module" or x.op != "call_module" or len(x.users) != 1:
        return
    batch, chain = gm.get_submodule(x.target), gm.get_submodule(out.target)
    if not isinstance(batch, LookupBatch) or not isinstance(chain, FusedChain) or _one_op(chain.ops) is None:
        return
    name = f"embfuse_pooled_{sum(isinstance(m, PooledChain) for m in gm.modules())}"
    gm.add_submodule(name, PooledChain(batch, chain))
    with gm.graph.inserting_before(out):
        merged = gm.graph.call_module(name, x.args)
    out.replace_all_uses_with(merged)
    gm.graph.erase_node(out)
    gm.graph.erase_node(x)
    for target in (out.target, x.target):  # (top-level names: the PooledChain holds them now)
        delattr(gm, target)
    report.append(f"fused the chain into {x.target}'s pooling kernel for inference ({name})")


def fuse_horizontal(gm: torch.fx.GraphModule, report: list[str] | None = None) -> torch.fx.GraphModule:
    """Rewrite every matching run of chains in a cat of `gm` (module docstring): a cat of the
    fused chains alone becomes the fused output; other arguments (a dense part, chains over
    another lookup's blocks) stay in the cat beside it. Returns `gm`, recompiled."""
    report = [] if report is None else report
    graph = gm.graph
    for cat in [n for n in graph.nodes if n.op == "call_function" and n.target in CATS]:
        tensors = cat.args[0] if cat.args else cat.kwargs.get("tensors")
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if dim not in (1, -1) or not isinstance(tensors, (list, tuple)) or len(tensors) < 2:
            continue
        runs = _runs(gm, tensors)
        if not runs:
            continue
        parts, fused = list(tensors), []
        for first, last, chains, (x, D, start) in reversed(runs):  # (from the back: earlier indices hold)
            out, x = _fuse(gm, cat, chains, x, D, start)
            parts[first:last] = [out]
            fused.append((out, x, D, tensors[first:last], chains))
        if len(parts) == 1:
            cat.replace_all_uses_with(parts[0])
            graph.erase_node(cat)
        elif cat.args:
            cat.update_arg(0, parts)
        else:
            cat.update_kwarg("tensors", parts)
        for out, x, D, ends, chains in reversed(fused):
            for node in [n for c, t in zip(chains, ends) for n in _nodes_between(t, c[0])]:
                graph.erase_node(node)
            roots = [c[0] for c in chains]
            splits = {r.args[0] for r in roots if r.target is operator.getitem}
            for node in roots + list(splits):
                if not node.users:
                    graph.erase_node(node)
            N = len(chains)
            report.append(f"fused {N} chains of {' -> '.join(k for k, _, _ in chains[0][1])} over {N} x {D} "
                          f"into one")
            _into_the_lookup(gm, out, x, report)
    split_nodes = [n for n in graph.nodes if _is_split(n) and not n.users]
    for n in split_nodes:
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm


def _runs(gm, tensors) -> list:
    """(first, last, chains, blocks) of each run tensors[first:last] (two or more) that is one
    chain of ops over consecutive blocks of one tensor (blocks: _blocks' (x, D, start))."""
    found, k = [], 0
    while k < len(tensors):
        D = _width(tensors[k]) if _single(tensors[k]) else None
        chain = _chain(gm, tensors[k], D) if D else None
        if chain is None or not chain[1]:
            k += 1
            continue
        source = chain[0].args[:1]  # (the split, or the narrowed tensor)
        run = [chain]
        while k + len(run) < len(tensors):
            c = _chain(gm, tensors[k + len(run)], D) if _single(tensors[k + len(run)]) else None
            if c is None or not c[1] or c[0].args[:1] != source:
                break
            run.append(c)
        kinds = {tuple((kind, settings) for kind, settings, _ in c[1]) for c in run}
        blocks = _blocks([c[0] for c in run]) if len(run) > 1 else None
        if len(kinds) == 1 and blocks is not None and blocks[1] == D:
            found.append((k, k + len(run), run, blocks))
        k += len(run)
    return found


def _single(t) -> bool:
    return isinstance(t, torch.fx.Node) and len(t.users) == 1


def _fuse(gm: torch.fx.GraphModule, cat: torch.fx.Node, chains, x, D: int, start) -> tuple:
    """One run's chains as one op on their blocks' tensor x (B, N * D; a narrow of the lookup's
    output from column `start` when the run covers part of it), inserted before `cat`: (its
    output, the tensor it reads)."""
    graph = gm.graph
    N = len(chains)
    ops = [(kind, settings) for kind, settings, _ in chains[0][1]]
    sources = [[c[1][k][2] for c in chains] for k in range(len(ops))]
    with graph.inserting_before(cat):
        if start is not None:  # the run's columns of a wider lookup output (a view)
            x = graph.call_function(torch.narrow, (x, 1, start, N * D))
        if all(isinstance(p[0], str) for (kind, _), p in zip(ops, sources) if kind == "layer_norm"):
            # LayerNorm modules only: one module owns the stacked affines (fewer launches and
            # gradient accumulations than a stack of the originals at every call)
            name = f"embfuse_chain_{sum(isinstance(m, FusedChain) for m in gm.modules())}"
            gm.add_submodule(name, FusedChain(N, D, ops, {k: p for k, ((kind, _), p) in enumerate(zip(ops, sources))
                                                          if kind == "layer_norm"}, gm))
            return graph.call_module(name, (x,)), x
        y = graph.call_function(as_blocks, (x, N, D))
        affines = [_stacks(graph, settings, params) if kind == "layer_norm" else (None, None)
                   for (kind, settings), params in zip(ops, sources)]
        y = graph.call_function(run_ops, (y, tuple(ops), [w for w, _ in affines], [b for _, b in affines]))
        return graph.call_function(torch.flatten, (y, 1)), x


def _width(node: torch.fx.Node) -> int | None:
    """The feature width D of a chain's end, from its root block (split size or narrow length)."""
    while node is not None:
        if node.op == "call_function" and node.target is torch.narrow:
            return node.args[3]
        if node.op == "call_function" and node.target is operator.getitem:
            split = node.args[0]
            if _is_split(split):
                size = split.args[1] if len(split.args) > 1 else None
                return size if isinstance(size, int) else None
            return None
        node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return None


def _nodes_between(end: torch.fx.Node, root: torch.fx.Node) -> list[torch.fx.Node]:
    """The chain's nodes from `end` back to (not including) `root`, users first."""
    out = []
    while end is not root:
        out.append(end)
        end = end.args[0]
    return out


def _stacks(graph: torch.fx.Graph, settings, params):
    """The (N, D) stacks of a LayerNorm op's per-feature weights and biases (None without)."""
    _, has_weight, has_bias = settings
    pairs = [(graph.get_attr(f"{p}.weight") if has_weight else None, graph.get_attr(f"{p}.bias") if has_bias else None)
             if isinstance(p, str) else p for p in params]  # (a module's path, or the functional call's nodes)
    weight = graph.call_function(torch.stack, ([w for w, _ in pairs],)) if has_weight else None
    bias = graph.call_function(torch.stack, ([b for _, b in pairs],)) if has_bias else None
    return weight, bias


class HorizontalFusion(CustomGraphPass):
    """fuse_horizontal as an Inductor pre-grad pass, for torch.compile users:

        torch._inductor.config.pre_grad_custom_pass = embfuse.fx.passes.HorizontalFusion()

    Pre-grad graphs hold torch functions (modules inlined, parameters as inputs), so the chains
    there are functional LayerNorms and activations: they become one `embfuse::layer_norm_act`
    op (or the batched torch ops) on the (B, N, D) view. `fused` counts the rewrites."""

    def __init__(self):
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        report: list[str] = []
        fuse_horizontal(graph.owning_module, report)
        self.fused += len(report)

    def uuid(self):
        return get_hash_for_files((__file__, chain_module.__file__))
