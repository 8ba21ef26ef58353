"""Lookups whose backward applies the optimizer: what modules built with `optimizer=` run.

The weight is not an autograd input (its .grad stays None); a scalar `anchor` that requires
grad makes autograd call the backward, which updates the touched rows in place. The backward
reads the ids saved by the forward, so a batch rejected by validation never reaches it, and one
whose deferred check fails on the device updates nothing (its kernels read the check's status):
weights and state stay bitwise unchanged, and the host undoes the step count when it learns of it.

Eager calls run `_Fused` (an autograd.Function); inside torch.compile graphs the same `_Call`s
run as three opaque ops (`embfuse::fused_lookup`, its backward `embfuse::fused_update_`, which
declares the table and state it writes, and the per-sample weights' gradient), so a training
step with a fused optimizer compiles with fullgraph=True.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from embfuse import _handles
from embfuse._triton import exporting, tracing, use_kernels
from embfuse.ops.bags import accumulation
from embfuse.ops.collection import pool_collection
from embfuse.ops.deferred import TracedCheck, check_of, known_good
from embfuse.ops.embedding import gather, guarded_ids, prepare_ids
from embfuse.ops.embedding_bag import per_sample_weights_grad, pool, prepare_bags, table_backward_inputs
from embfuse.ops.errors import UnsupportedError
from embfuse.ops.validate import DEFAULT_BOUNDS_CHECK, check_fused_table
from embfuse.optim.fused import apply_sparse_update, collection_update
from embfuse.optim.hot import hot_update
from embfuse.optim.rules import HYPER_STEP, GraphStep, init_state, joined


class FusedOptimizer(_handles.Named):
    """An optimizer bound to one table (or a collection's flat buffer): fp32 state, step count.

    The step count is the host's (the rules' hyper-parameters go to the kernels as host scalars:
    no device read a step). A CUDA graph replays no Python, so where the rule's hyper-parameters
    change from step to step (`per_step`: Adam's bias corrections, Adagrad's lr_decay, stochastic
    rounding's seed) a captured update reads them from `step_copies[device]`, a float64 copy on the
    GPU (Hyper's fields, then the step), which the graph itself advances (_Rule.graph_hyper): by
    one a replay whose batch passed its check. Every step outside a graph writes its count there
    (one small launch), so that a capture starts from the right count."""

    def __init__(self, optimizer, num_embeddings: int, dim: int, device, state=None):
        self.optimizer = optimizer
        self.state = init_state(optimizer, num_embeddings, dim, device) if state is None else state
        self.step = 0
        self.per_step = optimizer.per_step()
        self.step_copies = {}  # device -> float64 (Hyper's fields, step), for rules with per_step
        self.anchor = torch.ones((), requires_grad=True)
        self.calls = {}  # this optimizer's _Calls
        _handles.register(self)  # (named in traced graphs)

    def __getstate__(self):
        return {**super().__getstate__(), "calls": {}, "step_copies": {}}  # (a copy makes its own)

    def set_step(self, step: int) -> None:
        """Set the step count (a checkpoint's; fx.capture putting back its warm-up's steps)."""
        self.step = step
        for hyper in self.step_copies.values():
            hyper[HYPER_STEP].fill_(step)

    @contextlib.contextmanager
    def stepping(self, check, status, device):
        """What one backward's update reads as its step, whose batch had `check` (a deferred
        Check, or None) and `status` (its status tensor, or None) on `device`: the step number,
        or inside a CUDA-graph capture of a rule with per-step hyper-parameters a GraphStep (its
        step_copy tensor, advanced on a side stream); None when the batch is already known bad
        (nothing to do). A step counts once the update returns: an update that raises leaves the
        count as it was, and one whose batch is found bad later is taken back then (DeviceLog
        calls the undo; for a check captured into a CUDA graph, at each bad replay that
        embfuse.fx.capture counted)."""
        if check is not None and check.bad:
            yield None
            return
        self.step += 1
        try:
            step = self._graph_step(status, device) if self.per_step and device.type == "cuda" else self.step
            try:
                yield step
            finally:
                joined(step)  # (an update that launched nothing still joins a graph's side stream)
        except BaseException:
            self.step -= 1
            raise
        if check is not None and check.bad is None:
            check.undo.append(self._uncount_replay if check.in_graph else self._undo_step)

    def _graph_step(self, status, device):
        if not torch.cuda.is_current_stream_capturing():
            self.step_copy(device)[HYPER_STEP].fill_(self.step)
            return self.step
        hyper = self.step_copies.get(device)
        if hyper is None:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}: run a training step outside the CUDA graph before capturing "
                f"it (a warm-up, as torch.cuda.graph asks): the graph reads this rule's per-step hyper-parameters "
                f"from the GPU's copy of the step count, which that step makes")
        # about ten small ops (Adam's): on a side stream, beside the backward's passes up to the
        # update's launch, which waits for them (GraphStep; benchmarks/NOTES.md, session 62)
        main, side = torch.cuda.current_stream(device), _side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.optimizer.graph_hyper(hyper, 1 if status is None else status[0] == 0)
        ready = torch.cuda.Event()
        ready.record(side)
        return GraphStep(hyper, ready)

    def step_copy(self, device) -> torch.Tensor:
        """The step_copies tensor of `device`, made if missing (a real tensor even under a trace:
        it outlives it)."""
        hyper = self.step_copies.get(device)
        if hyper is None:
            with _disable_current_modes():
                hyper = self.step_copies[device] = torch.tensor([*self.optimizer.hyper(1), self.step],
                                                                dtype=torch.float64, device=device)
        return hyper

    def _undo_step(self):
        self.step -= 1
        if self.step_copies and not torch.cuda.is_current_stream_capturing():
            self.set_step(self.step)

    def _uncount_replay(self):
        """A bad replay's step off the host's count; the GPU's copy never counted it."""
        self.step -= 1


_SIDE_STREAMS = {}  # device -> the stream a captured step's copy advances on (FusedOptimizer._graph_step)


def _side_stream(device) -> torch.cuda.Stream:
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return side


def _status(check):
    return None if check is None else check.status


# ---- one class a kind of lookup: its forward, the gradients of its inputs, its update ----

_KINDS = {}  # kind name -> _Call subclass (trace constants are names, not classes)


class _Call(_handles.Named):
    """What a fused lookup needs besides its tensors (the optimizer, a plan, modes). `handle`
    names it inside torch.compile graphs, whose ops take tensors and numbers only: see
    `_fused_lookup_op`. One a (kind, arguments) per optimizer, kept for the optimizer's life."""

    saves_out = False

    def __init_subclass__(cls):
        _KINDS[cls.__name__] = cls

    def __init__(self, fused, *static):
        self.fused, self.static = fused, static
        _handles.register(self)

    @property
    def handle(self) -> int:
        return self._embfuse_handle  # (a copy's own: _handles.Named renames copies)

    def input_grads(self, weight, tensors, out, grad, status):
        return [None] * len(tensors)


class _BagCall(_Call):
    """One table, CSR bags: tensors (indices, offsets, per-sample weights or None)."""

    saves_out = True  # the weights' gradient under sqrtn / wmean reads the output

    def forward(self, weight, tensors, check, size):
        indices, offsets, psw = tensors
        mode, padding_idx = self.static
        return pool(weight, indices, offsets, psw, mode, padding_idx, with_max_ids=False, check=check)[0]

    def out_shape(self, weight, tensors, size):
        return (tensors[1].shape[0] - 1, weight.shape[1])

    def input_grads(self, weight, tensors, out, grad, status):
        """The per-sample weights' gradient, taken before the rows change."""
        indices, offsets, psw = tensors
        mode, padding_idx = self.static
        return [None, None, per_sample_weights_grad(grad, weight, indices, offsets, psw, padding_idx, status, mode,
                                                    out)]

    def update(self, weight, state, tensors, grad, status, step, size):
        indices, offsets, psw = tensors
        mode, padding_idx = self.static
        if offsets.numel() > 1:
            ids, bag, scale = table_backward_inputs(indices, offsets, psw, mode, padding_idx, *weight.shape,
                                                    status=status, dtype=accumulation(weight))
            apply_sparse_update(weight, state, self.fused.optimizer, ids, grad.contiguous(), bag, scale, step,
                                padding_idx)


class _EmbeddingCall(_Call):
    """Plain rows: tensors (1-D ids, keep-mask or None: rows not kept read as zeros, None)."""

    def forward(self, weight, tensors, check, size):
        status = _status(check)
        ids, keep, _ = tensors
        out = gather(weight, ids, status)
        return out if keep is None else torch.where(keep.reshape(-1, 1), out, 0)

    def out_shape(self, weight, tensors, size):
        return (tensors[0].shape[0], weight.shape[1])

    def update(self, weight, state, tensors, grad, status, step, size):
        ids, keep, _ = tensors
        ids = guarded_ids(ids, status)
        if keep is not None:
            ids = torch.where(keep.reshape(-1), ids, -1)
        apply_sparse_update(weight, state, self.fused.optimizer, ids, grad.contiguous(), None, None, step,
                            self.static[0])


class _CollectionCall(_Call):
    """A collection's flat buffer: tensors (values, offsets, weights or None); `size`: B."""

    def forward(self, weights, tensors, check, size):
        values, offsets, psw = tensors
        return pool_collection(weights, values, offsets, psw, self.static[0], size, _status(check))

    def out_shape(self, weights, tensors, size):
        return (size, self.static[0].total_dim)

    def update(self, weights, state, tensors, grad, status, step, size):
        values, offsets, psw = tensors
        plan, hot = self.static
        # the hot-row path reads the host (see optim/hot.py): never while a CUDA graph is
        # captured; it reads the check's status first (its passes index by id)
        if (hot is not None and psw is None and values.numel() >= hot.min_values and use_kernels(weights)
                and weights.dtype != torch.float64 and not torch.cuda.is_current_stream_capturing()):
            if known_good(status):
                hot.maybe_refresh(values, offsets, plan, size, step)
                hot_update(weights, list(state.values()), self.fused.optimizer, values, offsets, plan, size,
                           grad.contiguous(), step, hot)
        else:
            collection_update(weights, state, self.fused.optimizer, values, offsets, psw, plan, size, grad, step,
                              status=status)


def _call(kind, fused: FusedOptimizer, *static) -> _Call:
    # static: modes and ints by value, objects (a plan, a hot-row set) by identity, kept alive by the call
    key = (kind, *(v if v is None or isinstance(v, (int, str)) else id(v) for v in static))
    call = fused.calls.get(key)
    if call is None:
        call = fused.calls[key] = kind(fused, *static)
    return call


@torch.compiler.assume_constant_result
def _handle(kind: str, fused: int, *static) -> int:
    """`_call(...).handle` from trace constants (_handles.as_constant), a constant of the graph."""
    return _call(_KINDS[kind], _handles.lookup(fused), *map(_handles.from_constant, static)).handle


@torch.compiler.assume_constant_result
def _prepare_step_copy(fused: int, device: str) -> bool:
    """Make the GPU's copy of a step count while a graph is traced (plain Python), not when it
    first runs: Inductor's CUDA graphs (mode="reduce-overhead") run a graph's first call inside
    their memory pool, which must hold nothing alive after it (as ops/deferred.py prepare_log)."""
    if device.startswith("cuda"):
        _handles.lookup(fused).step_copy(torch.device(device))
    return True


class _Fused(torch.autograd.Function):
    """Eager calls: the forward of `call`; the backward takes the inputs' gradients, then
    updates the rows in place under the optimizer's step count."""

    @staticmethod
    def forward(ctx, anchor, weight, call, check, size, *tensors):
        out = call.forward(weight, tensors, check, size)  # (its kernel may run a pending check: take_fold)
        ctx.save_for_backward(*tensors, out if call.saves_out else None)
        ctx.weight, ctx.call, ctx.check, ctx.size = weight, call, check, size
        return out

    @staticmethod
    def backward(ctx, grad):
        *tensors, out = ctx.saved_tensors
        call, status = ctx.call, _status(ctx.check)
        grads = [None] * len(tensors)
        if any(ctx.needs_input_grad[5:]):
            grads = call.input_grads(ctx.weight, tensors, out, grad, status)
        with call.fused.stepping(ctx.check, status, ctx.weight.device) as step:
            if step is not None:
                call.update(ctx.weight, call.fused.state, tensors, grad, status, step, ctx.size)
        return (None,) * 5 + tuple(grads)


def _lookup(kind, fused: FusedOptimizer, static, weight, check, size, *tensors):  # (three tensors)
    """Run a fused lookup: eagerly through `_Fused`, and inside torch.compile graphs (or any
    tracing) as the opaque ops below, which carry the same calls."""
    if tracing():
        if exporting():
            # (export traces with fake tensors, and the call objects it would make keep them)
            raise UnsupportedError("a lookup with a fused optimizer cannot be exported; export under torch.no_grad() "
                                   "for inference, which exports the plain lookup")
        handle = _handle(kind.__name__, fused._embfuse_handle, *map(_handles.as_constant, static))
        if fused.per_step:
            _prepare_step_copy(fused._embfuse_handle, str(weight.device))
        return _fused_lookup_op(fused.anchor, weight, list(fused.state.values()), *tensors, _status(check), handle,
                                size)
    return _Fused.apply(fused.anchor, weight, _call(kind, fused, *static), check, size, *tensors)


# ---- the traced form: opaque ops, so the host's step count and plans stay Python ----
# The forward op's backward is an op that mutates the table and its state: AOTAutograd keeps it
# in the compiled backward. Inside a graph the check is only its status: a batch found bad later
# updates nothing, and its step is taken back as in eager calls (FusedOptimizer.stepping), by the
# check the status copy leads to (ops/deferred.py status_copy); CUDA-graph replays count no step on
# the host (the GPU's count of a rule with per-step hyper-parameters advances: FusedOptimizer).

@torch.library.custom_op("embfuse::fused_lookup", mutates_args=())
def _fused_lookup_op(anchor: Tensor, weight: Tensor, state: list[Tensor], first: Tensor, second: Optional[Tensor],
                     third: Optional[Tensor], status: Optional[Tensor], handle: int, size: int) -> Tensor:
    """A call's tensors in three slots: (ids, offsets, per-sample weights) or (ids, keep, None)."""
    return _handles.lookup(handle).forward(weight, (first, second, third), None if status is None else
                                           TracedCheck(status), size)


@_fused_lookup_op.register_fake
def _(anchor, weight, state, first, second, third, status, handle, size):
    return weight.new_empty(_handles.lookup(handle).out_shape(weight, (first, second, third), size))


@torch.library.custom_op("embfuse::fused_lookup_input_grad", mutates_args=())
def _input_grad_op(weight: Tensor, first: Tensor, second: Optional[Tensor], third: Tensor, out: Optional[Tensor],
                   grad: Tensor, status: Optional[Tensor], handle: int) -> Tensor:
    """The gradient of a bag lookup's per-sample weights (`third`)."""
    return _handles.lookup(handle).input_grads(weight, (first, second, third), out, grad, status)[2]


@_input_grad_op.register_fake
def _(weight, first, second, third, out, grad, status, handle):
    return torch.empty_like(third)


@torch.library.custom_op("embfuse::fused_update_", mutates_args=("weight", "state"))
def _update_op(weight: Tensor, state: list[Tensor], first: Tensor, second: Optional[Tensor],
               third: Optional[Tensor], grad: Tensor, status: Optional[Tensor], handle: int, size: int) -> None:
    call = _handles.lookup(handle)
    with call.fused.stepping(check_of(status), status, weight.device) as step:
        if step is not None:
            call.update(weight, dict(zip(call.fused.state, state)), (first, second, third), grad, status, step, size)


@_update_op.register_fake
def _(weight, state, first, second, third, grad, status, handle, size):
    return None


def _setup(ctx, inputs, output):
    anchor, weight, state, first, second, third, status, handle, size = inputs
    out = output if _handles.lookup(handle).saves_out else None
    ctx.save_for_backward(weight, first, second, third, status, out, *state)
    ctx.handle, ctx.size = handle, size


def _backward(ctx, grad):
    weight, first, second, third, status, out, *state = ctx.saved_tensors
    grad_third = None
    if ctx.needs_input_grad[5]:  # (before the rows change)
        grad_third = _input_grad_op(weight, first, second, third, out, grad, status, ctx.handle)
    _update_op(weight, state, first, second, third, grad.contiguous(), status, ctx.handle, ctx.size)
    return None, None, [None] * len(state), None, None, grad_third, None, None, None


_fused_lookup_op.register_autograd(_backward, setup_context=_setup)


def fused_embedding_bag_collection(fused: FusedOptimizer, weights, values, offsets, psw, plan, B, hot=None,
                                   check=None):
    """`embedding_bag_collection` whose backward updates `weights` with `fused` (the hot rows
    of `hot`, a HotRows, densely: optim/hot.py); `check`: the batch's deferred Check."""
    return _lookup(_CollectionCall, fused, (plan, hot), weights.detach(), check, B, values, offsets, psw)


def _unsupported(weight, scale_grad_by_freq, sparse, mode="sum"):
    check_fused_table(weight)
    if scale_grad_by_freq or sparse or mode == "max":
        raise ValueError("a fused optimizer supports sum, mean, sqrtn and wmean pooling without scale_grad_by_freq or "
                         "sparse")


def fused_embedding_bag(fused: FusedOptimizer, input, weight, offsets=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False, per_sample_weights=None,
                        include_last_offset=False, padding_idx=None, *, bounds_check=DEFAULT_BOUNDS_CHECK,
                        name="input"):
    """`embfuse.embedding_bag` whose backward updates `weight` with `fused` instead of a gradient."""
    _unsupported(weight, scale_grad_by_freq, sparse, mode)
    indices, offsets, psw, mode, padding_idx, check, _ = prepare_bags(
        input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
        include_last_offset, padding_idx, bounds_check, name, fold=True)
    return _lookup(_BagCall, fused, (mode, padding_idx), weight.detach(), check, 0, indices, offsets, psw)


def fused_embedding(fused: FusedOptimizer, input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                    scale_grad_by_freq=False, sparse=False, *, bounds_check=DEFAULT_BOUNDS_CHECK, name="input",
                    check=None):
    """`embfuse.embedding` whose backward updates `weight` with `fused` instead of a gradient.
    `check`: a deferred Check already made for these ids (EmbeddingCollection's), if any."""
    _unsupported(weight, scale_grad_by_freq, sparse)
    flat, keep, padding_idx, own = prepare_ids(input, weight, padding_idx, max_norm, norm_type, bounds_check, name)
    out = _lookup(_EmbeddingCall, fused, (padding_idx,), weight.detach(), check or own, 0, flat, keep, None)
    return out.view(*input.shape, weight.shape[1])
