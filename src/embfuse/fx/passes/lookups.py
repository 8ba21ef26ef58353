"""Batch the lookups: the N `torch.nn.EmbeddingBag` calls of one forward become one embfuse
collection lookup (one check pass, one pooling launch, one fused backward), and the plain
`torch.nn.Embedding` calls of one width one EmbeddingCollection lookup (EmbeddingBatch).

A call is batched when its module is a plain `nn.EmbeddingBag` with sum or mean pooling and no
max_norm, padding_idx, scale_grad_by_freq or include_last_offset (per_sample_weights with sum
only, as torch requires). Calls that share a table dtype and device, and whose inputs exist
before any of their outputs is used, form one `LookupBatch`; each call's output becomes a column
slice of the batch's (B, sum of widths) output, and a `torch.cat` of all of them, in order,
becomes the output itself. Calls left alone are listed, with the reason, in the report.

Inputs: a call's ids, offsets and weights may be host tensors moved by `.to(device)` (or
`.cuda()`) in the model; the pass then hands the host tensors to the batch, which writes every
feature into one pinned buffer on the host (global offsets and all) and copies it once.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx
from torch import Tensor

from embfuse._handles import join_names, split_names
from embfuse._triton import tracing
from embfuse.fx.staging import Staging, copy_all, copy_to_device, end_to_end
from embfuse.fx.views import TableView, hide_shown
from embfuse.nn.collection import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from embfuse.ops.errors import BadBatchError
from embfuse.sparse.jagged import KeyedJaggedTensor
from embfuse.sparse.padded import PaddedKeyedJaggedTensor

MOVES = ("to", "cuda")
CATS = (torch.cat, torch.concat, torch.concatenate)


def unbatchable(m: torch.nn.Module) -> str | None:
    """Why the lookup of `m` (an nn.EmbeddingBag or nn.Embedding) cannot join a collection, or
    None when it can."""
    bag = isinstance(m, torch.nn.EmbeddingBag)
    kind = torch.nn.EmbeddingBag if bag else torch.nn.Embedding
    if type(m) is not kind:
        return f"{type(m).__name__} is not a plain torch.nn.{kind.__name__}"
    options = [("max_norm", m.max_norm is None), ("padding_idx", m.padding_idx is None),
               ("scale_grad_by_freq", not m.scale_grad_by_freq)]
    if bag:
        options = [("mode", m.mode in ("sum", "mean"))] + options + [("include_last_offset", not m.include_last_offset)]
    for name, ok in options:
        if not ok:
            why = " (a collection pools sum or mean only)" if bag else ""
            return f"{name}={getattr(m, name)!r} is not batched{why}"
    if m.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"a {m.weight.dtype} table is not batched"
    return None


class _Batch(torch.nn.Module):
    """What both batches share: the collection holding copies of the modules' tables, the
    features' names, TableViews at the modules' paths, and a state_dict without the tables
    (the views hold them) whose optimizer state an eager model's checkpoint leaves as it is."""

    def __init__(self, names: list[str], modules: list[torch.nn.Module], collection):
        super().__init__()
        self.collection = collection
        with torch.no_grad():
            for view, m in zip(collection.table_weights(), modules):
                view.copy_(m.weight)
        self.names = list(names)
        hide_shown(self)

    def _shown(self) -> dict[str, Tensor]:
        return {f"collection.{self.collection._prefix}.{n}.weight": self.collection.embedding_weight(n)
                for n in self.names}

    def embfuse_views(self):
        return [(name, TableView(self, name)) for name in self.names]


class LookupBatch(_Batch):
    """Pooled lookups of several features, one table each, as one EmbeddingBagCollection call.
    forward(ids, offsets, weights): per feature, torch's EmbeddingBag inputs (2-D ids and no
    offsets, or 1-D ids with B offsets; weights or None), on the host or the device. Returns the
    (B, sum of widths) pooled output in feature order."""

    def __init__(self, names: list[str], modules: list[torch.nn.EmbeddingBag], weighted: bool, optimizer=None):
        w = modules[0].weight
        tables = [EmbeddingBagConfig(m.num_embeddings, m.embedding_dim, name=n, feature_names=[n],
                                     data_type=w.dtype, pooling=m.mode) for n, m in zip(names, modules)]
        super().__init__(names, modules, EmbeddingBagCollection(tables, is_weighted=weighted, device=w.device,
                                                                optimizer=optimizer))
        self.weighted = weighted

    def forward(self, ids: tuple, offsets: tuple, weights: tuple) -> Tensor:
        return self.collection(self.features(ids, offsets, weights)).values()

    def features(self, ids: tuple, offsets: tuple, weights: tuple) -> KeyedJaggedTensor:
        """forward's inputs as one KeyedJaggedTensor on the collection's device."""
        device = self.collection.weights.device
        B = batch_size(self.names, ids, offsets)
        parts = list(ids) + [o for o in offsets if o is not None] + [w for w in weights if w is not None]
        if all(t.device.type == "cpu" for t in parts) and not any(t.requires_grad for t in parts):
            psw = weights if self.weighted else None
            if tracing():
                values, offs, *psw = _stage_op(join_names(self.names), ids, offsets, psw or [], B, device)
            else:
                values, offs, *psw = _stage(self.names, ids, offsets, psw, B, device)
            psw = psw[0] if psw else None
        else:
            values, offs, psw = _on_device(ids, offsets, weights if self.weighted else None, B, device)
        return KeyedJaggedTensor(self.names, values, psw, offsets=offs, stride=B)

    def lookup_staged(self, values: Tensor, offsets: Tensor, weights: Tensor | None, B: int) -> Tensor:
        """forward for a batch already staged on the collection's device (write_staged's layout),
        its values padded past offsets[-1]: fixed shapes for a CUDA graph (fx/capture.py)."""
        return self.collection(self.staged_features(values, offsets, weights, B)).values()

    def staged_features(self, values: Tensor, offsets: Tensor, weights: Tensor | None, B: int) -> KeyedJaggedTensor:
        return PaddedKeyedJaggedTensor(self.names, values, weights if self.weighted else None, offsets=offsets,
                                       stride=B)


class EmbeddingBatch(_Batch):
    """Plain lookups of several features, one table each (one width), as one EmbeddingCollection
    call: forward(ids) takes one ids tensor a feature (any shape, host or device) and returns
    each feature's rows, ids.shape + (D,)."""

    def __init__(self, names: list[str], modules: list[torch.nn.Embedding], optimizer=None):
        w = modules[0].weight
        tables = [EmbeddingConfig(m.num_embeddings, m.embedding_dim, name=n, feature_names=[n], data_type=w.dtype)
                  for n, m in zip(names, modules)]
        super().__init__(names, modules, EmbeddingCollection(tables, device=w.device, optimizer=optimizer))

    def forward(self, ids: tuple) -> tuple:
        device = self.collection.weights.device
        for name, i in zip(self.names, ids):
            if i.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"feature {name!r}: ids must be int32 or int64, got {i.dtype}")
        dtype, bases = index_dtype(ids, ()), _bases(ids)
        if tracing():  # host ids in one staged copy, an op of the graph; the counts a graph constant
            values = torch.cat([i.reshape(-1).to(dtype) for i in copy_to_device(ids, device)])
            offsets = torch.tensor(bases, dtype=dtype, device=device)
        elif all(i.device.type == "cpu" for i in ids):  # one bag a feature: its offsets are the counts
            staging = Staging([(dtype, bases[-1]), (dtype, len(ids) + 1)])
            copy_all(end_to_end(staging.host[0], ids))
            staging.host[1].copy_(torch.tensor(bases, dtype=dtype))
            values, offsets = staging.to(device)
        else:
            values = torch.cat([i.reshape(-1).to(device, dtype) for i in ids])
            host = torch.tensor(bases, dtype=dtype)
            offsets = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
        kjt = KeyedJaggedTensor(self.names, values, offsets=offsets, stride=1,
                                length_per_key=[b - a for a, b in zip(bases, bases[1:])])
        rows = self.collection(kjt)
        D = self.collection.embedding_dim()
        return tuple(rows[n].values().view(*i.shape, D) for n, i in zip(self.names, ids))


def batch_size(names, ids, offsets) -> int:
    sizes = [i.shape[0] if o is None else o.shape[0] for i, o in zip(ids, offsets)]
    for name, i, o, b in zip(names, ids, offsets, sizes):
        if (i.dim() != 2 if o is None else i.dim() != 1 or o.dim() != 1):
            raise ValueError(f"feature {name!r}: input must be 2-D (B, L) without offsets or 1-D with 1-D offsets; "
                             f"got input of shape {tuple(i.shape)} and offsets "
                             f"{None if o is None else tuple(o.shape)}")
        if b != sizes[0]:
            raise ValueError(f"feature {name!r} has {b} bags but feature {names[0]!r} has {sizes[0]}: batched "
                             f"lookups need one batch size")
    return sizes[0]


def index_dtype(ids, offsets) -> torch.dtype:
    small = all(t.dtype == torch.int32 for t in list(ids) + [o for o in offsets if o is not None])
    return torch.int32 if small else torch.int64


def _bases(ids) -> list[int]:
    bases = [0]
    for i in ids:
        bases.append(bases[-1] + i.numel())
    return bases


def _local_offsets(i: Tensor, o: Tensor | None, dtype: torch.dtype) -> Tensor:
    if o is None:  # (B, L) ids: fixed-length bags
        return torch.arange(0, i.numel(), max(i.shape[1], 1), dtype=dtype, device=i.device)[:i.shape[0]]
    return o


def _stage(names, ids, offsets, weights, B, device):
    """Host inputs: values, global offsets and weights written into one (pinned) buffer, checked
    on the host (no device read: the data is here), copied once to a GPU: [values, offsets] and
    the weights if any."""
    dtype, n, N = index_dtype(ids, offsets), sum(i.numel() for i in ids), len(ids)
    parts = [(dtype, n), (dtype, N * B + 1)]
    if weights is not None:
        parts.append((weights[0].dtype, n))
    staging = Staging(parts)
    write_staged(names, ids, offsets, weights, B, *staging.host)
    return staging.to(device)


def write_staged(names, ids, offsets, weights, B, values: Tensor, offs: Tensor, psw: Tensor | None = None) -> None:
    """Write a batch's host inputs into host buffers: the ids end to end at the start of
    `values` (which may be longer: padding), the N * B + 1 global offsets into `offs` (checked
    against torch's rules, BadBatchError), the weights, if any, end to end into `psw`."""
    bases, N = _bases(ids), len(ids)
    pairs = end_to_end(values, ids) + (end_to_end(psw, weights) if weights is not None else [])
    grid = offs[:N * B].view(N, B)

    def global_offsets():  # beside the copies of the ids
        torch.stack([_local_offsets(i, o, offs.dtype) for i, o in zip(ids, offsets)], out=grid)
        _check_offsets(names, grid, bases)
        grid.add_(torch.tensor(bases[:-1], dtype=offs.dtype).view(N, 1))
        offs[-1] = bases[-1]

    copy_all(pairs, global_offsets)


@torch.library.custom_op("embfuse::stage_bags", mutates_args=())
def _stage_op(names: str, ids: list[Tensor], offsets: list[Optional[Tensor]], weights: list[Tensor], B: int,
              device: torch.device) -> list[Tensor]:
    """`_stage` as an op of a torch.compile graph: names joined by _handles.join_names, no weights: []."""
    out = _stage(split_names(names), ids, offsets, weights or None, B, device)
    return [t.clone() for t in out]  # (an op's outputs may not share storage)


@_stage_op.register_fake
def _(names, ids, offsets, weights, B, device):
    dtype, n = index_dtype(ids, offsets), sum(i.numel() for i in ids)
    out = [torch.empty(n, dtype=dtype, device=device), torch.empty(len(ids) * B + 1, dtype=dtype, device=device)]
    return out + [torch.empty(n, dtype=weights[0].dtype, device=device)] if weights else out


def _check_offsets(names, grid: Tensor, bases: list[int]) -> None:
    """torch's offsets rules, per feature (host data): start at 0, never decrease, stay inside
    the feature's ids."""
    if not grid.numel():
        return
    counts = torch.tensor([b - a for a, b in zip(bases, bases[1:])], dtype=grid.dtype)
    bad = (grid[:, 0] != 0) | (grid[:, 1:] < grid[:, :-1]).any(1) | (grid[:, -1] > counts)
    if not bad.any():
        return
    f = int(bad.nonzero()[0])
    o = grid[f]
    if int(o[0]) != 0:
        raise BadBatchError(f"feature {names[f]!r}: offsets[0] must be 0, got {int(o[0])}")
    dec = (o[1:] < o[:-1]).nonzero()
    if dec.numel():
        i = int(dec[0])
        raise BadBatchError(f"feature {names[f]!r}: offsets must be non-decreasing, but offsets[{i}] = {int(o[i])} > "
                            f"offsets[{i + 1}] = {int(o[i + 1])}")
    raise BadBatchError(f"feature {names[f]!r}: offsets[{o.numel() - 1}] = {int(o[-1])} runs past the end of the "
                        f"input ({int(counts[f])} ids)")


def _on_device(ids, offsets, weights, B, device):
    """Device inputs: a few device ops whatever N, and no host read. A feature
    whose offsets[0] is not 0 gets a first global offset past the end (or before its start), so
    the collection's check reports the batch as bad instead of pooling another feature's ids."""
    ids = [i.to(device) for i in ids]
    dtype, bases, N = index_dtype(ids, offsets), _bases(ids), len(ids)
    values = torch.cat([i.reshape(-1).to(dtype) for i in ids])
    local = [_local_offsets(i, None if o is None else o.to(device), dtype) for i, o in zip(ids, offsets)]
    shifted = list(torch._foreach_add(local, bases[:-1])) if N else []
    offs = torch.cat(shifted + [torch.full((1,), bases[-1], dtype=dtype, device=device)])
    if B and N:
        starts = torch.stack(local)[:, 0]  # (one launch; N indexing calls cost more host time)
        offs[:N * B].view(N, B)[:, 0] += starts.sign() * (bases[-1] + 1)
    psw = None if weights is None else torch.cat([w.to(device, weights[0].dtype) for w in weights])
    return values, offs, psw


def _arg(node: torch.fx.Node, index: int, name: str):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _source(arg):
    """The host tensor behind `x.to(device)` / `x.cuda()` when that move feeds only this lookup."""
    if (isinstance(arg, torch.fx.Node) and arg.op == "call_method" and arg.target in MOVES
            and len(arg.users) == 1 and isinstance(arg.args[0], torch.fx.Node)):
        return arg.args[0]
    return arg


def batch_lookups(gm: torch.fx.GraphModule, optimizer=None, report: list[str] | None = None) -> torch.fx.GraphModule:
    """Rewrite `gm`'s nn.EmbeddingBag calls as LookupBatch calls (module docstring). With
    `optimizer` (an embfuse.optim rule) the batches update their touched rows in the backward.
    What was done, and what was left and why, is appended to `report`. Returns `gm`, recompiled."""
    report = [] if report is None else report
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[list[torch.fx.Node]]] = {}
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target),
                                                      (torch.nn.EmbeddingBag, torch.nn.Embedding)):
            continue
        m = gm.get_submodule(node.target)
        if isinstance(m, torch.nn.Embedding):
            why = unbatchable(m)
            if why is not None:
                report.append(f"left {node.target}: {why}")
                continue
            runs = groups.setdefault(("embedding", m.weight.dtype, m.weight.device, m.embedding_dim), [[]])
            if runs[-1] and not _joins(runs[-1], node, order):
                runs.append([])
            runs[-1].append(node)
            continue
        why = unbatchable(m)
        weighted = _arg(node, 2, "per_sample_weights") is not None
        if why is None and weighted and m.mode != "sum":
            why = "per_sample_weights need mode='sum'"
        if why is not None:
            report.append(f"left {node.target}: {why}")
            continue
        runs = groups.setdefault((m.weight.dtype, m.weight.device, weighted), [[]])
        if runs[-1] and not _joins(runs[-1], node, order):
            runs.append([])
        runs[-1].append(node)
    count = sum(1 for n in gm.modules() if isinstance(n, (LookupBatch, EmbeddingBatch)))
    for key, runs in groups.items():
        for run in runs:
            if key[0] == "embedding":
                _rewrite_embeddings(gm, run, optimizer, f"embfuse_lookups_{count}", report)
            else:
                _rewrite(gm, run, key[2], optimizer, f"embfuse_lookups_{count}", report)
            count += 1
    gm.graph.lint()
    gm.recompile()
    return gm


def _joins(run: list[torch.fx.Node], node: torch.fx.Node, order) -> bool:
    """Whether `node` may join `run`: every input of it exists before any output of the run is used
    (a host tensor's `.to(device)` that feeds only the lookup counts as the host tensor: the batch
    moves it itself)."""
    first_use = min((order[u] for n in run for u in n.users), default=len(order))
    return all(order[_source(a)] < first_use for a in node.all_input_nodes)


def _insert_batch(gm, run, name: str, batch: torch.nn.Module, args: tuple) -> torch.fx.Node:
    """`batch` registered as `name` and called with `args` right before the first use of any of
    `run`'s outputs."""
    gm.add_submodule(name, batch)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_use = min((u for n in run for u in n.users), key=order.__getitem__, default=gm.graph.output_node())
    with gm.graph.inserting_before(first_use):
        return gm.graph.call_module(name, args)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, piece: torch.fx.Node) -> None:
    """`node`'s uses go to `piece`; `node` leaves the graph, with the device moves that fed only it."""
    moves = [a for a in node.all_input_nodes if a.op == "call_method" and a.target in MOVES and len(a.users) == 1]
    node.replace_all_uses_with(piece)
    graph.erase_node(node)
    for move in moves:
        if not move.users:
            graph.erase_node(move)


def _rewrite(gm, run, weighted, optimizer, name, report) -> None:
    graph = gm.graph
    modules = [gm.get_submodule(n.target) for n in run]
    names = [n.target for n in run]
    ids = tuple(_source(_arg(n, 0, "input")) for n in run)
    offsets = tuple(_source(_arg(n, 1, "offsets")) for n in run)
    weights = tuple(_source(_arg(n, 2, "per_sample_weights")) for n in run)
    out = _insert_batch(gm, run, name, LookupBatch(names, modules, weighted, optimizer), (ids, offsets, weights))
    col = 0
    slices = []
    for node, m in zip(run, modules):
        with graph.inserting_after(out):
            piece = graph.call_function(torch.narrow, (out, 1, col, m.embedding_dim))
        slices.append(piece)
        col += m.embedding_dim
        _replace(graph, node, piece)
    out.meta["embfuse_width"] = col  # the output's width, for the horizontal pass
    for piece in reversed(slices):  # keep the slices in feature order after `out`
        out.append(piece)
    _whole_cat(graph, out, slices)
    report.append(f"batched {len(run)} EmbeddingBag lookups into {name}: {', '.join(names)}")


def _rewrite_embeddings(gm, run, optimizer, name, report) -> None:
    names = [n.target for n in run]
    batch = EmbeddingBatch(names, [gm.get_submodule(n.target) for n in run], optimizer)
    out = _insert_batch(gm, run, name, batch, (tuple(_source(_arg(n, 0, "input")) for n in run),))
    for k, node in reversed(list(enumerate(run))):
        with gm.graph.inserting_after(out):
            piece = gm.graph.call_function(operator.getitem, (out, k))
        _replace(gm.graph, node, piece)
    report.append(f"batched {len(run)} Embedding lookups into {name}: {', '.join(names)}")


def _whole_cat(graph: torch.fx.Graph, out: torch.fx.Node, slices: list[torch.fx.Node]) -> None:
    """`torch.cat(slices, 1)`, every slice in order, is `out` itself."""
    for user in list(slices[0].users):
        if user.op != "call_function" or user.target not in CATS:
            continue
        tensors = user.args[0] if user.args else user.kwargs.get("tensors")
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if list(tensors) == slices and dim in (1, -1):
            user.replace_all_uses_with(out)
            graph.erase_node(user)
    for piece in slices:
        if not piece.users:
            graph.erase_node(piece)


__all__ = ["EmbeddingBatch", "LookupBatch", "batch_lookups", "batch_size", "index_dtype", "unbatchable", "write_staged"]
