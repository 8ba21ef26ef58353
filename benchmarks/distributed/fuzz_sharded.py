"""Differential fuzz of sharded collections against the unsharded one fed every rank's batch.

Each seed draws 1-4 tables (1-40 rows, 1-8 wide: fewer rows or columns than ranks too), one or
two features a table in a shuffled key order, sum / mean / sqrtn pooling or (a third of the
seeds) TensorFlow's combiners with default ids or not and ids < 0 to drop, weighted or not,
fp32, fp16 or bf16, a fused optimizer or none, hot rows or not, a plan (each table table-, row-
or column-wise, placed or not; or `plan=None`), a batch size a rank (0 included), and (a third
of the seeds) batches whose features have their own batch sizes (VBE; every bag taken by a
sample). Two steps: the rank's output against its slice of the unsharded output (fed every
rank's batch, VBE batches as one VBE batch), a backward, and at the end every table and
optimizer state (`full_state_dict`) against the unsharded collection's.

CPU (gloo, one world a seed), from the repository root:
    PYTHONPATH=src:. python benchmarks/distributed/fuzz_sharded.py WORLD FIRST_SEED SEEDS
GPUs (NCCL, one rank a GPU; the first failure stops the run):
    PYTHONPATH=src:. torchrun --nproc_per_node=2 benchmarks/distributed/fuzz_sharded.py nccl FIRST_SEED SEEDS
"""

import copy
import os
import random
import sys
import traceback

import torch

import embfuse.distributed as ed
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from embfuse.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.distributed.worlds import run_world
from tests.tolerances import assert_close


def draw(seed, world):
    """The seed's case: tables, features (name, rows), plan, optimizer, batch sizes, weighted,
    key order, batch seed, and dtype / hot rows / automatic plan."""
    r = random.Random(seed)
    tables, features, plan = [], [], {}
    weighted, tf = r.random() < 0.3, r.random() < 0.3
    for t in range(r.randint(1, 4)):
        rows, dim = r.choice([1, 2, 3, 5, 17, 40]), r.choice([1, 2, 3, 4, 7, 8])
        names = [f"t{t}f{i}" for i in range(r.randint(1, 2))]
        features += [(f, rows) for f in names]
        pooling = r.choice(["sum", "mean", "sqrtn"])
        # TensorFlow's: (combiner, default id or None) instead of TorchRec's pooling
        rule = (pooling, r.choice([None, r.randrange(rows)])) if tf and r.random() < 0.7 else None
        tables.append((rows, dim, f"t{t}", names, pooling, rule))
        kind = r.choice(["table_wise", "row_wise", "column_wise"])
        plan[f"t{t}"] = (kind, r.randrange(world)) if kind == "table_wise" and r.random() < 0.5 else kind
    optimizer = r.choice([None, "sgd", "adagrad", "adam", "rowwise"])
    sizes = [r.choice([0, 1, 2, 5]) for _ in range(world)]
    sizes[0] = sizes[0] if any(sizes) else 3
    order = features[:]
    r.shuffle(order)
    extra = dict(dtype=r.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16]),
                 hot=r.choice([0, 0, 2, 5]), auto=r.random() < 0.2, vbe=r.random() < 0.3)
    return tables, features, plan, optimizer, sizes, weighted, order, r.randint(0, 10**6), extra


OPTIMIZERS = {None: lambda: None, "sgd": lambda: SGD(lr=0.1), "adagrad": lambda: Adagrad(lr=0.1),
              "adam": lambda: Adam(lr=0.05), "rowwise": lambda: RowWiseAdagrad(lr=0.1)}


def batch(features, order, B, seed, weighted, dtype, dropping=(), vbe=False):
    """(keys, lengths, values, weights) of B samples, keys in `order`; the KeyedJaggedTensor to
    give the sharded collection: that batch, or with `vbe` one whose features have their own
    batch sizes (1 to B bags, each taken by one sample or more) whose samples are those; and with
    `vbe` its parts per key (lengths, ids, weights, (bags, inverse indices)), else None.
    `dropping`: features whose ids may be < 0 and weights <= 0 (TensorFlow's rules drop them)."""
    g = torch.Generator().manual_seed(seed)
    rows = dict(features)
    lengths, values, weights, given = [], [], [], ([], [], [], [])
    for f, _ in order:
        n = int(torch.randint(1, B + 1, (1,), generator=g)) if vbe else B
        own = torch.randint(0, 4, (n,), generator=g)
        ids = torch.randint(0, rows[f], (int(own.sum()),), generator=g)
        w = torch.rand(ids.numel(), generator=g).to(dtype) + 0.5
        if f in dropping:
            ids = torch.where(torch.rand(ids.shape, generator=g) < 0.3, -1 - ids, ids)
            w = w - 0.6
        inverse = (torch.arange(B) % n)[torch.randperm(B, generator=g)] if vbe else torch.arange(B)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), own.cumsum(0)]).tolist()
        at = torch.cat([torch.zeros(0, dtype=torch.long)] +
                       [torch.arange(starts[i], starts[i + 1]) for i in inverse.tolist()])
        lengths.append(own[inverse])
        values.append(ids[at])
        weights.append(w[at])
        for part, x in zip(given, (own, ids, w, (n, inverse))):
            part.append(x)
    keys = [f for f, _ in order]
    kjt = KeyedJaggedTensor(keys, torch.cat(values), torch.cat(weights) if weighted else None,
                            lengths=torch.cat(lengths))
    if vbe:
        kjt = vbe_kjt(keys, *given, weighted)
    return (keys, torch.cat(lengths), torch.cat(values), torch.cat(weights) if weighted else None), kjt, \
        given if vbe else None


def vbe_kjt(keys, lengths, ids, weights, shapes, weighted):
    """A VBE KeyedJaggedTensor from its parts per key (shapes: (bags, inverse indices))."""
    return KeyedJaggedTensor(keys, torch.cat(ids), torch.cat(weights) if weighted else None,
                             lengths=torch.cat(lengths), stride_per_key_per_rank=[[n] for n, _ in shapes],
                             inverse_indices=(keys, torch.stack([i for _, i in shapes])))


def concat_vbe(given, keys, weighted):
    """Every rank's VBE batch as one, per key rank after rank (each rank's bags after the ones
    before, its inverse indices moved past them): the unsharded reference's batch, whose samples
    share bags as the ranks' do (so its gradients are summed as theirs are)."""
    parts = ([], [], [], [])
    for k in range(len(keys)):
        mine = [g for g in given if g is not None]
        bags = [g[3][k][0] for g in mine]
        before = [sum(bags[:i]) for i in range(len(bags))]
        parts[0].append(torch.cat([g[0][k] for g in mine]))
        parts[1].append(torch.cat([g[1][k] for g in mine]))
        parts[2].append(torch.cat([g[2][k] for g in mine]))
        parts[3].append((sum(bags), torch.cat([g[3][k][1] + b for g, b in zip(mine, before)])))
    return vbe_kjt(keys, *parts, weighted)


def concat(parts, keys, sizes):
    """Every rank's batch as one, per key rank after rank."""
    lengths, values, weights = [], [], []
    for k in range(len(keys)):
        for (_, l, v, w), B in zip(parts, sizes):
            per_key = l.view(len(keys), B)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), per_key.sum(1).cumsum(0)])
            lengths.append(per_key[k])
            values.append(v[starts[k]:starts[k + 1]])
            if w is not None:
                weights.append(w[starts[k]:starts[k + 1]])
    return torch.cat(lengths), torch.cat(values), torch.cat(weights) if weights else None


def trial(rank, world, seed, device="cpu"):
    tables, features, plan, optimizer, sizes, weighted, order, batch_seed, extra = draw(seed, world)
    dtype = extra["dtype"]
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(rows, dim, name, dtype, names, pooling=p) if rule is None else
               EmbeddingBagConfig(rows, dim, name, dtype, names, combiner=rule[0], default_id=rule[1])
               for rows, dim, name, names, p, rule in tables]
    dropping = {f for _, _, _, names, _, rule in tables if rule is not None for f in names}
    # (hot rows take an unweighted collection with an optimizer, without TensorFlow's rules)
    hot = (dict(hot_rows=extra["hot"], hot_min_values=0) if extra["hot"] and optimizer and not weighted
           and not dropping else {})
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted, optimizer=OPTIMIZERS[optimizer](), device=device,
                                 **hot)
    ref = copy.deepcopy(ebc)
    model = ed.shard(ebc, None if extra["auto"] else plan)
    # 2-byte tables, looser: row-wise partial sums cross ranks rounded to the table's dtype (where
    # a bag's partials cancel, the sum keeps their rounding); fp32 tables (half the draws) are
    # held to the tolerance table
    tol = dict(dtype=dtype, reduction=(64 if dtype.itemsize == 2 else 8) * world)
    for step in range(2):
        made = [batch(features, order, sizes[r], batch_seed + 100 * step + r, weighted, dtype, dropping,
                      extra["vbe"] and sizes[r] > 0) for r in range(world)]
        parts, keys = [p for p, _, _ in made], made[0][0][0]
        out = model(made[rank][1].to(device))
        lengths, values, weights = concat(parts, keys, sizes)
        if all(m[2] is not None for m in made if m[0][1].numel()):  # (every rank with samples gave VBE)
            full = ref(concat_vbe([m[2] for m in made], keys, weighted).to(device))
        else:
            full = ref(KeyedJaggedTensor(keys, values, weights, lengths=lengths).to(device))
        start = sum(sizes[:rank])
        assert out.keys() == full.keys(), (out.keys(), full.keys())
        assert_close(out.values(), full.values()[start:start + sizes[rank]], **tol)
        g = torch.randn(sum(sizes), full.values().shape[1], generator=torch.Generator().manual_seed(seed + step))
        g = g.to(device, dtype)
        (out.values() * g[start:start + sizes[rank]]).sum().backward()
        (full.values() * g).sum().backward()
        if optimizer is None and model.local is not None:
            model.local.weights.grad = None
        ref.weights.grad = None
    state, want = model.full_state_dict(), ref.state_dict()
    assert set(state) == set(want), set(state) ^ set(want)
    for k in want:
        assert_close(state[k], want[k], **tol)


def _report(rank, world, seed):
    print(f"rank {rank}, seed {seed}, world {world}:", *draw(seed, world)[:7], draw(seed, world)[8], flush=True)
    traceback.print_exc()


def _on_gloo(rank, world, seed):
    try:
        trial(rank, world, seed)
    except Exception:
        _report(rank, world, seed)
        raise


def _on_nccl(first, n):
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    for seed in range(first, first + n):
        try:
            trial(rank, world, seed, "cuda")
        except Exception:
            _report(rank, world, seed)
            os._exit(1)  # (the other ranks would wait in a collective)
        dist.barrier()
    if rank == 0:
        print(f"{n} seeds passed on {world} GPUs", flush=True)
    dist.destroy_process_group()


def main(argv):
    if argv[0] == "nccl":
        return _on_nccl(int(argv[1]), int(argv[2]))
    world, first, n = (int(a) for a in argv)
    failed = []
    for seed in range(first, first + n):
        try:
            run_world(_on_gloo, world, seed, timeout=60)
        except Exception:
            failed.append(seed)
    print(f"{n - len(failed)} of {n} seeds passed on {world} gloo ranks" + (f"; failed: {failed}" if failed else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
