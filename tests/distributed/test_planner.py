import pytest
import torch

from embfuse import EmbeddingBagConfig
from embfuse.distributed import plan_shards
from embfuse.optim import Adam


def tables():
    return [EmbeddingBagConfig(1000, 64, "big", feature_names=["a"]),
            EmbeddingBagConfig(100, 16, "small", feature_names=["b", "c"]),
            EmbeddingBagConfig(50, 16, "tiny", feature_names=["d"]),
            EmbeddingBagConfig(10, 3, "odd", feature_names=["e"])]


def test_the_cost_model_spreads_a_table_larger_than_a_fair_share_and_places_the_rest_by_load():
    plan = plan_shards(tables(), 2, memory_per_rank=2**30)
    assert plan.types == {"big": "row_wise", "small": "table_wise", "tiny": "table_wise", "odd": "table_wise"}
    assert [(s.rank, s.row_start, s.row_end) for s in plan.shards["big"]] == [(0, 0, 500), (1, 500, 1000)]
    # the two lookups of "small" go to one rank, the single lookups of the others to the other
    assert plan.shards["small"][0].rank != plan.shards["tiny"][0].rank
    assert plan_shards(tables(), 1, memory_per_rank=2**30).types["big"] == "table_wise"


def test_a_users_plan_mixes_types_and_places_tables():
    plan = plan_shards(tables(), 3, {"big": "column_wise", "odd": "column_wise", "tiny": ("table_wise", 2)},
                       memory_per_rank=2**30)
    assert [(s.col_start, s.col_end) for s in plan.shards["big"]] == [(0, 21), (21, 42), (42, 64)]
    assert [(s.rank, s.col_start, s.col_end) for s in plan.shards["odd"]] == [(0, 0, 1), (1, 1, 2), (2, 2, 3)]
    assert plan.shards["tiny"][0].rank == 2
    # fewer rows than ranks: row-wise uses the ranks that get rows
    assert len(plan_shards([EmbeddingBagConfig(2, 4, "t", feature_names=["f"])], 3, {"t": "row_wise"},
                           memory_per_rank=2**30).shards["t"]) == 2


def test_the_plan_prints_readably():
    text = str(plan_shards(tables(), 2, {"tiny": ("table_wise", 1)}, memory_per_rank=2**30))
    assert text.splitlines()[0] == "ShardingPlan over 2 rank(s)"
    assert "big    row_wise    0: [0:500) x [0:64), 1: [500:1000) x [0:64)" in text
    assert "tiny   table_wise  1: [0:50) x [0:16)" in text


@pytest.mark.parametrize("plan, match", [
    ({"nope": "row_wise"}, "the plan names table 'nope'"),
    ({"big": "diagonal"}, "sharding type must be one of"),
    ({"big": ("row_wise", 1)}, "only a table_wise table takes a rank"),
    ({"big": ("table_wise", 5)}, "rank 5 is outside the world of 2"),
])
def test_bad_plans_are_refused_by_name(plan, match):
    with pytest.raises(ValueError, match=match):
        plan_shards(tables(), 2, plan, memory_per_rank=2**30)


def test_a_plan_over_a_ranks_memory_is_refused():
    # big: 1000 x 64 fp32 weights + two fp32 Adam states = 768000 bytes on one rank
    with pytest.raises(ValueError, match="on rank 0, over its"):
        plan_shards(tables(), 2, {"big": "table_wise"}, optimizer=Adam(), memory_per_rank=700_000)
    plan_shards(tables(), 2, {"big": "table_wise"}, torch.float16, Adam(), memory_per_rank=700_000)


def test_table_wise_tables_balance_lookups_among_the_ranks_they_fit_on():
    ts = [EmbeddingBagConfig(rows, 64, name, feature_names=[f"f{name}"])
          for rows, name in ((500, "big"), (480, "mid"), (10, "s1"), (10, "s2"))]
    ranks = {t: s[0].rank for t, s in plan_shards(ts, 2, memory_per_rank=2**30).shards.items()}
    assert ranks == {"big": 0, "mid": 1, "s1": 1, "s2": 0}  # two lookups a rank, not by bytes (3 on rank 1)
    # rank 0 has no room left for s2 (big's 128000 bytes + 2560 > 130000): it goes where it fits
    ranks = {t: s[0].rank for t, s in plan_shards(ts, 2, memory_per_rank=130_000).shards.items()}
    assert ranks == {"big": 0, "mid": 1, "s1": 1, "s2": 1}
