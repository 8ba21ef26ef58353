"""TensorFlow's safe lookup rules over a keyed batch, in one pass before the pooling.

`tf.nn.safe_embedding_lookup_sparse` drops ids < 0 (and, for the mean and sqrtn combiners,
entries whose weight is <= 0) and gives every row left without ids its `default_id` with weight
1 (or zeros without one). Dropping would change sizes (a host read, or a compaction of the
batch); here nothing moves: an entry TensorFlow drops stays where it is as an id < 0 (its own,
or SKIPPED where its weight drops it; weight 0 in a weighted batch), which the kernels of a batch
that skips pass over like padding (ops/bags.py NEGATIVE_IDS): no row is read, nothing is added to
the weighted sum, the weights' sum (wmean) or sum of squares (sqrtn), and no row is touched by
the backward (a fused Adam would otherwise move rows TensorFlow never looked up). So rules that
only drop ids < 0 leave the batch as it came. A feature with a default id gets one more entry a
bag, after the bag's own: the default id with weight 1 when the bag kept nothing, else SKIPPED.
The batch that comes out has n + B * (features with a default) values, a size known on the host,
and carries weights only if it came with them: without, every entry weighs 1 and an id < 0
nothing, which the kernels read from the ids (written weights would make the pooling weighted,
which is slower: benchmarks/NOTES.md, session 53).

A feature's rule is a row of `rules` (int64): its flags (DROP_NEGATIVE, DROP_WEIGHTS,
HAS_DEFAULT), its default id, and how many features before it have a default (B default entries
each come before its first bag). Features without flags pass through unchanged.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from embfuse._triton import cdiv, constexprs, kernel_op, launch, tl, tracing, triton, use_kernels
from embfuse.ops.bags import K_SKIPPED, SKIPPED, bag_of_value, guard_bags, index_sum, program_bags
from embfuse.ops import tuning

DROP_NEGATIVE, DROP_WEIGHTS, HAS_DEFAULT = 1, 2, 4
K_DROP_NEGATIVE, K_DROP_WEIGHTS, K_HAS_DEFAULT = constexprs(DROP_NEGATIVE, DROP_WEIGHTS, HAS_DEFAULT)
FLAGS, DEFAULT_ID, DEFAULTS_BEFORE = range(3)  # a rule's columns
RULE_COLUMNS = 3
K_FLAGS, K_DEFAULT_ID, K_DEFAULTS_BEFORE, K_RULE_COLUMNS = constexprs(FLAGS, DEFAULT_ID, DEFAULTS_BEFORE, RULE_COLUMNS)


# TensorFlow's combiner -> the bag module's pooling (its mean is over the weights' sum: wmean)
POOLING = {"sum": "sum", "mean": "wmean", "sqrtn": "sqrtn"}


def safe_rule(combiner: str, weighted: bool, default_id: Optional[int]) -> tuple:
    """safe_embedding_lookup_sparse's rule for a feature pooled by `combiner`: ids < 0 dropped,
    weights <= 0 too when weighted and the combiner is not sum, the default id (or None)."""
    return (True, weighted and combiner != "sum", default_id)


class Rules(NamedTuple):
    """Every feature's rule: `table` (F, 3) on the device; on the host, `defaults`, how many
    features have a default id (a batch of B samples gains B * defaults entries), and whether
    any feature drops weights <= 0."""

    table: Tensor
    defaults: int
    drops_weights: bool


def safe_rules(features: list[tuple[bool, bool, Optional[int]]], device) -> Rules:
    """The rules of features given as (drops ids < 0, drops weights <= 0, default id or None)."""
    rows, before = [], 0
    for drop_negative, drop_weights, default in features:
        flags = DROP_NEGATIVE * drop_negative + DROP_WEIGHTS * drop_weights + HAS_DEFAULT * (default is not None)
        rows.append([flags, 0 if default is None else default, before])
        before += default is not None
    return Rules(torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, RULE_COLUMNS), before,
                 any(drop_weights for _, drop_weights, _ in features))


def feature_rules(safe: Optional[list], rows: Tensor) -> tuple[Optional[Rules], Tensor]:
    """Features' rules (each a safe_rule tuple, or None for a feature without one) as (Rules, or
    None when no feature has one; the check's bounds: each feature's table rows, negated for the
    features whose ids < 0 are dropped, which the check then lets through)."""
    if safe is None or all(r is None for r in safe):
        return None, rows
    drops = torch.tensor([r is not None and r[0] for r in safe], device=rows.device)
    return safe_rules([r or (False, False, None) for r in safe], rows.device), torch.where(drops, -rows, rows)


def safe_bags_reference(values: Tensor, offsets: Tensor, psw: Optional[Tensor], rules: Tensor, B: int,
                        extra: int, dtype=torch.float32) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Pure torch (CPU path and test oracle): (values, offsets, weights or None without `psw`)
    after the rules (`rules`: Rules.table), `extra` = B * Rules.defaults default entries placed
    after their bags' own."""
    dev, n, FB = values.device, values.numel(), offsets.numel() - 1
    B = max(B, 1)
    bag = bag_of_value(offsets, n).clamp(0, max(FB - 1, 0))
    rule = rules[bag // B]
    v = values.long()
    w = torch.ones(n, dtype=dtype, device=dev) if psw is None else psw.to(dtype)
    keep = ~(((rule[:, FLAGS] & DROP_NEGATIVE) != 0) & (v < 0))
    keep &= ~(((rule[:, FLAGS] & DROP_WEIGHTS) != 0) & (w <= 0))
    g = torch.arange(FB, device=dev)
    has_default = (rules[g // B, FLAGS] & HAS_DEFAULT) != 0
    shift = rules[g // B, DEFAULTS_BEFORE] * B + torch.where(has_default, g % B, 0)  # defaults before bag g
    new_offsets = offsets.long() + torch.cat([shift, shift[-1:] + has_default[-1:].long()]) if FB else offsets.long()
    # one slot past the end takes the writes of bags without a default (no host read to skip them)
    out_v = torch.zeros(n + extra + 1, dtype=values.dtype, device=dev)
    out_w = torch.zeros(n + extra + 1, dtype=dtype, device=dev)
    at = torch.arange(n, device=dev) + shift[bag] if FB else torch.arange(n, device=dev)
    out_v[at] = torch.where(keep, values, SKIPPED)
    out_w[at] = torch.where(keep, w, 0)
    kept = index_sum(FB, bag, keep.long())
    last = torch.where(has_default, new_offsets[1:] - 1, n + extra)
    out_v[last] = torch.where(kept == 0, rules[g // B, DEFAULT_ID], SKIPPED).to(values.dtype)
    out_w[last] = (kept == 0).to(dtype)
    return out_v[:-1], new_offsets.to(offsets.dtype), None if psw is None else out_w[:-1]


# (a batch's counts are not specialised: optim/fused.py _fused_update_kernel says why)
@triton.jit(do_not_specialize=["n", "FB", "B", "extra"])
def _safe_bags_kernel(values, offsets, psw, status, rules, out_v, out_off, out_w, n, FB, B, extra,
                      HAS_PSW: tl.constexpr, STATUS: tl.constexpr, BAGS: tl.constexpr, BLOCK: tl.constexpr):
    """BAGS bags a program: each bag's entries copied BLOCK at a time, dropped ones as SKIPPED
    (with weight 0 under HAS_PSW), then its default entry. A batch its check found bad writes
    empty bags (offsets 0)."""
    g, real, f = program_bags(FB, B, BAGS)
    start = tl.load(offsets + g, mask=real, other=0).to(tl.int64)
    end = tl.load(offsets + g + 1, mask=real, other=0).to(tl.int64)
    flags = tl.load(rules + f * K_RULE_COLUMNS + K_FLAGS, mask=real, other=0)
    default = tl.load(rules + f * K_RULE_COLUMNS + K_DEFAULT_ID, mask=real, other=0)
    has_default = (flags & K_HAS_DEFAULT) != 0
    before = tl.load(rules + f * K_RULE_COLUMNS + K_DEFAULTS_BEFORE, mask=real, other=0)
    shift = before * B + tl.where(has_default, g - f * B, 0)
    if STATUS:
        good = tl.load(status + g * 0) == 0  # (one address for every lane)
        real = real & good
        start = tl.where(good, start, 0)
        end = tl.where(good, end, 0)
        shift = tl.where(good, shift, 0)
    drop_neg = ((flags & K_DROP_NEGATIVE) != 0)[:, None]
    drop_w = ((flags & K_DROP_WEIGHTS) != 0)[:, None]
    kept = tl.zeros([BAGS], dtype=tl.int32)
    for i in range(0, tl.max(end - start), BLOCK):
        p = start[:, None] + i + tl.arange(0, BLOCK)[None, :]
        m = p < end[:, None]
        v = tl.load(values + p, mask=m, other=0)
        w = tl.full([BAGS, BLOCK], 1.0, tl.float32)
        if HAS_PSW:
            w = tl.load(psw + p, mask=m, other=0.0).to(tl.float32)
        keep = m & ~(drop_neg & (v < 0)) & ~(drop_w & (w <= 0))
        kept += tl.sum(keep.to(tl.int32), axis=1)
        at = p + shift[:, None]
        tl.store(out_v + at, tl.where(keep, v, K_SKIPPED).to(out_v.dtype.element_ty), mask=m)
        if HAS_PSW:
            tl.store(out_w + at, tl.where(keep, w, 0.0).to(out_w.dtype.element_ty), mask=m)
    last = end + shift  # the default entry's place: right after the bag's own
    tl.store(out_v + last, tl.where(kept == 0, default, K_SKIPPED).to(out_v.dtype.element_ty), mask=real & has_default)
    if HAS_PSW:
        tl.store(out_w + last, (kept == 0).to(out_w.dtype.element_ty), mask=real & has_default)
    tl.store(out_off + g, start + shift, mask=g < FB)
    tl.store(out_off + FB + g * 0, n + extra + g * 0, mask=g == FB - 1)


def safe_bags(values: Tensor, offsets: Tensor, psw: Optional[Tensor], rules: Rules, B: int,
              status: Optional[Tensor] = None, dtype=torch.float32, kernel: Optional[bool] = None,
              strides: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The batch (canonical F * B + 1 offsets, checked or trusted) after the rules: (values,
    offsets, weights in `dtype`, None when `psw` is None). `status`: the batch's deferred check;
    the pass writes a bad batch as empty bags. One launch on the GPU, torch ops elsewhere (`kernel`
    forces either: True runs the kernel interpreted in CPU tests); rules that only drop ids < 0
    leave the batch as it came (_drop_negative_ids; a bad batch to its status, which its readers
    take). `strides`: a batch whose features have their own batch sizes (one a feature, on the
    device), padded to B bags each (nn/vbe.py one_stride), whose padding bags then take no default
    id (_skip_padding_defaults)."""
    if not rules.defaults and not rules.drops_weights:
        return values, offsets, _drop_negative_ids(values, psw, dtype)
    extra = B * rules.defaults
    if kernel is None:
        kernel = use_kernels(values) and dtype != torch.float64
    if not kernel:
        out_v, out_off, out_w = _safe_bags_torch(values, offsets, psw, status, rules.table, B, extra, dtype)
    elif tracing():  # one opaque op in a traced graph (its weights are empty without psw: an op returns tensors)
        out_v, out_off, out_w = _safe_bags_op(values, offsets, psw, status, rules.table, B, extra, dtype)
        out_w = None if psw is None else out_w
    else:
        out_v, out_off, out_w = safe_bags_kernel(values, offsets, psw, status, rules.table, B, extra, dtype)
    if strides is not None and rules.defaults:
        out_v, out_w = _skip_padding_defaults(out_v, out_off, out_w, rules.table, strides, B)
    return out_v, out_off, out_w


def _drop_negative_ids(values: Tensor, psw: Optional[Tensor], dtype) -> Optional[Tensor]:
    """safe_bags's weights where the rules only drop ids < 0: the ids stay as they came (every
    kernel and reference of a batch that skips passes over each id < 0), and each id < 0 weighs 0
    (the sharded paths sum the weights as given: distributed/routing.py)."""
    return None if psw is None else torch.where(values < 0, 0, psw.to(dtype))


def _skip_padding_defaults(values: Tensor, offsets: Tensor, psw: Optional[Tensor], rules: Tensor, strides: Tensor,
                           B: int) -> tuple[Tensor, Optional[Tensor]]:
    """(values, weights) with the padding bags' default entries SKIPPED (weight 0): TensorFlow
    looks nothing up for a bag that is not in its batch, and a fused update with weight decay (or
    Adam's) would otherwise move the default row. Torch ops, no host read."""
    FB = offsets.numel() - 1
    if FB == 0:
        return values, psw
    g = torch.arange(FB, device=values.device)
    f = g // B
    padding = ((rules[f, FLAGS] & HAS_DEFAULT) != 0) & (g - f * B >= strides[f])
    n = values.numel()
    at = torch.where(padding, offsets[1:].long() - 1, n)  # (a bag's default entry is its last; n: none)
    values = torch.cat([values, values.new_zeros(1)]).index_fill_(0, at, SKIPPED)[:n]
    if psw is not None:
        psw = torch.cat([psw, psw.new_zeros(1)]).index_fill_(0, at, 0)[:n]
    return values, psw


def _safe_bags_torch(values, offsets, psw, status, rules, B, extra, dtype):
    if status is not None:  # a bad batch: guarded to ids 0 in one bag (the callers pool nothing of it)
        values, offsets = guard_bags(values, offsets, status)
    return safe_bags_reference(values, offsets, psw, rules, B, extra, dtype)


def safe_bags_kernel(values, offsets, psw, status, rules, B, extra, dtype):
    """The Triton launcher (`rules`: Rules.table, `extra`: the default entries added)."""
    n, FB = values.numel(), offsets.numel() - 1
    out_v = torch.empty(n + extra, dtype=values.dtype, device=values.device)
    out_off = torch.empty_like(offsets)
    out_w = None if psw is None else torch.empty(n + extra, dtype=dtype, device=values.device)
    if FB == 0:
        out_off.fill_(n + extra)  # (no bags: the one offset)
        return out_v, out_off, out_w
    bags, block = tuning.BAG_PASS_SHAPE
    launch(_safe_bags_kernel)[(cdiv(FB, bags),)](
        values, offsets, psw, status, rules, out_v,
        out_off, out_w, n, FB, max(B, 1), extra, HAS_PSW=psw is not None, STATUS=status is not None,
        BAGS=bags, BLOCK=block)
    return out_v, out_off, out_w


@kernel_op("embfuse::safe_bags", mutates_args=())
def _safe_bags_op(values: Tensor, offsets: Tensor, psw: Optional[Tensor], status: Optional[Tensor], rules: Tensor,
                  B: int, extra: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    if use_kernels(values) and dtype != torch.float64:
        out = safe_bags_kernel(values, offsets, psw, status, rules, B, extra, dtype)
    else:
        out = _safe_bags_torch(values, offsets, psw, status, rules, B, extra, dtype)
    return out if psw is not None else (*out[:2], torch.empty(0, dtype=dtype, device=values.device))


@_safe_bags_op.register_fake
def _(values, offsets, psw, status, rules, B, extra, dtype):
    n = values.numel()
    return (values.new_empty(n + extra), torch.empty_like(offsets),
            torch.empty(0 if psw is None else n + extra, dtype=dtype, device=values.device))
