import argparse
from pathlib import Path

import pytest
import torch

from embfuse.demo.data import load_movielens, synthetic
from embfuse.demo.run import auc, build, same_start, train

# 400 ratings cut from the real MovieLens-100K files, with their users and items
TINY = Path(__file__).parent / "ml-100k-tiny"


def args(**kw):
    base = dict(epochs=2, batch_size=64, dim=8, lr_sparse=0.05, lr_dense=3e-3, seed=0)
    return argparse.Namespace(**base | kw)


def test_movielens_loader_reads_the_real_files():
    data = load_movielens(TINY)
    assert len(data) == 400
    assert list(data.sparse) == ["user_id", "item_id", "age", "gender", "occupation", "zip_prefix", "genres"]
    assert data.rows["gender"] == 2 and data.rows["age"] == 7
    for key, ids in data.sparse.items():
        real = ids[ids >= 0]
        assert int(real.min()) >= 0 and int(real.max()) < data.rows[key]
    assert data.sparse["genres"].dim() == 2 and bool((data.sparse["genres"][:, 0] >= 0).all())
    # the first rating in the file: user 196 rated item 242 (Kolya, a comedy) with a 3
    assert float(data.label[0]) == 0.0 and 0.3 < float(data.label.mean()) < 0.8
    assert torch.allclose(data.dense.mean(0), torch.zeros(3), atol=1e-5)
    dense, kjt, label = data.batch(torch.tensor([0, 1, 2]))
    assert kjt.keys() == list(data.sparse) and kjt.stride() == 3 and dense.shape == (3, 3)
    assert kjt["user_id"].lengths().tolist() == [1, 1, 1]


def test_missing_data_names_what_to_install(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_movielens(tmp_path)


def test_auc():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([1.0, 1.0]), torch.tensor([0, 1])) == 0.5


@pytest.mark.parametrize("kind", ["embfuse", "torch"])
def test_model_forward_backward_and_training_lowers_the_loss(kind):
    data = synthetic(2000, 50, seed=0, features=4, dense=3)
    train_idx, test_idx = data.split(0.2, 0)
    model = build(kind, data, args(), torch.device("cpu"))
    dense, kjt, label = data.batch(train_idx[:16])
    assert model(dense, kjt).shape == (16,)
    res = train(kind, model, data, train_idx, test_idx, args(epochs=3), torch.device("cpu"))
    first, last = torch.tensor(res.step_losses[:10]).mean(), torch.tensor(res.step_losses[-10:]).mean()
    assert last < first - 0.02
    assert res.lines[-1]["test_auc"] > 0.55


def test_both_models_train_alike_from_the_same_start():
    data = load_movielens(TINY)
    train_idx, test_idx = data.split(0.25, 0)
    a, b = (build(k, data, args(), torch.device("cpu")) for k in ("embfuse", "torch"))
    same_start(a, b)
    ra = train("embfuse", a, data, train_idx, test_idx, args(), torch.device("cpu"))
    rb = train("torch", b, data, train_idx, test_idx, args(), torch.device("cpu"))
    assert torch.allclose(torch.tensor(ra.step_losses), torch.tensor(rb.step_losses), atol=1e-4)


def test_the_same_seed_gives_the_same_run():
    """`embfuse demo --seed` is reproducible on the CPU: models built and trained twice from one
    seed give the same losses and AUCs; another seed gives other tables."""
    data = load_movielens(TINY)
    train_idx, test_idx = data.split(0.25, 0)

    def run(seed):
        a, b = (build(k, data, args(seed=seed), torch.device("cpu")) for k in ("embfuse", "torch"))
        same_start(a, b)
        return a, train("embfuse", a, data, train_idx, test_idx, args(seed=seed), torch.device("cpu"))

    (m1, r1), (m2, r2), (m3, _) = run(0), run(0), run(1)
    assert r1.step_losses == r2.step_losses and r1.lines == r2.lines
    assert torch.equal(m1.sparse.tables()[0], m2.sparse.tables()[0])
    assert not torch.equal(m1.sparse.tables()[0], m3.sparse.tables()[0])


def test_throughput_leaves_out_the_first_epochs_compiles(monkeypatch):
    """examples/s counts from the second epoch on: a fresh machine's first epoch compiles a Triton
    kernel for each batch shape it meets, its last (smaller) batch's too. On a fake clock every
    step takes 1 s and the first epoch's last step 1000 s: none of those count."""
    import types

    import embfuse.demo.run as demo_run

    clock = [0.0]
    monkeypatch.setattr(demo_run, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    data = synthetic(2000, 50, seed=0, features=4, dense=3)
    train_idx, test_idx = data.split(0.2, 0)
    model = build("embfuse", data, args(), torch.device("cpu"))
    steps, step = [0], model.sparse.step

    def ticking():
        steps[0] += 1
        clock[0] += 1000.0 if steps[0] == 25 else 1.0
        step()

    model.sparse.step = ticking
    res = train("embfuse", model, data, train_idx, test_idx, args(epochs=2), torch.device("cpu"))
    assert len(train_idx) == 1600  # (25 steps of 64 an epoch)
    assert res.examples_per_s == 1600 / 25


def test_the_demo_writes_its_results_with_what_ran_them(tmp_path):
    import json

    from embfuse.cli import main

    assert main(["demo", "--data", "synthetic", "--samples", "2000", "--rows", "50", "--epochs", "1",
                 "--batch-size", "256", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "demo.json").read_text())
    assert out["device"] == "cpu" and out["gpu"] is None and out["torch"] == torch.__version__
    assert out["commit"] and out["date"] and [r["name"] for r in out["results"]] == ["embfuse", "torch"]
    assert (tmp_path / "demo.png").exists()
