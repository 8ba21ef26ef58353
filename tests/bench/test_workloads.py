import dataclasses

import pytest
import torch

import embfuse
from embfuse.bench.report import markdown, table
from embfuse.bench.runner import count_bytes, derive
from embfuse.bench.workloads import Workload, generate_batch, workloads


def test_workload_names_are_unique():
    for quick in (False, True):
        names = [w.name for w in workloads(quick)]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("dist,alpha", [("uniform", 0.0), ("powerlaw", 1.05), ("ranked", 1.05), ("hotset", 0.9)])
def test_generators_stay_in_range_and_skew_as_asked(dist, alpha):
    w = Workload("t", "bag", 100_000, 4, 512, 16, dist, alpha)
    ids, offsets = generate_batch(w, "cpu")
    assert ids.shape == (512, 16) and offsets is None
    assert 0 <= int(ids.min()) and int(ids.max()) < w.rows
    distinct = ids.unique().numel() / ids.numel()
    assert distinct > 0.9 if dist == "uniform" else distinct < 0.6
    # ranked: the hottest rows are the first ones; powerlaw scatters them over the table
    first = (ids < w.rows // 100).double().mean()
    assert first > 0.5 if dist == "ranked" else first < 0.2  # (rank 0 is id 0 either way)


def test_csr_batch_and_byte_count():
    w = Workload("t", "bag", 1000, 8, 64, 4, layout="csr")
    ids, offsets = generate_batch(w, "cpu")
    assert offsets.shape == (65,) and int(offsets[-1]) == ids.numel()
    c = count_bytes(w, ids, offsets)
    assert c["min_bytes"] == c["distinct_rows"] * 8 * 4 + 64 * 8 * 4 + ids.numel() * 8 + 65 * 8


def test_derive_and_markdown():
    w = Workload("t", "bag", 1000, 8, 64, 4)
    rows = [{"workload": "t", "provider": p, "min_bytes": 1e6, "rows_bytes": 2e6, "us": us}
            for p, us in (("torch", 20.0), ("embfuse", 10.0))]
    derive(rows, bandwidth=1e12)
    assert rows[1]["speedup_vs_torch"] == 2.0 and rows[1]["pct_roofline"] == pytest.approx(10.0)
    md = markdown({"rows": rows, "workloads": [dataclasses.asdict(w)]})
    assert "| t | 20.0 | 10.0 | 10% |" in md


def test_table_notes_keep_a_mismatch_beside_the_host_time():
    from rich.console import Console

    rows = [{"workload": "t", "provider": "embfuse", "us": 10.0, "matches_first": False, "host_us_per_call": 42.0},
            {"workload": "t", "provider": "torch", "us": 12.0, "host_us_per_call": 30.0}]
    meta = {"gpu": "g", "copy_bandwidth_GBps": 1.0, "torch": "t", "triton": "t", "fbgemm_gpu": "-", "commit": "c"}
    console = Console(record=True, width=300)
    console.print(table({"meta": meta, "rows": rows}))
    text = console.export_text()
    assert "MISMATCH, host 42 us/call" in text and "host 30 us/call" in text


def test_tables_give_the_gpu_time_of_a_time_that_is_mostly_the_hosts():
    from rich.console import Console

    rows = [{"workload": "t", "provider": "embfuse", "us": 215.5, "gpu_us": 74.6, "host_us_per_call": 132.0},
            {"workload": "t", "provider": "torch", "us": 71.4, "gpu_us": 63.6, "host_us_per_call": 64.0}]
    md = markdown({"rows": rows, "workloads": []})
    assert "| t | 215.5 (GPU 74.6) | 71.4 | - |" in md and "mostly the host's" in md
    assert "GPU" not in markdown({"rows": rows[1:], "workloads": []})
    meta = {"gpu": "g", "copy_bandwidth_GBps": 1.0, "torch": "t", "triton": "t", "fbgemm_gpu": "-", "commit": "c"}
    console = Console(record=True, width=300)
    console.print(table({"meta": meta, "rows": rows}))
    text = console.export_text()
    assert "215.5 (GPU 74.6)" in text and "(GPU 63.6)" not in text


def test_results_name_their_commit_and_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    import subprocess

    from embfuse.bench.runner import commit

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    monkeypatch.delenv("EMBFUSE_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # (no repository around tmp_path)
    assert commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "new.py").write_text("")  # untracked: the tree measured is still HEAD's
    assert commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("EMBFUSE_COMMIT", "abc+prod")
    assert commit(tmp_path) == "abc+prod"


def test_train_steps_run_and_update_on_cpu():
    from embfuse.bench.train import TRAIN_PROVIDERS, batches, count_train_bytes

    w = Workload("t", "train", 50, 4, 8, 3, tables=2)
    ids = batches(w, "cpu")
    assert count_train_bytes(w, ids, True)["min_bytes"] > count_train_bytes(w, ids, False)["min_bytes"]
    for name in ("torch", "embfuse", "embfuse rowwise-adagrad"):
        step, mods = TRAIN_PROVIDERS[name](w, ids, "cpu")
        before = mods[0].weight.detach().clone()
        step()
        assert not torch.equal(before, mods[0].weight.detach()), name


def test_dense_backward_steps_fill_gradients_on_cpu():
    from embfuse.bench.train import BACKWARD_PROVIDERS, batches

    w = Workload("t", "backward", 50, 4, 8, 3)
    ids = batches(w, "cpu")
    grads = []
    for make in BACKWARD_PROVIDERS.values():
        step, tables = make(w, ids, "cpu")
        step()
        grads.append(tables[0].grad)
    assert grads[0].abs().sum() > 0 and grads[0].shape == grads[1].shape


def test_collection_batch_and_providers_on_cpu():
    from embfuse.bench.collection import COLLECTION_PROVIDERS, count_bytes, make_batch, table_rows

    w = Workload("c", "collection-train", 1000, 4, 8, 3, "powerlaw", 1.05, tables=5)
    kjt = make_batch(w, "cpu")
    assert int(kjt.lengths().min()) >= 1 and int(kjt.lengths().max()) <= 5
    assert table_rows(w) == [1000, 583, 1000, 1000, 305]
    for jt, rows in zip(kjt.to_dict().values(), table_rows(w)):
        assert int(jt.values().max()) < rows
    assert count_bytes(w, kjt)["ids"] == kjt.values().numel()
    outs = []
    for name in ("torch", "embfuse"):
        forward, opt, move, _ = COLLECTION_PROVIDERS[name](w, kjt, "cpu", True)
        out = forward(move(kjt))
        assert out.shape == (8, 20)
        out.sum().backward()
        outs.append(out)


def test_rowwise_collection_providers_on_cpu():
    """The row-wise kind trains embfuse's collections with row-wise Adagrad; torch has none."""
    from embfuse.bench.collection import COLLECTION_PROVIDERS, make_batch
    from embfuse.bench.peers import Unsupported

    w = Workload("c", "collection-train-rowwise", 1000, 4, 8, 3, "powerlaw", 1.05, tables=5)
    kjt = make_batch(w, "cpu")
    for name in ("embfuse", "embfuse-hot"):
        forward, _, move, (ebc,) = COLLECTION_PROVIDERS[name](w, kjt, "cpu", True)
        forward(move(kjt)).sum().backward()
        assert isinstance(ebc.optimizer, embfuse.optim.RowWiseAdagrad)
    with pytest.raises(Unsupported):
        COLLECTION_PROVIDERS["torch"](w, kjt, "cpu", True)


def test_l2_bench_batches_and_report_on_cpu(tmp_path):
    """bench --l2's batches (one table: fixed L ids a bag; tables: make_batch's over their rows),
    its table and files; the GPU measure itself runs on the device machine."""
    from embfuse.bench import residency

    one, twelve = residency.WORKLOADS[0], residency.WORKLOADS[-1]
    small = [residency.Workload(w.name, w.kind, 1000, w.dim, 8, w.hotness, w.dist, w.alpha, tables=w.tables)
             for w in (one, twelve)]
    b1 = residency._batch(small[0], "cpu", 0)
    assert b1.values().numel() == 8 * one.hotness and bool((b1.values() < 1000).all())
    b12 = residency._batch(small[1], "cpu", 0)
    assert b12.keys() == [f"f{i}" for i in range(12)] and bool((b12.values() < 1000).all())
    row = {"workload": "w", "embfuse": 10.0, "embfuse resident": 8.0, "fbgemm": "skipped", "hit": 0.5,
           "residency": "in place", "window_MB": 1.0, "dram_bound_us": 5.0, "all_in_l2_us": 4.0,
           "embfuse GPU": 9.0, "embfuse resident GPU": 6.0}
    meta = {"gpu": "g", "torch": "t", "triton": "3", "fbgemm_gpu": None, "commit": "c", "date": "d",
            "copy_bandwidth_GBps": 1.0, "persisting": {"max_persisting_bytes": 2**20}}
    path = residency.write({"meta": meta, "rows": [row]}, tmp_path)
    text = path.read_text()
    assert "| w | 10.0 | 8.0 |" in text and "1.25x" in text and (tmp_path / "bench-l2.json").exists()
    assert "| 0.50 (in place) |" in text
    assert text.rstrip().endswith("| 9.0 | 6.0 | - | 1.50x |")  # GPU time: embfuse, resident, FBGEMM
