"""Differential fuzz of embfuse's containers against TorchRec's own (CPU), on random batches:
KeyedJaggedTensor (accessors, to_dict, getitem, split, permute with repeats, concat,
from_jt_dict), JaggedTensor's dense forms, KeyedTensor (from_tensor_list, getitem, regroup).
Prints the distinct mismatches; cases where TorchRec itself raises are counted and skipped.
Empty split segments are not compared: TorchRec gives them offsets [] and int32 lengths.

    /tmp/torchrec-venv/bin/python benchmarks/compat/torchrec_fuzz_containers.py SEED CASES
(the venv of torchrec_tests.sh: torch 2.13 CPU, torchrec 1.8.0, embfuse editable)
"""
import random, re, sys, traceback, torch, embfuse, torchrec
from torchrec.sparse import jagged_tensor as T

def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
        return
    if isinstance(a, (list, tuple)):
        assert list(a) == list(b), f"{what}: {a} vs {b}"
        return
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape and torch.equal(a, b), f"{what}: {a} vs {b}"

def rand_kjt(rng, F=None, B=None, weighted=None):
    F = rng.randint(1, 5) if F is None else F
    B = rng.randint(0, 5) if B is None else B
    keys = [f"f{i}" for i in rng.sample(range(9), F)]
    ld = rng.choice([torch.int32, torch.int64])
    lengths = torch.tensor([rng.randint(0, 4) for _ in range(F * B)], dtype=ld)
    n = int(lengths.sum())
    values = torch.randint(0, 50, (n,), dtype=rng.choice([torch.int32, torch.int64]))
    weights = torch.rand(n) if (rng.random() < 0.5 if weighted is None else weighted) else None
    by = rng.choice(["lengths", "offsets"])
    kw = dict(keys=keys, values=values, weights=weights)
    if by == "lengths":
        kw["lengths"] = lengths
    else:
        kw["offsets"] = torch.cat([torch.zeros(1, dtype=ld), lengths.cumsum(0).to(ld)])
    if rng.random() < 0.5:
        kw["stride"] = B
    return T.KeyedJaggedTensor(**kw), embfuse.KeyedJaggedTensor(**kw), kw

def cmp_kjt(t, e, what):
    same(t.keys(), e.keys(), what + ".keys")
    same(t.values(), e.values(), what + ".values")
    same(t.weights_or_none(), e.weights_or_none(), what + ".weights")
    same(t.lengths(), e.lengths(), what + ".lengths")
    same(t.offsets(), e.offsets(), what + ".offsets")
    assert t.stride() == e.stride(), f"{what}.stride {t.stride()} {e.stride()}"
    same(t.length_per_key(), e.length_per_key(), what + ".length_per_key")
    same(t.offset_per_key(), e.offset_per_key(), what + ".offset_per_key")

def cmp_jt(t, e, what):
    same(t.values(), e.values(), what + ".values")
    same(t.weights_or_none(), e.weights_or_none(), what + ".weights")
    same(t.lengths(), e.lengths(), what + ".lengths")
    same(t.offsets(), e.offsets(), what + ".offsets")

class TorchRecRaised(Exception):
    pass

def tr(fn):
    try:
        return fn()
    except Exception as ex:
        raise TorchRecRaised(f"{type(ex).__name__}") from ex

def case(rng):
    t, e, kw = rand_kjt(rng)
    cmp_kjt(t, e, "kjt")
    td = tr(t.to_dict); ed = e.to_dict()
    assert list(td) == list(ed)
    for k in td:
        cmp_jt(td[k], ed[k], f"to_dict[{k}]")
        cmp_jt(t[k], e[k], f"getitem[{k}]")
    F = len(kw["keys"])
    cuts = sorted(rng.sample(range(F + 1), rng.randint(0, min(2, F + 1))))
    segs, prev = [], 0
    for c in cuts + [F]:
        segs.append(c - prev); prev = c
    segs = [x for x in segs if x] or [F]  # TorchRec's empty splits: offsets [] and int32 lengths
    for i, (a, b) in enumerate(zip(t.split(segs), e.split(segs))):
        cmp_kjt(a, b, f"split{segs}[{i}]")
    perm = [rng.randrange(F) for _ in range(rng.randint(1, F + 1))] if rng.random() < 0.5 else rng.sample(range(F), F)
    cmp_kjt(t.permute(perm), e.permute(perm), f"permute{perm}")
    t2, e2, _ = rand_kjt(rng, B=t.stride(), weighted=kw["weights"] is not None)
    if not set(t2.keys()) & set(t.keys()):
        cmp_kjt(T.KeyedJaggedTensor.concat([t, t2]), embfuse.KeyedJaggedTensor.concat([e, e2]), "concat")
    cmp_kjt(T.KeyedJaggedTensor.from_jt_dict(td), embfuse.KeyedJaggedTensor.from_jt_dict(ed), "from_jt_dict")
    # jagged tensor dense conversions
    k = kw["keys"][0]
    jt, je = td[k], ed[k]
    for a, b in zip(jt.to_dense(), je.to_dense()):
        same(a, b, "to_dense")
    L = rng.randint(0, 5)
    same(jt.to_padded_dense(L, padding_value=7), je.to_padded_dense(L, padding_value=7), "to_padded_dense")
    if jt.weights_or_none() is not None:
        same(jt.to_padded_dense_weights(L, padding_value=0.5), je.to_padded_dense_weights(L, padding_value=0.5),
             "to_padded_dense_weights")
    # keyed tensor
    D = [rng.randint(1, 4) for _ in range(F)]
    Bk = rng.randint(1, 4)
    ts = [torch.randn(Bk, d) for d in D]
    kt, ke = T.KeyedTensor.from_tensor_list(kw["keys"], ts), embfuse.KeyedTensor.from_tensor_list(kw["keys"], ts)
    same(kt.values(), ke.values(), "kt.values"); same(kt.length_per_key(), ke.length_per_key(), "kt.lpk")
    for key in kw["keys"]:
        same(kt[key], ke[key], "kt[key]")
    groups = [rng.sample(kw["keys"], rng.randint(1, F)) for _ in range(rng.randint(1, 3))]
    for a, b in zip(T.KeyedTensor.regroup([kt], groups), embfuse.KeyedTensor.regroup([ke], groups)):
        same(a, b, f"regroup {groups}")

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
fails = {}
raised = {}
N = int(sys.argv[2]) if len(sys.argv) > 2 else 300
for i in range(N):
    st = rng.getstate()
    try:
        case(rng)
    except TorchRecRaised as ex:
        raised[str(ex)] = raised.get(str(ex), 0) + 1
    except Exception as ex:
        msg = f"{type(ex).__name__}: {str(ex)[:300]}"
        key = re.sub(r"\[.*?\]|\{.*?\}|tensor\(.*", "", msg)[:80]
        if key not in fails:
            fails[key] = (i, msg, traceback.format_exc()[-1500:])
print(N, "cases", len(fails), "distinct failures; torchrec raised:", raised)
for k, (i, msg, tb) in fails.items():
    print("----", i, msg); print(tb)
