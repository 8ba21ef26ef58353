"""CUDA graphs for an optimized model whose batches change shape: `embfuse.fx.capture`.

A CUDA graph replays fixed shapes at fixed addresses, and no Python runs at a replay. An
optimized model (fx/optimize.py) takes host tensors: each LookupBatch writes its features' ids,
offsets and weights into one pinned buffer and copies it once, and `copy_to_device` moves the
other host inputs the same way. `capture(model, example_inputs, step)` keeps that host work out
of the graph and the device work in it:

- every node that brings host inputs to the device (a LookupBatch, a copy_to_device) reads a
  fixed region of one static device buffer. A LookupBatch's ids (and weights) get `capacity`
  entries: the batch's values, then padding that no bag holds (sparse/padded.py). Batches of any
  bag lengths then share one shape, and one graph replays them all. An input already on the GPU
  gets a static tensor of its own, filled by a device copy at each call;
- a call writes its batch into one of two pinned host buffers (the ids end to end, the offsets
  made global and checked, as the model does eagerly), copies that buffer into the static one
  with one non-blocking copy, and replays. With two buffers the host writes batch i + 1 while
  the GPU still runs batch i;
- what is captured is `step(model, *inputs, *extras)` (default: the model's forward), such as
  forward, loss, backward and optimizer steps. Arguments past the model's own (a target, say)
  keep their example's shapes and dtypes; their tensors are copied into static tensors as well.
  Capturing runs the step `warmup` times on the example first (CUDA graphs need a warm-up on a
  side stream) and then puts back what those steps changed: the model's parameters and buffers,
  its fused optimizers' state and step counts, and the state of the torch optimizers named
  (state they made during the warm-up, such as momentum, is zeroed: what a fresh one starts from).

The returned outputs are the graph's static tensors: the next call overwrites them. A batch that
exceeds the capacity, has another batch size or a wider id dtype, or has bad offsets raises at
the call, from host data, before anything is copied. A bad id is found on the device by the
graph's own check and raised by the first call after the GPU has run it (or by
`embfuse.check_errors()`, which waits), together with any other bad replay since the last
report. That batch changes no table or optimizer state (ops/deferred.py) and counts no step: a
call advances the fused optimizers' step counts on the host by what the captured step counted,
and the report of a bad replay takes that back. Rules whose hyper-parameters change every step
(Adam) read them from the GPU's own count inside the graph (optim/lookup.py).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from typing import Callable, Optional, Sequence

import torch
import torch.fx
from torch import Tensor

from embfuse.fx.passes.horizontal import PooledChain
from embfuse.fx.passes.lookups import EmbeddingBatch, LookupBatch, batch_size, index_dtype, write_staged
from embfuse.fx.staging import Staging, copy_to_device
from embfuse.ops.deferred import device_log


class _Bags:
    """A LookupBatch (or PooledChain) node's part of the buffer: values and weights of `capacity`
    entries, the N * B + 1 global offsets."""

    def __init__(self, node: torch.fx.Node, lookup, ids, offsets, weights, capacity: Optional[int]):
        self.node, self.lookup = node, lookup
        batch = self.batch = lookup if isinstance(lookup, LookupBatch) else lookup.batch
        self.B = batch_size(batch.names, ids, offsets)
        self.dtype = index_dtype(ids, offsets)
        n = sum(i.numel() for i in ids)
        self.capacity = n if capacity is None else capacity
        if self.capacity < n:
            raise ValueError(f"capacity {self.capacity} is smaller than the example batch's {n} ids ({node.target})")
        self.weight_dtype = weights[0].dtype if batch.weighted else None
        self.parts = [(self.dtype, self.capacity), (self.dtype, len(ids) * self.B + 1)]
        if batch.weighted:
            self.parts.append((self.weight_dtype, self.capacity))

    def write(self, views: list[Tensor], ids, offsets, weights) -> None:
        name = self.node.target
        B = batch_size(self.batch.names, ids, offsets)
        if B != self.B:
            raise ValueError(f"{name}: this batch has {B} samples, the captured graph {self.B}")
        if index_dtype(ids, offsets).itemsize > self.dtype.itemsize:
            raise TypeError(f"{name}: this batch's ids or offsets are int64, the captured graph's int32")
        n = sum(i.numel() for i in ids)
        if n > self.capacity:
            raise ValueError(f"{name}: this batch has {n} ids, past the captured capacity {self.capacity}")
        if self.batch.weighted and any(w.dtype != self.weight_dtype for w in weights):
            raise TypeError(f"{name}: per_sample_weights must be {self.weight_dtype}, as when captured")
        write_staged(self.batch.names, ids, offsets, weights if self.batch.weighted else None, B, *views)

    def run(self, views: list[Tensor]) -> Tensor:
        values, offsets, *weights = views
        return self.lookup.lookup_staged(values, offsets, weights[0] if weights else None, self.B)


class _Tensors:
    """Values of fixed shapes staged as captured: a host tensor takes a part of the buffer, one
    already on the GPU (the model's `.to()` would leave it where it is) a static tensor of its
    own, which each call fills with one device copy; anything else stays what it was when
    captured. `labels[k]` names value k in errors."""

    def __init__(self, values, labels):
        self.labels = labels
        self.was = [(v.shape, v.dtype, v.device) if isinstance(v, Tensor) else None for v in values]
        # None: a host tensor's part of the buffer
        self.kept = [v if not isinstance(v, Tensor) else None if v.device.type == "cpu" else torch.empty_like(v)
                     for v in values]
        self.parts = [(v.dtype, v.numel()) for v in values if isinstance(v, Tensor) and v.device.type == "cpu"]

    def check(self, values) -> None:
        for label, v, was in zip(self.labels, values, self.was):
            if was is not None and not (isinstance(v, Tensor) and (v.shape, v.dtype, v.device) == was):
                got = f"{v.dtype} {tuple(v.shape)} on {v.device}" if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(f"{label}: captured for {was[1]} {tuple(was[0])} on {was[2]}, got {got}")

    def write(self, views: list[Tensor], values) -> None:
        views = iter(views)
        for v, was, kept in zip(values, self.was, self.kept):
            if was is None:
                continue
            if kept is None:
                next(views).copy_(v.reshape(-1))
            else:  # (after the previous replay on this stream, before the next)
                kept.copy_(v, non_blocking=True)

    def run(self, views: list[Tensor]) -> list:
        views = iter(views)
        return [next(views).view(was[0]) if was is not None and kept is None else kept
                for was, kept in zip(self.was, self.kept)]


class _Copies(_Tensors):
    """A copy_to_device node's tensors (_Tensors)."""

    def __init__(self, node: torch.fx.Node, tensors):
        self.node = node
        if any(t.requires_grad for t in tensors):
            raise ValueError(f"{node.name}: capture stages tensors that need no grad; got one that requires grad")
        super().__init__(tensors, [node.name] * len(tensors))

    def write(self, views: list[Tensor], tensors, device) -> None:  # (device: the node's, unused)
        self.check(tensors)
        super().write(views, tensors)

    def run(self, views: list[Tensor]) -> tuple:
        return tuple(super().run(views))


class _Static(torch.fx.Interpreter):
    """The model with each staging node reading its part of the static buffer."""

    def __init__(self, gm: torch.fx.GraphModule, static: dict):
        super().__init__(gm)
        self.static = static

    def run_node(self, n: torch.fx.Node):
        run = self.static.get(n)
        return run() if run is not None else super().run_node(n)


class CapturedStep:
    """`step(model, *inputs)` captured once in a CUDA graph (module docstring); calling it with a
    new batch writes the batch into the graph's input buffer and replays. `graph=False` (and any
    model on the CPU) runs the same staged step eagerly at each call instead: the same inputs and
    outputs, no graph."""

    def __init__(self, model: torch.fx.GraphModule, example_inputs: Sequence, step: Optional[Callable] = None, *,
                 capacity: Optional[int] = None, optimizers: Sequence = (), graph: bool = True, warmup: int = 2):
        if not isinstance(model, torch.fx.GraphModule):
            raise TypeError(f"capture takes a model made by embfuse.fx.optimize (a GraphModule), got "
                            f"{type(model).__name__}")
        self.model, self.step = model, step if step is not None else (lambda m, *a: m(*a))
        self.n_inputs = len(inspect.signature(model.forward).parameters)
        example_inputs = tuple(example_inputs)
        inputs, extras = example_inputs[:self.n_inputs], example_inputs[self.n_inputs:]
        self.placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
        self.stagers = _stagers(model, self._env(inputs), capacity)
        self.device = self._device()
        self.replays = graph and self.device.type == "cuda"
        # the layout: every stager's parts, then the host tensors among the extras
        self.extras = _Tensors(extras, [f"argument {self.n_inputs + i}" for i in range(len(extras))])
        parts = [p for s in self.stagers for p in s.parts] + self.extras.parts
        # on a GPU two pinned buffers, each reused only once the copy that read it is done (with
        # or without a graph: the copy is non-blocking either way)
        cuda = self.device.type == "cuda"
        self.pinned = [Staging(parts) for _ in range(2 if cuda else 1)]
        self.events = [torch.cuda.Event() if cuda else None for _ in self.pinned]
        self.turn = 0
        self.buffer = torch.empty_like(self.pinned[0].buffer, device=self.device)
        views = self.pinned[0].views(self.buffer)
        static, at = {}, 0
        for s in self.stagers:
            mine = views[at:at + len(s.parts)]
            static[s.node] = lambda s=s, mine=mine: s.run(mine)
            at += len(s.parts)
        self.static_extras = self.extras.run(views[at:])
        self.interpreter = _Static(model, static)
        self.outputs = None
        self._stage(example_inputs)
        if self.replays:
            self._capture(inputs, warmup, optimizers)

    def _env(self, inputs) -> dict:
        return dict(zip(self.placeholders, self.model.graph.process_inputs(*inputs)))

    def _device(self) -> torch.device:
        for s in self.stagers:
            if isinstance(s, _Bags):
                return s.batch.collection.weights.device
        if self.stagers:  # copies only: the first one's device (given as `t.device`, a node: the parameters')
            device = self.stagers[0].node.args[1]
            return next(self.model.parameters()).device if isinstance(device, torch.fx.Node) else torch.device(device)
        raise ValueError("the model has no batched lookups or host-to-device copies to stage: capture it with "
                         "torch.cuda.graph directly")

    def _stage(self, args) -> None:
        """Write the batch into the next pinned buffer and copy it into the static one."""
        if len(args) != self.n_inputs + len(self.extras.was):
            raise TypeError(f"captured for {self.n_inputs} model inputs and {len(self.extras.was)} extras, got "
                            f"{len(args)} arguments")
        inputs, extras = args[:self.n_inputs], args[self.n_inputs:]
        self.extras.check(extras)
        env = self._env(inputs)
        k = self.turn
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copy that last read this pinned buffer is done
        views, at = self.pinned[k].host, 0
        for s in self.stagers:
            s.write(views[at:at + len(s.parts)], *_node_args(s.node, env))
            at += len(s.parts)
        self.extras.write(views[at:], extras)
        self.buffer.copy_(self.pinned[k].buffer, non_blocking=True)
        if self.events[k] is not None:
            self.events[k].record()
        self.turn = (k + 1) % len(self.pinned)

    def _run(self, inputs):
        """The step with the staging nodes reading the static buffer (model.forward swapped for
        the interpreter while it runs)."""
        self.model.forward = lambda *args: self.interpreter.run(*args)
        try:
            return self.step(self.model, *inputs, *self.static_extras)
        finally:
            del self.model.forward

    def _capture(self, inputs, warmup: int, optimizers: Sequence) -> None:
        # the warm-up runs the step for real (a capture records without running): its effects
        # on the model and the optimizers are put back afterwards, in place (the graph holds
        # those tensors), so that the first call makes the first step
        tensors = [t for t in itertools.chain(self.model.parameters(), self.model.buffers(),
                                               *(_state_tensors(o) for o in optimizers))]
        saved = [t.detach().clone() for t in tensors]
        fused = [m._fused for m in self.model.modules() if getattr(m, "_fused", None) is not None]
        steps = [f.step for f in fused]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._run(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        known = {id(t) for t in tensors}
        with torch.no_grad():
            for t, was in zip(tensors, saved):
                t.copy_(was)
            for o in optimizers:  # state the warm-up made (momentum, say): as a fresh optimizer's, zeros
                for t in _state_tensors(o):
                    if id(t) not in known:
                        t.zero_()
        for f, step in zip(fused, steps):
            f.set_step(step)
        self.cuda_graph = torch.cuda.CUDAGraph()
        log = device_log(self.device)
        first_seq = log.seq + 1  # (the checks this capture makes are numbered from here)
        try:
            with _stale_streams_joined(), torch.cuda.graph(self.cuda_graph):
                self.outputs = self._run(inputs)
        except RuntimeError as e:
            raise RuntimeError(
                f"capturing the step failed ({e}). One cause: an autograd graph made outside the capture is still "
                f"alive and reaches the model's parameters (the output of a forward with gradients, kept): their "
                f"gradient accumulators then run on that forward's stream. Drop that output (or make that forward "
                f"under torch.no_grad()) before capturing; torch versions with "
                f"torch.autograd.graph.set_override_stale_capture_stream handle it for you.") from e
        # a replay runs no Python: the fused optimizers' step counts advance here, by what the
        # captured step counted
        self.fused_steps = [(f, f.step - step) for f, step in zip(fused, steps)]
        for f, step in zip(fused, steps):
            f.set_step(step)
        for check in log.graph_checks.values():  # (a bad replay takes its steps back: DeviceLog.poll)
            check.replays_counted |= check.seq >= first_seq

    def __call__(self, *args):
        device_log(self.device).poll()  # errors that earlier replays found
        self._stage(args)
        if not self.replays:
            return self._run(args[:self.n_inputs])
        self.cuda_graph.replay()
        for f, counted in self.fused_steps:
            f.step += counted
        return self.outputs


def _node_args(node: torch.fx.Node, env: dict) -> tuple:
    """`node`'s arguments, its placeholders as `env` gives them (a device node: None)."""
    return torch.fx.node.map_arg(node.args, env.get)


def _stagers(model: torch.fx.GraphModule, env: dict, capacity: Optional[int]) -> list:
    """The nodes of `model` that bring its host inputs to the device, each with its part of the
    buffer; raises for what a graph could not replay."""
    stagers = []
    for node in model.graph.nodes:
        target = model.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(target, (LookupBatch, PooledChain)):
            stagers.append(_Bags(node, target, *_node_args(node, env), capacity))
        elif isinstance(target, EmbeddingBatch):
            raise ValueError(f"{node.target}: plain embedding lookups give outputs of the batch's own sizes, which a "
                             f"CUDA graph cannot replay")
        elif node.op == "call_function" and node.target is copy_to_device:
            stagers.append(_Copies(node, _node_args(node, env)[0]))
    for s in stagers:
        device = s.node.args[1] if isinstance(s, _Copies) else None
        computed = [n.name for n in s.node.all_input_nodes if n.op != "placeholder" and n is not device]
        if computed:
            raise ValueError(f"{s.node.name} reads {computed}, computed inside the model: capture stages the model's "
                             f"own inputs only")
    staged = {s.node for s in stagers}
    for p in (n for n in model.graph.nodes if n.op == "placeholder"):
        others = [u.name for u in p.users if u not in staged]
        if isinstance(env[p], Tensor) and others:
            raise ValueError(f"input {p.name!r} is also read by {others}, not only by the batched lookups and "
                             f"host-to-device copies: a CUDA graph would replay its first value")
    return stagers


def capture(model: torch.fx.GraphModule, example_inputs: Sequence, step: Optional[Callable] = None, *,
            capacity: Optional[int] = None, optimizers: Sequence = (), graph: bool = True,
            warmup: int = 2) -> CapturedStep:
    """`step(model, *example_inputs)` (default: `model(*example_inputs)`) captured in a CUDA graph
    that replays batches of any bag lengths up to `capacity` ids a lookup batch (default: the
    example's count). Call the result with each batch in place of the step (module docstring).
    `optimizers`: the torch optimizers `step` uses, whose state the warm-up steps must not keep
    (the model's parameters, buffers and fused optimizers are put back in any case)."""
    return CapturedStep(model, example_inputs, step, capacity=capacity, optimizers=optimizers, graph=graph,
                        warmup=warmup)


@contextlib.contextmanager
def _stale_streams_joined():
    """Autograd's gradient accumulators keep the stream of the forward that made them while any
    graph through them is alive; newer torch (2.13 has it) can move such a stale stream into the
    capture (set_override_stale_capture_stream), which this turns on for the capture. Older torch: as is."""
    override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if override is None:
        yield
        return
    was = getattr(torch._C, "_override_stale_capture_stream", lambda: False)()
    override(True)
    try:
        yield
    finally:
        override(was)


def _state_tensors(optimizer) -> list[Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]


__all__ = ["CapturedStep", "capture"]
