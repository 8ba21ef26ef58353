"""Sharded collections against the unsharded one fed every rank's batch, on gloo with 2 and 3
ranks: outputs, gradients, and the tables and optimizer state after several fused steps, for
each sharding type and mixed plans; errors on one rank raised on all; checkpoints."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import embfuse.distributed as ed
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PaddedKeyedJaggedTensor
from embfuse.ops import errors as embfuse_errors
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.distributed.worlds import free_port, run_world
from tests.tolerances import assert_close

FEATURES = {"uid": 20, "friend": 20, "iid": 9, "genres": 5, "ad": 7}


def tables(dtype=torch.float32, weighted=False, tf=False):
    if tf:  # TensorFlow's combiners (default ids on a shared table and on mean) beside a TorchRec table
        return [EmbeddingBagConfig(20, 4, "user", dtype, ["uid", "friend"], combiner="sum", default_id=3),
                EmbeddingBagConfig(9, 3, "item", dtype, ["iid"], combiner="mean", default_id=0),
                EmbeddingBagConfig(5, 8, "genre", dtype, ["genres"], combiner="sqrtn"),
                EmbeddingBagConfig(7, 1, "ad", dtype, ["ad"], pooling="mean")]
    # mixed widths (D = 1 too), a shared table, every pooling (weighted: sum and sqrtn)
    mean = "sum" if weighted else "mean"
    return [EmbeddingBagConfig(20, 4, "user", dtype, ["uid", "friend"]),
            EmbeddingBagConfig(9, 3, "item", dtype, ["iid"], pooling=mean),
            EmbeddingBagConfig(5, 8, "genre", dtype, ["genres"], pooling="sqrtn"),
            EmbeddingBagConfig(7, 1, "ad", dtype, ["ad"], pooling=mean)]


KEYS = ["uid", "friend", "iid", "genres", "ad"]
PLANS = {
    "table_wise": {t: "table_wise" for t in ("user", "item", "genre", "ad")},
    "row_wise": {t: "row_wise" for t in ("user", "item", "genre", "ad")},
    "column_wise": {t: "column_wise" for t in ("user", "item", "genre", "ad")},
    "mixed": {"user": "row_wise", "item": ("table_wise", 1), "genre": "column_wise", "ad": "row_wise"},
    "auto": None,
    # features already in send order (ranks ascending with the tables)
    "in_order": {"user": ("table_wise", 0), "item": ("table_wise", 0), "genre": ("table_wise", 1),
                 "ad": ("table_wise", 1)},
    "mixed_unplaced": {"user": "row_wise", "item": "table_wise", "genre": "column_wise", "ad": "row_wise"},
}


def batch(rank, step, weighted, B=None, tf=False):
    """Rank `rank`'s batch of step `step`: per key (lengths, ids, weights); B = 3 + rank. `tf`:
    about a third of the TensorFlow-style features' ids < 0, and weights down to -0.1 (what
    TensorFlow's rules drop)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    B = 3 + rank if B is None else B
    out = {}
    for k in KEYS:
        lengths = torch.randint(0, 4, (B,), generator=g)
        if B:
            lengths[0] = 0
        ids = torch.randint(0, FEATURES[k], (int(lengths.sum()),), generator=g)
        w = torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None
        if tf and k != "ad":
            ids = torch.where(torch.rand(ids.shape, generator=g) < 0.35, -1 - ids, ids)
            w = None if w is None else w - 0.6
        out[k] = (lengths, ids, w)
    return out


def kjt_of(parts, weighted):
    lengths = torch.cat([parts[k][0] for k in KEYS])
    values = torch.cat([parts[k][1] for k in KEYS])
    w = torch.cat([parts[k][2] for k in KEYS]) if weighted else None
    return KeyedJaggedTensor(KEYS, values, w, lengths=lengths)


def concat(batches):
    """The batches of every rank as one batch, rank after rank, per feature."""
    return {k: tuple(None if b[k][i] is None else torch.cat([x[k][i] for x in batches]) for i in range(3))
            for k, b in [(k, batches[0]) for k in KEYS]}


def grad_weights(B, width, step, rank):
    return torch.randn(B, width, generator=torch.Generator().manual_seed(77 + 31 * step + rank))


def _compare(rank, world, plan_name, optimizer, dtype, weighted, steps, device="cpu", hot_rows=0, sizes=None,
             tf=False):
    """`sizes`: each rank's batch size (3 + rank when None); `tf`: TensorFlow-style tables."""
    sizes = [3 + r for r in range(world)] if sizes is None else sizes
    torch.manual_seed(5)
    hot = dict(hot_rows=hot_rows, hot_min_values=0) if hot_rows else {}
    ebc = EmbeddingBagCollection(tables(dtype, weighted, tf), is_weighted=weighted, optimizer=optimizer, device=device,
                                 **hot)
    ref = copy.deepcopy(ebc)
    model = ed.shard(ebc, PLANS[plan_name])
    tol = dict(dtype=dtype, reduction=8 * world)
    for step in range(steps):
        batches = [batch(r, step, weighted, sizes[r], tf) for r in range(world)]
        mine = kjt_of(batches[rank], weighted)
        if step == 1:  # a padded batch: unpadded for the exchange
            mine = PaddedKeyedJaggedTensor.from_kjt(mine, mine.values().numel() + 5)
        out = model(mine.to(device))
        full = ref(kjt_of(concat(batches), weighted).to(device))
        start = sum(sizes[:rank])
        mine = full.values()[start:start + sizes[rank]]
        assert out.keys() == full.keys() and out.length_per_key() == full.length_per_key()
        assert out.values().shape == mine.shape
        assert_close(out.values(), mine, **tol)
        width = full.values().shape[1]
        gw = [grad_weights(sizes[r], width, step, r).to(device, dtype) for r in range(world)]
        (out.values() * gw[rank]).sum().backward()
        (full.values() * torch.cat(gw)).sum().backward()
        if optimizer is None and model.local is not None:  # each shard's gradient is its piece's
            for i, s in enumerate(model.plan.local(rank)):
                t = [c.name for c in ref.tables].index(s.table)
                want = torch.split(ref.weights.grad, [r * d for r, d in ref._shapes])[t].view(ref._shapes[t])
                got = torch.split(model.local.weights.grad, [r * d for r, d in model.local._shapes])[i]
                assert_close(got.view(s.rows, s.dim), want[s.row_start:s.row_end, s.col_start:s.col_end], **tol)
            model.local.weights.grad = None
        ref.weights.grad = None
    state, want = model.full_state_dict(), ref.state_dict()
    assert set(state) == set(want)
    for k in want:
        assert_close(state[k], want[k], **tol)


def _plans(names, world):
    """The plans of `names` that fit a world of this size (not one that places a table on rank 1)."""
    return [p for p in names if world > 1 or "('table_wise', 1)" not in str(PLANS[p])]


def _all_plans(rank, world, device="cpu"):
    for plan in _plans(PLANS, world):
        for opt in (None, SGD(lr=0.1), Adagrad(lr=0.1), Adam(lr=0.05), RowWiseAdagrad(lr=0.1)):
            _compare(rank, world, plan, opt, torch.float32, False, 3, device)
    _compare(rank, world, "mixed_unplaced", Adagrad(lr=0.1), torch.float32, True, 3, device)
    _compare(rank, world, "mixed_unplaced", SGD(lr=0.1), torch.float16, False, 2, device)
    _compare(rank, world, "mixed_unplaced", Adam(lr=0.05), torch.bfloat16, False, 2, device)
    _compare(rank, world, "mixed_unplaced", SGD(lr=0.1), torch.float32, False, 3, device, hot_rows=3)
    # float64 tables to float64's tolerance: the weights cross ranks, and the row-wise partial
    # sums (sqrtn's norm too) and the column pieces' row-wise state add up, in float64
    _compare(rank, world, "row_wise", Adagrad(lr=0.1), torch.float64, True, 3, device)
    _compare(rank, world, "column_wise", RowWiseAdagrad(lr=0.1), torch.float64, False, 3, device)
    # the last rank without samples (an epoch's last batch split over more ranks than it fills)
    _compare(rank, world, "mixed_unplaced", Adagrad(lr=0.1), torch.float32, True, 3, device,
             sizes=[0 if r == world - 1 else 3 + r for r in range(world)])


@pytest.mark.parametrize("world", [2, 3])
def test_every_plan_and_optimizer_matches_the_unsharded_collection(world):
    run_world(_all_plans, world)


def _tf_plans(rank, world, device="cpu"):
    for plan in _plans(["table_wise", "row_wise", "column_wise", "mixed"], world):
        # Adam and weight decay move any row a SKIPPED id would touch; row-wise Adagrad takes column
        # pieces the exact path (PieceUpdate)
        for opt in (None, Adam(lr=0.05), RowWiseAdagrad(lr=0.1, weight_decay=0.01)):
            _compare(rank, world, plan, opt, torch.float32, False, 3, device, tf=True)
    _compare(rank, world, "mixed_unplaced", Adagrad(lr=0.1), torch.float32, True, 3, device, tf=True)
    _compare(rank, world, "row_wise", SGD(lr=0.1), torch.bfloat16, True, 2, device, tf=True)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tables_with_tensorflow_combiners_match_the_unsharded_collection(world):
    """Ids < 0 and weights <= 0 dropped, default ids for bags left empty, sqrtn and mean (over the
    weights) across row shards: as the unsharded collection looks them up and trains them."""
    run_world(_tf_plans, world)


def test_world_of_one_gives_the_unsharded_numbers():
    run_world(_all_plans, 1)


@pytest.mark.gpu
def test_nccl_world_of_one_under_torchrun():
    """The GPU half: torchrun, NCCL, CUDA tables; every plan degenerates to the local path."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), str(root)]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port",
                    str(free_port()), "-m", "tests.distributed.torchrun_compare"], check=True, cwd=root, env=env,
                   timeout=600)


def _mixed(world):
    """The mixed plan (it places a table on rank 1), or where there is no rank 1 the same types unplaced."""
    return PLANS["mixed"] if world > 1 else PLANS["mixed_unplaced"]


def _bf16_pieces(rank, world):
    """Column pieces of bf16 tables under row-wise Adagrad take each row's gradient in fp32, as
    the unsharded fused update does: the row state matches to fp32's tolerance (autograd's
    gradient of a bf16 table, rounded to bf16, put it 0.3% off; found by the sharding fuzz)."""
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables(torch.bfloat16, True), is_weighted=True, optimizer=RowWiseAdagrad(lr=0.1))
    ref = copy.deepcopy(ebc)
    model = ed.shard(ebc, PLANS["column_wise"])
    for step in range(3):
        batches = [batch(r, step, True) for r in range(world)]
        parts = [{k: (l, i, w.to(torch.bfloat16)) for k, (l, i, w) in b.items()} for b in batches]
        out = model(kjt_of(parts[rank], True))
        full = ref(kjt_of(concat(parts), True))
        gw = [grad_weights(3 + r, full.values().shape[1], step, r).to(torch.bfloat16) for r in range(world)]
        (out.values() * gw[rank]).sum().backward()
        (full.values() * torch.cat(gw)).sum().backward()
    state, want = model.full_state_dict(), ref.state_dict()
    states = [k for k in want if want[k].dtype == torch.float32]
    assert states
    for k in states:
        assert_close(state[k], want[k], torch.float32)
    for k in set(want) - set(states):
        assert_close(state[k], want[k], torch.bfloat16, reduction=8 * world)


def test_column_pieces_of_bf16_tables_update_from_an_fp32_gradient():
    run_world(_bf16_pieces, 2)


def _comm_dtype(rank, world):
    """Pooled rows and their gradients crossing ranks in bf16: the unsharded numbers within one
    bf16 rounding each way; ranks that disagree on it fail at shard."""
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables(), optimizer=SGD(lr=0.1))
    ref = copy.deepcopy(ebc)
    model = ed.shard(ebc, PLANS["mixed_unplaced"], comm_dtype=torch.bfloat16)
    with torch.no_grad():
        sent = model.lookup_and_send(model.input_dist(kjt_of(batch(rank, 0, False), False)))
        assert sent.recv.dtype == torch.bfloat16  # (what crossed)
        model.output_wait(sent)
    for step in range(2):
        batches = [batch(r, step, False) for r in range(world)]
        out = model(kjt_of(batches[rank], False))
        full = ref(kjt_of(concat(batches), False))
        start = sum(3 + r for r in range(rank))
        assert out.values().dtype == torch.float32
        assert_close(out.values(), full.values()[start:start + 3 + rank], torch.bfloat16, reduction=8)
        gw = [grad_weights(3 + r, full.values().shape[1], step, r) for r in range(world)]
        (out.values() * gw[rank]).sum().backward()
        (full.values() * torch.cat(gw)).sum().backward()
    state, want = model.full_state_dict(), ref.state_dict()
    for k in want:
        assert_close(state[k], want[k], torch.bfloat16, reduction=8)
    with pytest.raises(ValueError, match="comm_dtype is"):
        ed.shard(EmbeddingBagCollection(tables()), PLANS["mixed_unplaced"],
                 comm_dtype=torch.float16 if rank else torch.bfloat16)


def test_pooled_rows_can_cross_ranks_in_bf16():
    run_world(_comm_dtype, 2)


def _errors(rank, world, device="cpu", tf=False):
    """`tf`: TensorFlow-style tables, whose batches hold ids < 0 (dropped, not errors)."""
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables(tf=tf), optimizer=Adagrad(lr=0.1), device=device)
    model = ed.shard(ebc, _mixed(world))
    before = model.full_state_dict()
    good = batch(rank, 0, False, tf=tf)

    key = next(k for k in KEYS if good[k][1].numel())  # a feature this rank has ids of

    def raises_everywhere(kjt, cls, text):
        with pytest.raises(cls) as e:
            model((kjt if rank == world - 1 else kjt_of(good, False)).to(device)).values().sum().backward()
        message = e.value.args[0]
        assert message.startswith(f"rank {world - 1}'s batch: ") and text in message, message

    for value, cls in ((FEATURES[key], embfuse_errors.BadIdError), (-3, IndexError))[:1 if tf else 2]:
        ids = good[key][1].clone()
        ids[-1] = value
        raises_everywhere(kjt_of({**good, key: (good[key][0], ids, None)}, False), cls,
                          f"feature {key!r}: values[")
    lengths = torch.cat([good[k][0] for k in KEYS])
    lengths[1] += 1  # one more than there are values
    raises_everywhere(_unchecked(good, lengths), ValueError, "lengths add up to")
    missing = KeyedJaggedTensor(KEYS[:-1], torch.cat([good[k][1] for k in KEYS[:-1]]),
                                lengths=torch.cat([good[k][0] for k in KEYS[:-1]]))
    raises_everywhere(missing, KeyError, "the batch has no feature 'ad'")
    after = model.full_state_dict()
    for k in before:  # nothing updated anywhere
        assert torch.equal(after[k], before[k]), k
    model(kjt_of(good, False).to(device)).values().sum().backward()  # and the next good batch trains
    assert not torch.equal(model.full_state_dict()["embedding_bags.user.weight"], before["embedding_bags.user.weight"])


def _unchecked(parts, lengths):
    kjt = kjt_of(parts, False)
    kjt._lengths = lengths  # a batch whose lengths were never checked (as on a GPU, where checking costs a read)
    kjt._offsets = None
    return kjt


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tf", [False, True], ids=["torchrec", "tensorflow"])
def test_a_bad_batch_on_one_rank_raises_on_every_rank_and_changes_nothing(world, tf):
    run_world(_errors, world, "cpu", tf)


def _mismatch(rank, world):
    ts = tables()
    if rank == 1:
        ts[1] = EmbeddingBagConfig(9, 5, "item", torch.float32, ["iid"], pooling="mean")
    with pytest.raises(ValueError, match=r"tables\[1\]\[2\] is 3 on rank 0 and 5 on rank 1"):
        ed.shard(EmbeddingBagCollection(ts), PLANS["mixed"])
    plan = PLANS["row_wise"] if rank == 0 else PLANS["table_wise"]
    with pytest.raises(ValueError, match="different collections or plans: plan"):
        ed.shard(EmbeddingBagCollection(tables()), plan)


def test_ranks_given_different_collections_fail_at_shard():
    run_world(_mismatch, 2)


def _save(rank, world, path, device="cpu"):
    torch.manual_seed(5)
    model = ed.shard(EmbeddingBagCollection(tables(), optimizer=Adam(lr=0.05), device=device), _mixed(world))
    for step in range(2):
        model(kjt_of(batch(rank, step, False), False).to(device)).values().sum().backward()
    state = model.full_state_dict()
    if rank == 0:
        torch.save(state, path)
        plain = EmbeddingBagCollection(tables(), optimizer=Adam(lr=0.05), device=device)
        plain.load_state_dict(state)  # loads into the unsharded collection, bitwise
        for k, v in plain.state_dict().items():
            assert torch.equal(v, state[k]), k


def _load(rank, world, path):
    saved = torch.load(path)
    model = ed.shard(EmbeddingBagCollection(tables(), optimizer=Adam(lr=0.05)), PLANS["row_wise"])
    model.load_full_state_dict(saved)
    state = model.full_state_dict()
    assert set(state) == set(saved)
    for k in saved:
        assert torch.equal(state[k], saved[k]), k


def test_checkpoints_move_between_plans_and_world_sizes(tmp_path):
    path = str(tmp_path / "full.pt")
    run_world(_save, 3, path)
    run_world(_load, 2, path)


def _dead_rank(rank, world):
    model = ed.shard(EmbeddingBagCollection(tables()), PLANS["row_wise"])
    if rank == 1:
        return  # this rank leaves: the other must fail with the process group's timeout, not hang
    with pytest.raises(RuntimeError):
        model(kjt_of(batch(rank, 0, False), False))


def test_a_rank_that_leaves_makes_the_others_time_out():
    run_world(_dead_rank, 2, timeout=5)


def _shared_feature(rank, world):
    """A feature looked up by two tables (outputs "a@t1" and "a@t2", TorchRec's names), the tables
    sharded three ways: the unsharded collection's outputs and tables after SGD steps."""
    def configs():
        return [EmbeddingBagConfig(20, 4, "t1", feature_names=["a", "b"]),
                EmbeddingBagConfig(10, 3, "t2", feature_names=["a"], pooling="mean"),
                EmbeddingBagConfig(7, 2, "t3", feature_names=["c"])]

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.1))
    ref = copy.deepcopy(ebc)
    model = ed.shard(ebc, {"t1": "row_wise", "t2": "table_wise", "t3": "column_wise"})

    def part(r, step):
        g = torch.Generator().manual_seed(100 * step + r)
        lengths = torch.randint(0, 4, (3 * (2 + r),), generator=g)
        ids = torch.randint(0, 7, (int(lengths.sum()),), generator=g)  # (valid in every table)
        return lengths, ids

    for step in range(2):
        parts = [part(r, step) for r in range(world)]
        mine = KeyedJaggedTensor(["c", "a", "b"], parts[rank][1], lengths=parts[rank][0])  # (keys in any order)
        out = model(mine)
        alls = [KeyedJaggedTensor(["c", "a", "b"], ids, lengths=lengths).to_dict() for lengths, ids in parts]
        full = ref(KeyedJaggedTensor.from_jt_dict({k: _cat_jts([d[k] for d in alls]) for k in ["a", "b", "c"]}))
        assert out.keys() == full.keys() == ["a@t1", "b", "a@t2", "c"]
        start = sum(2 + r for r in range(rank))
        assert_close(out.values(), full.values()[start:start + 2 + rank], torch.float32, reduction=8)
        out.values().square().sum().backward()
        full.values().square().sum().backward()
    state, want = model.full_state_dict(), ref.state_dict()
    for k in want:
        assert_close(state[k], want[k], torch.float32, reduction=8)


def _cat_jts(jts):
    from embfuse.sparse.jagged import JaggedTensor
    return JaggedTensor(torch.cat([jt.values() for jt in jts]), lengths=torch.cat([jt.lengths() for jt in jts]))


def test_a_feature_of_two_tables_is_sharded_as_two_slots():
    run_world(_shared_feature, 2)


def vbe_batch(rank, step, weighted, tf=False):
    """Rank `rank`'s batch of step `step` whose features have their own batch sizes (TorchRec's
    VBE: 1-3 + rank bags each), for 3 + rank samples that each take one bag of every feature by
    the inverse indices (every bag taken by one sample or more); and those samples as `batch`
    gives a batch of one stride (each sample's bags copied), for the unsharded reference. `tf`:
    as `batch`'s."""
    g = torch.Generator().manual_seed(2000 * step + rank)
    B, parts, plain = 3 + rank, [], {}
    for k in KEYS:
        n = int(torch.randint(1, 4, (1,), generator=g)) + rank
        lengths = torch.randint(0, 4, (n,), generator=g)
        ids = torch.randint(0, FEATURES[k], (int(lengths.sum()),), generator=g)
        if tf and k != "ad":
            ids = torch.where(torch.rand(ids.shape, generator=g) < 0.35, -1 - ids, ids)
        w = torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None
        inverse = (torch.arange(B) % n)[torch.randperm(B, generator=g)]
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).tolist()
        at = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in inverse.tolist()])
        plain[k] = (lengths[inverse], ids[at], None if w is None else w[at])
        parts.append((lengths, ids, w, n, inverse))
    weights = torch.cat([p[2] for p in parts]) if weighted else None
    kjt = KeyedJaggedTensor(KEYS, torch.cat([p[1] for p in parts]), weights,
                            lengths=torch.cat([p[0] for p in parts]), stride_per_key_per_rank=[[p[3]] for p in parts],
                            inverse_indices=(KEYS, torch.stack([p[4] for p in parts])))
    return kjt, plain


def _vbe(rank, world, device="cpu"):
    for plan in _plans(["table_wise", "row_wise", "column_wise", "mixed"], world):
        # (TensorFlow's tables under Adam with weight decay: a padding bag's default id would move its row)
        for opt, weighted, tf in ((SGD(lr=0.1), False, False), (RowWiseAdagrad(lr=0.1), False, False),
                                  (Adagrad(lr=0.1), True, False), (Adam(lr=0.05, weight_decay=0.1), False, True)):
            torch.manual_seed(5)
            ebc = EmbeddingBagCollection(tables(weighted=weighted, tf=tf), is_weighted=weighted, optimizer=opt,
                                         device=device)
            ref = copy.deepcopy(ebc)
            model = ed.shard(ebc, PLANS[plan])
            tol = dict(dtype=torch.float32, reduction=8 * world)
            for step in range(2):
                batches = [vbe_batch(r, step, weighted, tf) for r in range(world)]
                out = model(batches[rank][0].to(device))
                full = ref(kjt_of(concat([b[1] for b in batches]), weighted).to(device)).values()
                start = sum(3 + r for r in range(rank))
                assert_close(out.values(), full[start:start + 3 + rank], **tol)
                gw = [grad_weights(3 + r, full.shape[1], step, r).to(device) for r in range(world)]
                (out.values() * gw[rank]).sum().backward()
                (full * torch.cat(gw)).sum().backward()
            state, want = model.full_state_dict(), ref.state_dict()
            for k in want:
                assert_close(state[k], want[k], **tol)
    no_inverse = KeyedJaggedTensor(KEYS, torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(5, dtype=torch.int64),
                                   stride_per_key_per_rank=[[1]] * 5)
    with pytest.raises(ValueError, match=r"rank 0's batch: .*needs inverse_indices"):
        model(no_inverse.to(device))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_whose_features_have_their_own_batch_sizes_match_the_unsharded_collection(world):
    """TorchRec's VBE: each rank pads its batch to one stride, and its output samples take their
    pooled rows by the inverse indices; outputs and fused steps as the unsharded collection gives
    the same samples with their bags copied out. A batch without inverse indices is refused on
    every rank."""
    run_world(_vbe, world)
