"""The hot-row path of the collection step (interpreted on the CPU in CI) against the float64
reference of the sparse update, and its two passes over the values against torch."""

import pytest
import torch

from embfuse import EmbeddingBagCollection
from embfuse.ops.bags import ROW_START, backward_inputs, backward_inputs_reference
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from embfuse.optim import hot as hot_module
from embfuse.optim.fused import collection_update
from embfuse.optim.hot import HotRows, hot_update
from embfuse.optim.rules import init_state
from embfuse._triton import cdiv, launch
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels
from tests.nn.test_collection import random_kjt, tables
from tests.ops import test_collection
from tests.ops.test_collection import batch, plan
from tests.tolerances import assert_close

OPTIMIZERS = [SGD(lr=0.1, weight_decay=0.01), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1, weight_decay=0.01),
              RowWiseAdagrad(lr=0.1), Adam(lr=0.05, weight_decay=0.01)]
OPT_IDS = ["sgd", "adagrad", "rowwise", "rowwise-no-decay", "adam"]


def hot_rows(P, values, offsets, B, k):
    hot = HotRows(k, 1, P.num_rows, len(P.tables), values.device)
    hot.take(values, offsets, P, B)
    return hot


# 129 columns: two column blocks of the product; features 0 and 2 share table 0
WIDE_TABLES, WIDE_FEATURES = [(6, 129), (5, 8)], [(0, "sum"), (1, "mean"), (0, "mean")]


@requires_kernels
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("k, wide", [(3, False), (40, False), (3, True)], ids=["k3", "k40", "k3-wide"])
def test_hot_update_matches_the_reference(opt, k, wide, monkeypatch):
    """Mixed widths, a shared table, sum and mean, an empty feature and an empty bag; 80% of the
    ids on one row a table; k=40: every row hot, in two slot blocks; wide: 129 columns. Step
    2's hot set comes from another batch, whose hottest rows (row 0 of each table) batch 2
    does not touch: they must not move (weight decay and Adam would move them)."""
    B = 48
    if wide:
        monkeypatch.setattr(test_collection, "TABLES", WIDE_TABLES)
        monkeypatch.setattr(test_collection, "FEATURES", WIDE_FEATURES)
    P = plan(KERNEL_DEVICE)
    base = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    w, w64 = base.clone(), base.double()
    state = init_state(opt, P.num_rows, 0, KERNEL_DEVICE, P.num_elements)
    state64 = {k: v.double() for k, v in state.items()}
    other, other_offsets, _ = batch(B, KERNEL_DEVICE, max_len=40)
    other = torch.where(torch.rand(other.shape, device=KERNEL_DEVICE) < 0.8, 0, other)
    for step in (1, 2):
        values, offsets, _ = batch(B, KERNEL_DEVICE, max_len=40, hot=True)
        if step == 2:
            values = torch.where(values == 0, 1, values)
        hot = hot_rows(P, *((other, other_offsets) if step == 2 else (values, offsets)), B, k)
        grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE)
        before = w.clone()
        hot_update(w, list(state.values()), opt, values, offsets, P, B, grad, step, hot)
        collection_update(w64, state64, opt, values, offsets, None, P, B, grad.double(), step, kernel=False)
        assert_close(w, w64, torch.float32, reduction=len(values))
    for _, dim, elem, _ in P.tables:  # row 0 of every table, hot and untouched in step 2
        assert torch.equal(w[elem:elem + dim], before[elem:elem + dim])
    for k in state:
        assert_close(state[k], state64[k], torch.float32, reduction=len(values))


@requires_kernels
@pytest.mark.parametrize("dtype, wide_keys", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16", "64-bit-keys"])
def test_hot_update_in_bf16_and_with_64_bit_keys(dtype, wide_keys):
    B = 48
    P = plan(KERNEL_DEVICE)
    P.layout.wide_keys = wide_keys
    values, offsets, _ = batch(B, KERNEL_DEVICE, max_len=40, hot=True)
    hot = hot_rows(P, values, offsets, B, 3)
    w = torch.randn(P.num_elements, device=KERNEL_DEVICE).to(dtype)
    w64 = w.double()
    grad = torch.randn(B, P.total_dim, device=KERNEL_DEVICE).to(dtype)
    hot_update(w, [], SGD(lr=0.1), values, offsets, P, B, grad, 1, hot)
    collection_update(w64, {}, SGD(lr=0.1), values, offsets, None, P, B, grad.double(), 1, kernel=False)
    assert_close(w, w64, dtype, reduction=len(values))


@requires_kernels
@pytest.mark.parametrize("cap", [2048, 3])
def test_split_pass_keys_counts_and_packs_the_cold_values(cap):
    """Pass 1 against torch: a value is hot when its row has a slot and it sits before position
    `cap` of its bag; hot values count into C and get key -1. Pass 2 packs the rest in order."""
    B, k = 16, 2
    P = plan(KERNEL_DEVICE)
    values, offsets, _ = batch(B, KERNEL_DEVICE, max_len=12, hot=True)
    hot = hot_rows(P, values, offsets, B, k)
    n, FB, K = values.numel(), offsets.numel() - 1, hot.width
    dev = KERNEL_DEVICE
    keys = torch.full((n,), -7, dtype=torch.int32, device=dev)
    counts = torch.zeros(FB * K, device=dev)
    cold = torch.full((FB,), -7, dtype=torch.int32, device=dev)
    launch(hot_module._hot_split_kernel)[(cdiv(FB, 8),)](
        values, offsets, P.meta, hot.slot, keys, counts, cold, FB, B, P.meta.stride(0), K=K, CAP=cap,
        BAGS=8, BLOCK=32)
    want_keys, bag, _ = backward_inputs_reference(values, offsets, None, P.meta, B)
    position = torch.arange(n, device=dev) - offsets[bag]
    rows = P.meta[:, ROW_START][bag // B] + values
    slot = hot.slot[rows].long()
    is_hot = (slot >= 0) & (position < cap)
    assert torch.equal(keys.long(), torch.where(is_hot, -1, want_keys))
    want_counts = torch.zeros(FB, K, device=dev).index_put_(
        (bag[is_hot], slot[is_hot]), torch.ones(int(is_hot.sum()), device=dev), accumulate=True)
    assert torch.equal(counts.view(FB, K), want_counts)
    assert torch.equal(cold.long(), torch.bincount(bag[~is_hot], minlength=FB))
    # pass 2: the cold values' keys, bags and scales, packed in value order
    start = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), cold.long().cumsum(0)])
    m = int(start[-1])
    out = backward_inputs(keys, offsets, None, P.meta, B, wide_keys=False, scaled=True, kernel=True, cold=(start, m))
    _, _, want_scale = backward_inputs_reference(values, offsets, None, P.meta, B)
    assert torch.equal(out[0].long(), want_keys[~is_hot])
    assert torch.equal(out[1].long(), bag[~is_hot])
    assert torch.equal(out[2], want_scale[~is_hot])


@requires_kernels
@pytest.mark.parametrize("B", [0, 3])
def test_an_empty_batch_changes_nothing(B):
    P = plan(KERNEL_DEVICE)
    values = torch.zeros(0, dtype=torch.int64, device=KERNEL_DEVICE)
    offsets = torch.zeros(len(P.rows) * B + 1, dtype=torch.int64, device=KERNEL_DEVICE)
    w = torch.randn(P.num_elements, device=KERNEL_DEVICE)
    before = w.clone()
    hot = HotRows(4, 1, P.num_rows, len(P.tables), KERNEL_DEVICE)
    hot.take(values, offsets, P, B)
    hot_update(w, [], SGD(lr=0.1, weight_decay=0.1), values, offsets, P, B,
               torch.randn(B, P.total_dim, device=KERNEL_DEVICE), 1, hot)
    assert torch.equal(w, before)


@requires_kernels
def test_bags_past_the_cap_match_the_reference(monkeypatch):
    """Long bags with the cap at 3: every bag's later hot values take the cold path."""
    monkeypatch.setattr(hot_module, "HOT_CAP", 3)
    test_hot_update_matches_the_reference(SGD(lr=0.1), 3, False, monkeypatch)


def test_hot_set_is_taken_every_refresh_steps_and_after_a_step_back(monkeypatch):
    hot = HotRows(2, 3, 10, 1, "cpu")
    taken = []
    monkeypatch.setattr(hot, "take", lambda *args: taken.append(True))
    steps = [5, 6, 7, 8, 9, 10, 11, 2, 3]
    took = []
    for step in steps:
        n = len(taken)
        hot.maybe_refresh(None, None, None, 1, step)
        took.append(len(taken) > n)
    assert took == [True, False, False, True, False, False, True, True, False]


def test_hot_set_is_each_tables_most_looked_up_rows():
    B = 4
    P = plan("cpu")
    # table 0 (features 0 and 2): row 5 four times, row 2 three, row 9 twice; table 3: row 1
    lengths = torch.zeros(len(P.rows) * B, dtype=torch.int64)
    values = torch.tensor([5, 5, 2, 9, 5, 2, 2, 5, 9, 1])
    lengths[[0, 1, 2 * B, 2 * B + 1, 4 * B]] = torch.tensor([3, 2, 3, 1, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    hot = hot_rows(P, values, offsets, B, 2)
    assert hot.slot.tolist().count(-1) == P.num_rows - 3
    assert hot.slot[[5, 2]].tolist() == [0, 1]
    shift = P.layout.shift
    assert hot.keys[0, :3].tolist() == [5, 2, -1]
    assert hot.keys[3, :2].tolist() == [(3 << shift) + 1, -1]
    assert int(hot.slot[P.tables[3][3] + 1]) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt, dtype", [(SGD(lr=0.5, weight_decay=0.01), torch.float32),
                                        (Adam(lr=0.05), torch.float32), (SGD(lr=0.5), torch.bfloat16)],
                         ids=["sgd", "adam", "sgd-bf16"])
def test_collection_with_hot_rows_trains_like_without(device, opt, dtype):
    """On the GPU the hot path runs (hot set refreshed every 2 steps); on the CPU both take the
    reference."""
    configs = tables()
    for t in configs:
        t.data_type = dtype
    hot = EmbeddingBagCollection(configs, device=device, optimizer=opt, hot_rows=2, hot_refresh=2, hot_min_values=0)
    ref = EmbeddingBagCollection(configs, device=device, optimizer=opt)
    ref.load_state_dict(hot.state_dict())
    for _ in range(4):
        kjt = random_kjt(["uid", "friend", "iid", "genres"], 16, device)
        grad = torch.randn(16, 19, device=device).to(dtype)
        hot(kjt).values().backward(grad)
        ref(kjt).values().backward(grad)
    assert_close(hot.weights, ref.weights, dtype, reduction=40)
    assert (hot.hot_slot >= 0).any() == (device == "cuda")
    assert set(hot.state_dict()) == set(ref.state_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_small_batches_take_the_sparse_path(device):
    ebc = EmbeddingBagCollection(tables(), device=device, optimizer=SGD(lr=0.5), hot_rows=2)
    ebc(random_kjt(["uid", "friend", "iid", "genres"], 16, device)).values().sum().backward()
    assert ebc._hot.taken_at is None and not (ebc.hot_slot >= 0).any()


def test_hot_rows_refuse_a_weighted_collection():
    with pytest.raises(ValueError, match="unweighted"):
        EmbeddingBagCollection(tables(), is_weighted=True, optimizer=SGD(lr=0.1), hot_rows=8)


@pytest.mark.gpu
def test_a_captured_step_takes_the_sparse_path():
    """A step captured in a CUDA graph cannot read the host: it records the sparse path, and
    replays train like eager steps."""
    hot = EmbeddingBagCollection(tables(), device="cuda", optimizer=SGD(lr=0.5), bounds_check="off", hot_rows=2,
                                 hot_min_values=0)
    ref = EmbeddingBagCollection(tables(), device="cuda", optimizer=SGD(lr=0.5), bounds_check="off")
    ref.load_state_dict(hot.state_dict())
    kjt = random_kjt(["uid", "friend", "iid", "genres"], 16, "cuda")
    grad = torch.randn(16, 19, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager, on the hot path (warms up the sparse path's kernels too)
        hot(kjt).values().backward(grad)
        ref(kjt).values().backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hot(kjt).values().backward(grad)
    for _ in range(2):
        graph.replay()
        ref(kjt).values().backward(grad)
    assert_close(hot.weights, ref.weights, torch.float32, reduction=40)
