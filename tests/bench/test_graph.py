"""`embfuse bench --fx` on a GPU, small: every variant that needs no compiler runs on pageable and
on pinned batches, counts its launches and copies, and the report says where the ids started."""

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pinned", [False, True])
def test_the_fx_bench_measures_each_variant(pinned, tmp_path):
    from embfuse.bench.graph import markdown, measure, write

    variants = ("eager", "optimize", "optimize + CUDA graph")
    result = measure(features=4, dim=8, batch=64, mean_length=3, rows=(10, 100), rounds=1, calls=2,
                     variants=variants, pinned=pinned)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(variants) and not any("error" in r for r in rows.values()), rows
    for r in rows.values():
        assert r["forward_ms"] > 0 and r["step_ms"] > 0
    assert rows["eager"]["forward_h2d_copies"] == 8  # ids and offsets of 4 features, each on its own
    assert rows["optimize"]["forward_h2d_copies"] == 1 and rows["optimize + CUDA graph"]["step_h2d_copies"] == 1
    assert result["model"]["pinned"] is pinned
    assert ("start in pinned host memory" in markdown(result)) is pinned
    assert write(result, tmp_path).exists()
