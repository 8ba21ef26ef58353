"""Differential fuzz of embfuse's EmbeddingBagCollection / EmbeddingCollection against TorchRec's
(CPU, the same weights through state_dict): random tables (a feature shared by two tables,
sum / mean, weighted), batches with keys in any order, an extra key, int32 / int64 values and
lengths, variable batch sizes per feature (inverse_indices); outputs, key order and the table
gradients (embfuse's one flat `weights` parameter against TorchRec's tables back to back).
FORCE_KERNELS=1 TRITON_INTERPRET=1 runs embfuse's Triton kernels in the interpreter instead of
its CPU path (needs triton in the venv).

    /tmp/torchrec-venv/bin/python benchmarks/compat/torchrec_fuzz_modules.py SEED CASES
"""
import os, random, re, sys, traceback, torch, embfuse, torchrec
if os.environ.get("FORCE_KERNELS"):
    for name_, mod_ in list(sys.modules.items()):
        if name_.startswith("embfuse") and hasattr(mod_, "use_kernels"):
            mod_.use_kernels = lambda *a, **k: True
from torchrec.modules.embedding_configs import EmbeddingBagConfig as TBC, EmbeddingConfig as TC, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TEBC, EmbeddingCollection as TEC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TKJT

def close(a, b, what, tol=1e-5):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"{what}: max diff {(a - b).abs().max()}"

def rand_tables(rng):
    T, feats, names = rng.randint(1, 3), iter(rng.sample(range(20), 8)), []
    tables = []
    for i in range(T):
        fs = [f"f{next(feats)}" for _ in range(rng.randint(1, 2))]
        if tables and rng.random() < 0.3:  # a feature that feeds two tables
            fs[0] = rng.choice(tables[-1]["feature_names"])
        kw = dict(num_embeddings=rng.randint(1, 40), embedding_dim=rng.choice([1, 3, 4, 8, 12]),
                  name=f"t{i}", feature_names=fs)
        tables.append(kw)
    return tables

def feature_limits(tables):
    """feature -> the rows of the smallest table it feeds."""
    lim = {}
    for t in tables:
        for f in t["feature_names"]:
            lim[f] = min(lim.get(f, 10**9), t["num_embeddings"])
    return lim

def ebc_pair(rng):
    """Random tables, and TorchRec's and embfuse's EmbeddingBagCollection of them."""
    tables = rand_tables(rng)
    weighted = rng.random() < 0.4
    pools = [PoolingType.SUM if weighted or rng.random() < 0.5 else PoolingType.MEAN for _ in tables]
    tm = TEBC([TBC(**t, pooling=p) for t, p in zip(tables, pools)], is_weighted=weighted, device=torch.device("cpu"))
    em = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(**t, pooling=p) for t, p in zip(tables, pools)],
                                        is_weighted=weighted, device=torch.device("cpu"))
    return tables, weighted, pools, tm, em

def grads_match(tm, em, what):
    """embfuse keeps one flat `weights` parameter (tables back to back, row-major): TorchRec's
    table gradients, concatenated, against it."""
    tg = torch.cat([p.grad.to_dense().flatten() if p.grad.is_sparse else p.grad.flatten() for p in tm.parameters()])
    (w,) = list(em.parameters())
    close(tg, (w.grad.to_dense() if w.grad.is_sparse else w.grad).flatten()[:tg.numel()], what)

def rand_kjt(rng, tables, weighted):
    lim = feature_limits(tables)
    feats = list(lim.items())
    if rng.random() < 0.3:
        feats.append(("extra", 5))
    rng.shuffle(feats)
    B = rng.randint(1, 5)
    lengths = torch.tensor([rng.randint(0, 4) for _ in range(len(feats) * B)],
                           dtype=rng.choice([torch.int32, torch.int64]))
    vals = []
    k = 0
    for f, n in feats:
        for b in range(B):
            vals += [rng.randrange(n) for _ in range(int(lengths[k]))]; k += 1
    values = torch.tensor(vals, dtype=rng.choice([torch.int32, torch.int64]))
    weights = torch.rand(len(vals)) if weighted or rng.random() < 0.2 else None
    kw = dict(keys=[f for f, _ in feats], values=values, lengths=lengths, weights=weights)
    return TKJT(**kw), embfuse.KeyedJaggedTensor(**kw)

def case_ebc(rng):
    tables, weighted, pools, tm, em = ebc_pair(rng)
    sd = tm.state_dict()
    assert list(sd) == list(em.state_dict()), f"state_dict keys {list(sd)} vs {list(em.state_dict())}"
    em.load_state_dict(sd)
    tk, ek = rand_kjt(rng, tables, weighted)
    to, eo = tm(tk), em(ek)
    assert to.keys() == eo.keys(), f"keys {to.keys()} vs {eo.keys()}"
    assert to.length_per_key() == eo.length_per_key()
    close(to.values(), eo.values(), f"ebc values pools={pools} weighted={weighted}")
    r = torch.randn_like(to.values())
    (to.values() * r).sum().backward(); (eo.values() * r).sum().backward()
    grads_match(tm, em, "ebc grad")
    for name in [t["name"] for t in tables]:
        close(tm.embedding_bags[name].weight.detach(), em.embedding_bags[name].weight.detach(), "embedding_bags view")

def case_ec(rng):
    tables = rand_tables(rng)
    D = rng.choice([1, 4, 8])
    for t in tables:
        t["embedding_dim"] = D  # TorchRec's EC needs one width
    ni = rng.random() < 0.3
    tm = TEC([TC(**t) for t in tables], device=torch.device("cpu"), need_indices=ni)
    em = embfuse.EmbeddingCollection([embfuse.EmbeddingConfig(**t) for t in tables], device=torch.device("cpu"),
                                     need_indices=ni)
    sd = tm.state_dict()
    assert list(sd) == list(em.state_dict()), f"state_dict keys {list(sd)} vs {list(em.state_dict())}"
    em.load_state_dict(sd)
    tk, ek = rand_kjt(rng, tables, False)
    to, eo = tm(tk), em(ek)
    assert list(to) == list(eo), f"ec order {list(to)} vs {list(eo)}"
    for k in to:
        close(to[k].values(), eo[k].values(), f"ec[{k}].values")
        assert torch.equal(to[k].lengths(), eo[k].lengths()), f"ec[{k}].lengths"
        assert torch.equal(to[k].offsets(), eo[k].offsets()), f"ec[{k}].offsets"
        a, b = to[k].weights_or_none(), eo[k].weights_or_none()
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"ec[{k}].weights {a} {b}"
    r = {k: torch.randn_like(v.values()) for k, v in to.items()}
    sum((to[k].values() * r[k]).sum() for k in to).backward()
    sum((eo[k].values() * r[k]).sum() for k in eo).backward()
    grads_match(tm, em, "ec grad")

def case_vbe(rng):
    tables, weighted, pools, tm, em = ebc_pair(rng)
    em.load_state_dict(tm.state_dict())
    lim = feature_limits(tables)
    feats = list(lim.items()); rng.shuffle(feats)
    Bout = rng.randint(1, 5)
    strides = [rng.randint(1, Bout) for _ in feats]
    lengths, vals = [], []
    for (f, n), st in zip(feats, strides):
        for _ in range(st):
            L = rng.randint(0, 3); lengths.append(L); vals += [rng.randrange(n) for _ in range(L)]
    inv = torch.tensor([[rng.randrange(st) for _ in range(Bout)] for st in strides])
    kw = dict(keys=[f for f, _ in feats], values=torch.tensor(vals, dtype=torch.int64), lengths=torch.tensor(lengths),
              weights=torch.rand(len(vals)) if weighted else None, stride_per_key_per_rank=[[s] for s in strides],
              inverse_indices=([f for f, _ in feats], inv))
    to, eo = tm(TKJT(**kw)), em(embfuse.KeyedJaggedTensor(**kw))
    assert to.keys() == eo.keys(), f"vbe keys {to.keys()} vs {eo.keys()}"
    close(to.values(), eo.values(), f"vbe values pools={pools} weighted={weighted}")
    r = torch.randn_like(to.values())
    (to.values() * r).sum().backward(); (eo.values() * r).sum().backward()
    grads_match(tm, em, "vbe grad")

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 200
fails = {}
for i in range(N):
    for fn in (case_ebc, case_ec, case_vbe):
        try:
            fn(rng)
        except Exception as ex:
            msg = f"{fn.__name__} {type(ex).__name__}: {str(ex)[:300]}"
            key = re.sub(r"\[.*?\]|\{.*?\}|tensor\(.*|diff .*|=.*", "", msg)[:90]
            if key not in fails:
                fails[key] = (i, msg, traceback.format_exc()[-1200:])
print(N, "cases", len(fails), "distinct failures")
for k, (i, msg, tb) in fails.items():
    print("----", i, msg); print(tb)
