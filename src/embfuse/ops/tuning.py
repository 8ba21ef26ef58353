"""Launch rules of every kernel, in one place.

Each rule says in one line why it is what it is; the measurements behind it are in
benchmarks/NOTES.md, section "Launch rules" (which names the session and script of each).
Sizes may be SymInts while tracing: rules take plain arithmetic and only eager calls are cached.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from embfuse._triton import next_pow2

# ---- pooled lookups (ops/embedding_bag.py, ops/collection.py) ----


def bag_shape(D: int, avg_bag: float, overrides: dict | None = None, spread: bool = False) -> dict:
    """A pooling program: all of D up to 256 columns, rows stacked to about 256 elements a tile
    but no more than a bag holds, one warp. Within 3% of the best of an H100 sweep of 256-8192
    elements x 1-8 warps on fp32/fp16 x D 32/128 x uniform/power-law ids (NOTES: "bag shape").
    `spread` (few long bags, `spreads`): 512 elements and four warps instead.
    `overrides` (sweeps) replaces any of: elems, block_l, block_d, num_warps, evict."""
    cfg = {"elems": 512, "num_warps": 4, "evict": ""} if spread else {"elems": 256, "num_warps": 1, "evict": ""}
    cfg.update(overrides or {})
    block_d = cfg.get("block_d") or min(next_pow2(D), 256)
    block_l = cfg.get("block_l") or max(1, min(cfg["elems"] // block_d, 64, next_pow2(max(1, int(avg_bag)))))
    return {"BLOCK_L": block_l, "BLOCK_D": block_d, "num_warps": cfg["num_warps"], "EVICT": cfg["evict"]}


_bag_shape_cached = functools.lru_cache(maxsize=256)(bag_shape)

# weighted bags on tiles of at most this many columns unroll the pooling loop this many steps:
# ptxas unrolls the unweighted loop by itself, not the weighted one; at 128 columns the unroll
# lost on checked collections (NOTES: "weighted loop unroll")
WEIGHTED_UNROLL = (64, 4)
# bags with padding (or TensorFlow's skipped ids) count their pooled ids after the pooling loop,
# this many ids at a time (a bag's ids, just read, are in cache; NOTES: "padding count")
PADDING_COUNT_BLOCK = 32


class Spread(NamedTuple):
    """Where few long bags spread a program over four warps (bag_shape's `spread`), for one table
    element size."""
    bags: int  # bags a launch at most (FOLDED_BAGS at most where the launch also runs the check)
    avg_pow2: int  # their mean length, rounded up to a power of two, at least
    row_bytes: int  # bytes a row at least


# with one warp a bag, few bags leave most of the GPU's warp slots empty while each bag's steps
# wait on memory in turn. At 2048 bags the measurements split (collections of 4-8 features tied or
# gained up to 26%, of 1-2 features lost 3-11%). 2-byte tables: rows under 256 bytes tied or lost.
# With the check folded in (small eager calls), 1024 bags of 64 ids lost 5-45% while the same
# launch without it gained, in fp32 as in bf16 (NOTES: "bag shape, few long bags")
SPREAD = {4: Spread(1024, 64, 0), 2: Spread(1024, 64, 256)}
FOLDED_BAGS = 512  # a launch that also runs the batch's check (ops/deferred.py take_fold)


def spreads(bags: int, avg_pow2: int, D: int, element_size: int = 4, max_pool: bool = False,
            folded: bool = False) -> bool:
    """Whether a launch of `bags` bags of about `avg_pow2` ids, D wide, takes bag_shape's `spread`
    shape (SPREAD); never for max pooling, whose tiles carry two int64 index arrays (four warps
    lost there)."""
    rule = SPREAD.get(element_size)
    if rule is None or max_pool:
        return False
    return (bags <= (min(rule.bags, FOLDED_BAGS) if folded else rule.bags) and avg_pow2 >= rule.avg_pow2
            and D * element_size >= rule.row_bytes)


def pooling_shape(D: int, values: int, bags: int, overrides: dict | None = None, traced: bool = False,
                  element_size: int = 4, max_pool: bool = False, folded: bool = False) -> dict:
    """bag_shape for `values` ids over `bags` bags of width D (a table of `element_size`-byte
    elements, pooled by max or not, the check folded into the launch or not: `spreads`), cached
    for eager calls."""
    avg = next_pow2(max(1, values // max(1, bags)))
    spread = spreads(bags, avg, D, element_size, max_pool, folded)
    if overrides or traced:
        return bag_shape(D, avg, overrides, spread)
    return _bag_shape_cached(D, avg, None, spread)


# a program of the per-bag passes (the backward inputs, the hot split, the safe pass) takes this
# many bags side by side, this many ids of each at a time: one bag a program waited on its
# offsets; over six workloads 16 x 16 was at most 12% behind the fastest where it took over 10 us
# (32 x 8, tied in sum, up to 46%), 8 x 32 up to 1.7x slower on bags of 1-39 ids (NOTES: "bags a
# program", "One shape for the per-bag passes")
BAG_PASS_SHAPE = (16, 16)


def _gather_shape(D: int) -> tuple[int, int]:
    block_d = min(next_pow2(D), 256)
    return max(1, min(64, 2048 // block_d)), block_d


_gather_shape_cached = functools.lru_cache(maxsize=64)(_gather_shape)


def gather_shape(D: int, traced: bool = False) -> tuple[int, int]:
    """(ids, columns) a program of the plain embedding gather: 2048-element tiles, all of D up to
    256 columns (NOTES: "gather shape"); cached for eager calls (a small lookup is host-bound)."""
    return _gather_shape(D) if traced else _gather_shape_cached(D)


# ids a block of a keyed batch's check (NOTES: "check kernels", session 14)
CHECK_BLOCK = 1024
# ids a program of one table's check, and its warps: 4.2M int64 ids in 15.3 us against 17.6 at
# 1024 ids before its lanes counted in int32; 8 warps or 4096 ids no faster (NOTES: session 25)
IDS_CHECK_BLOCK = 2048
IDS_CHECK_WARPS = 4
# a check folded into a small lookup's launch (ops/deferred.py take_fold): batches of at most
# FOLD_IDS ids, whose time is the host's (a launch fewer saves tens of microseconds of it;
# NOTES: session 21, "the check folded in"); a check program of the lookup's one warp takes
# FOLD_BLOCK ids (all its loads at once: four steps of 256 cost 4.5 us more GPU time than the
# check's own launch)
FOLD_IDS = 1 << 19
# a lookup that may fold its check (no autograd gradient: a forward, or a fused update's; a
# collection's forward) of more than NARROW_IDS int64 ids into rows of at least NARROW_DIM
# elements reads them as the int32 its check also writes: pooling one or two rows a step, it
# gains 2-8.5% from int32 ids, more than the check's extra write (16.8 MB at B65536 L64: about
# 6 us); four or eight rows a step gain less. Smaller batches' host time hides nothing: the copy
# adds 12-19 us of it a call (8-9 of them its allocation, since halved). Walls on the H100: one table D128
# 1M ids lost (119 -> 137 us), 4.2M gained; the Criteo collection 2.7M lost (145 -> 178-225 us),
# 5.3M gained (NOTES: sessions 34, 35)
NARROW_IDS = 3 << 20
NARROW_DIM = 128


def narrows(D: int, ids: int) -> bool:
    return ids > NARROW_IDS and D >= NARROW_DIM


# the gather's (embedding) limit is lower: its 4-warp programs spin on the check's count and slow
# it down (65536 ids: 20.8 us of GPU time against 10.3 in two launches; 8192: 3.2 against 4.3)
FOLD_GATHER_IDS = 1 << 14
FOLD_BLOCK = 256
# feature starts a program of the keyed batch's check loads at once to find its blocks' features
# (ops/check_kernels.py _features_at); more features take more rounds
CHECK_FEATURES = 64
# warps a program of the keyed batch's check: with 4, its 8 ids a thread took 112 registers and
# left 25% occupancy on an H100, issue-bound (NOTES: session 16, "what bounds the check")
CHECK_WARPS = 8
# registers a thread of that check may take when a program takes several blocks (check_chunks),
# in eager launches: with the batch's counts not specialised (e2f8df3) Triton 3.6 gave it 73-74,
# three blocks an SM; held to 64 (two spilled) it runs four and was 10-13% faster on an H200. With
# one block it takes 40, under the cap already (NOTES: session 66, "the keyed check's registers").
# A traced launch takes Triton's own count: torch 2.11's wrap_triton passes no maxnreg
CHECK_MAXNREG = 64
# entries a program of the variable-batch padding (ops/vbe.py): an elementwise pass of a few
# hundred thousand entries, the check's block size, not tuned on its own
PAD_BLOCK = 1024


def check_chunks(n: int) -> int:
    """Blocks of CHECK_BLOCK values a keyed batch's check program takes: 4 where that still makes
    two waves of programs on an H100 (528 at a time), else 1; the fastest of 1, 2, 4 and 8 from
    1.3M to 21M ids (benchmarks/NOTES.md, session 47)."""
    return 4 if n >= 2 * 4 * CHECK_BLOCK * 528 else 1

# ---- the segment reduction (ops/segments.py) and the fused optimizers (optim/) ----

# levels of at most this many entries take the small-level tile shape (see level_shape)
SMALL_LEVEL = 65536
# levels of at most this many entries run as one tree in one launch (ops/segments.py); larger ones
# are GPU-bound and a launch each. H100, the Criteo step: all upper levels as one tree took 268 us
# of GPU time at B16384 (level 2: 1.3M entries) against 234 in five launches, and 58 against 66 at
# B2048 (level 2: 166K), where it also saved three launches of host time (NOTES: "the upper
# levels in one launch")
TREE_LEVEL = 1 << 19
# columns a program of the gradient kernel takes: whole rows (64 showed no gain above the bench's
# spread; NOTES: "gradient columns")
GRAD_COLUMNS = None


def level_shape(block_d: int, n: int) -> tuple[int, int]:
    """(entries a tile, warps) of a level of n entries. Large levels: 32 entries, one a lane, one
    warp up to 128 columns, so run sums are a scan in each thread's registers (16 recomputes
    per-entry values in every thread; larger tiles or more warps spill or scan across warps).
    Small levels (at most SMALL_LEVEL): the host's launches dominate, so tiles of about 8192
    values and 8 warps make fewer levels (NOTES: "level shape")."""
    if n <= SMALL_LEVEL:
        return max(16, min(64, 8192 // block_d)), 8
    return 32, max(1, min(8, block_d // 128))


def update_columns(element_states: int):
    """Columns a program of the fused update takes: whole rows without element-wise state (SGD;
    row-wise Adagrad needs them), 64 with one state tile beside the weights, 32 with two
    (NOTES: "update columns")."""
    return 128 >> element_states if element_states else None


def update_in_quarters(element_states: int, width: int) -> bool:
    """Whether a fused-update program updates its tile a quarter of the rows at a time (else a
    half): with element-wise state, or at 128 columns and more, where the summed rows, weights
    and state of a whole tile spill (NOTES: "update groups")."""
    return element_states > 0 or width >= 128


# ---- the hot-row path (optim/hot.py) ----

# bags a program of the dense hot-row product takes (NOTES: "hot rows")
BAGS_PER_SPLIT = 1024
# batches with fewer values take the sparse path: below it the extra launches and the host read
# cost more than the dense product saves (NOTES: "hot rows", the size sweep)
HOT_MIN_VALUES = 1 << 23


def product_shape(K: int) -> dict:
    """The hot-row product's program: at most 32 slots (64 took Hopper's wgmma path with 147 KB
    of shared memory, one program an SM, 4.4x slower), 32 bags a product, 4 warps, 2 stages."""
    return dict(KB=min(K, 32), BB=32, num_warps=4, num_stages=2)


# ---- the CPU paths (ops/collection.py collection_native) ----

# a CPU collection whose features share one width and one pooling looks up every feature in one
# native call when its output has fewer elements; past that the per-feature calls won (they skip
# the output's transposing copy; NOTES: session 65, "one call")
CPU_ONE_CALL_OUTPUT = 1 << 18
