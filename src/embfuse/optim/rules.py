"""Sparse optimizers: the update rules, written once in torch for the CPU path and the tests.

Each touched row r gets its summed gradient g (duplicates in a batch summed first, as FBGEMM's
exact optimizers do); L2 weight decay adds weight_decay * w to g, as torch.optim does. Rows no id
touches are left alone (lazy), which equals torch.optim on the dense gradient for SGD and Adagrad
(a zero gradient changes neither their weights nor their state) and for Adam on rows whose
moments are zero. Argument names and defaults are torch.optim's.

fp16 and bf16 tables keep fp32 state; with `stochastic_rounding=True` (keyword only) their
updated weights are rounded up or down at random, in proportion to the distance to each
neighbour (unbiased: small updates are not lost to round-to-nearest). The random bits come from
the step number and the element's position, so a run resumed from a checkpoint rounds the same.

`update(w, g, state, step)` returns the touched rows' new weights and state. `w` and the state's
tensors are the caller's own copies of those rows (gathers), which an update may overwrite: each
saves a buffer the size of the rows (the CPU step's largest; benchmarks/NOTES.md, session 66).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from embfuse._triton import constexprs

# which rule a fused kernel applies
SGD_KIND, ADAGRAD_KIND, ROWWISE_ADAGRAD_KIND, ADAM_KIND = 0, 1, 2, 3
K_SGD_KIND, K_ADAGRAD_KIND, K_ROWWISE_ADAGRAD_KIND, K_ADAM_KIND = constexprs(0, 1, 2, 3)


class Hyper(NamedTuple):
    """A rule's hyper-parameters for one step, by name: what the fused kernels read (the update
    kernel takes these fields as its scalar arguments, in this order, and hands them on as one
    Hyper). A new hyper-parameter is a field here and in `_fused_update_kernel`'s signature and
    GRAPH_HYPER loads."""

    lr: float
    eps: float = 0.0
    weight_decay: float = 0.0
    # Adam's 1 - beta1 and 1 - beta2, taken on the host in double: in fp32 on the device, 1 - 0.999
    # is 1.3e-5 off (relative), which moved every update by about 6e-6 (benchmarks/NOTES.md, session 50)
    one_minus_beta1: float = 0.0
    one_minus_beta2: float = 0.0
    bc2_sqrt: float = 1.0  # sqrt of Adam's second bias correction


class GraphStep(NamedTuple):
    """A captured update's step (FusedOptimizer.stepping): the GPU's float64 copy of Hyper's
    fields and the step, which the graph advances on a side stream beside the backward's first
    passes, and the event recorded there after it."""

    hyper: torch.Tensor
    ready: torch.cuda.Event


def joined(step):
    """What an update reads as its step: the host's number, or a graph's copy once the current
    stream has waited for the side stream that advanced it."""
    if isinstance(step, GraphStep):
        torch.cuda.current_stream(step.hyper.device).wait_event(step.ready)
        return step.hyper
    return step


HYPER_STEP = len(Hyper._fields)  # the step's place after Hyper's fields in a graph's float64 copy (_Rule.graph_hyper)
(K_HYPER_STEP,) = constexprs(HYPER_STEP)
# mantissa bits that rounding an fp32 value to the table's dtype drops
DROPPED_BITS = {torch.bfloat16: 16, torch.float16: 13}


# hyper-parameters that must be finite and >= 0, as torch.optim requires of its own
NON_NEGATIVE = ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value")


def _sqrt(x):
    """math.sqrt, or torch.sqrt of a step's tensor (graph_hyper): no read back to the host."""
    return x.sqrt() if isinstance(x, torch.Tensor) else math.sqrt(x)


def _number(rule: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{rule}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{rule}: {name} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class _Rule:
    stochastic_rounding: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        """torch.optim's checks, at construction: numbers, finite, lr / eps / decays >= 0, each
        beta in [0, 1)."""
        rule = type(self).__name__
        for name in NON_NEGATIVE:
            if hasattr(self, name) and _number(rule, name, getattr(self, name)) < 0:
                raise ValueError(f"{rule}: {name} must be >= 0, got {getattr(self, name)}")
        betas = getattr(self, "betas", None)
        if betas is not None:
            if len(betas) != 2:
                raise ValueError(f"{rule}: betas must be a pair, got {betas!r}")
            for i, beta in enumerate(betas):
                if not 0.0 <= _number(rule, f"betas[{i}]", beta) < 1.0:
                    raise ValueError(f"{rule}: betas[{i}] must be in [0, 1), got {beta}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"{rule}: stochastic_rounding must be True or False, got {self.stochastic_rounding!r}")

    def decayed(self, g, w):
        """g with L2 weight decay added, only when there is some (torch.optim's rule, and the
        kernels' WD: no 0 * w term, which is NaN on an inf weight and a pass over the rows)."""
        return g + self.weight_decay * w if self.weight_decay else g

    @property
    def element_states(self) -> int:
        """How many element-wise state tensors the rule keeps (Adagrad 1, Adam 2)."""
        return sum(per == "element" for per, _ in self.state_spec().values())

    def dropped_bits(self, dtype) -> int:
        """Bits to round away at random when storing to `dtype` (0: round to nearest)."""
        return DROPPED_BITS.get(dtype, 0) if self.stochastic_rounding else 0

    def per_step(self) -> tuple[int, ...]:
        """The fields of `hyper` that change from step to step (bias corrections, lr_decay), and
        HYPER_STEP when the update reads the step itself (stochastic rounding's seed): what a
        CUDA graph must take from the GPU's count of steps (graph_hyper)."""
        first, second = self.hyper(1), self.hyper(2)
        fields = tuple(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        return fields + ((HYPER_STEP,) if self.stochastic_rounding or fields else ())

    def graph_hyper(self, hyper: torch.Tensor, good) -> None:
        """Inside a CUDA graph: advance the step count held in `hyper` (float64: Hyper's fields,
        then the step; FusedOptimizer keeps it) by `good` (1, or a device bool: the batch passed
        its check) and write the fields that follow it, with torch ops the graph replays. The
        same formulas as `hyper`, in float64 on the GPU."""
        hyper[HYPER_STEP].add_(good)
        fields = self.hyper(hyper[HYPER_STEP])
        for i in self.per_step():
            if i != HYPER_STEP:
                hyper[i].copy_(fields[i])


def stochastic_round_reference(x: torch.Tensor, dtype, drop: int, seed: int) -> torch.Tensor:
    """fp32 `x` to `dtype`, adding `drop` random low bits to the magnitude before clearing them
    (rounds away from zero with probability equal to the dropped fraction). Its own random bits
    from `seed`: equal in distribution to the kernel's, not bitwise."""
    if drop == 0:
        return x.to(dtype)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randint(0, 1 << drop, x.shape, generator=gen, device=x.device, dtype=torch.int64)
    bits = (x.float().view(torch.int32).long() & 0xFFFFFFFF) + noise
    bits = bits & (0xFFFFFFFF ^ ((1 << drop) - 1))
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32).to(dtype)


@dataclass(frozen=True)
class SGD(_Rule):
    lr: float = 1e-3
    weight_decay: float = 0.0
    kind = SGD_KIND

    def state_spec(self):
        """name -> (per "row" or per "element", initial value); all state is fp32."""
        return {}

    def hyper(self, step: int) -> Hyper:
        """The hyper-parameters of step `step` (from 1)."""
        return Hyper(lr=self.lr, weight_decay=self.weight_decay)

    def update(self, w, g, state, step):
        return w.add_(self.decayed(g, w), alpha=-self.lr), state


@dataclass(frozen=True)
class Adagrad(_Rule):
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    kind = ADAGRAD_KIND

    def state_spec(self):
        return {"sum": ("element", self.initial_accumulator_value)}

    def hyper(self, step):
        return Hyper(lr=self.lr / (1 + (step - 1) * self.lr_decay), eps=self.eps, weight_decay=self.weight_decay)

    def update(self, w, g, state, step):
        lr = self.hyper(step).lr
        g = self.decayed(g, w)
        s = state["sum"].addcmul_(g, g)
        return w.addcdiv_(g, s.sqrt().add_(self.eps), value=-lr), {"sum": s}


@dataclass(frozen=True)
class RowWiseAdagrad(_Rule):
    """FBGEMM's row-wise Adagrad: one accumulator per row, fed the mean of g^2 over the row."""

    lr: float = 1e-2
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    kind = ROWWISE_ADAGRAD_KIND

    def state_spec(self):
        return {"sum": ("row", self.initial_accumulator_value)}

    def hyper(self, step):
        return Hyper(lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)

    def update(self, w, g, state, step):
        g = self.decayed(g, w)
        s = state["sum"] + (g * g).mean(dim=1)
        return w.addcdiv_(g, s.sqrt().add_(self.eps)[:, None], value=-self.lr), {"sum": s}


@dataclass(frozen=True)
class Adam(_Rule):
    """torch.optim.Adam's rule on the touched rows only (lazy, like torch.optim.SparseAdam; the
    step count is global, one per backward)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    kind = ADAM_KIND

    def state_spec(self):
        return {"exp_avg": ("element", 0.0), "exp_avg_sq": ("element", 0.0)}

    def hyper(self, step):
        """lr arrives divided by the first bias correction."""
        b1, b2 = self.betas
        return Hyper(lr=self.lr / (1 - b1**step), eps=self.eps, weight_decay=self.weight_decay, one_minus_beta1=1 - b1,
                     one_minus_beta2=1 - b2, bc2_sqrt=_sqrt(1 - b2**step))

    def update(self, w, g, state, step):
        lr_t, eps, _, c1, c2, bc2_sqrt = self.hyper(step)
        g = self.decayed(g, w)
        m = state["exp_avg"].lerp_(g, c1)
        v = state["exp_avg_sq"].lerp_(g * g, c2)
        return w.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-lr_t), {"exp_avg": m, "exp_avg_sq": v}


def init_state(optimizer, num_rows: int, dim: int, device, num_elements: int | None = None) -> dict[str, torch.Tensor]:
    """fp32 optimizer state, whatever the table's dtype: per row (num_rows,) and per element
    (num_rows, dim) for one table; per element (num_elements,) for a collection's flat buffer
    (num_elements given; num_rows then counts the global rows of every table)."""
    out = {}
    for name, (per, value) in optimizer.state_spec().items():
        shape = (num_rows,) if per == "row" else (num_rows, dim) if num_elements is None else (num_elements,)
        out[name] = torch.full(shape, float(value), dtype=torch.float32, device=device)
    return out
