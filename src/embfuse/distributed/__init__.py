"""Sharded collections on torch.distributed (NCCL on GPUs, gloo on CPUs), launched by torchrun:
`shard(ebc, plan)` spreads an EmbeddingBagCollection's tables over the ranks (planner.py) and
exchanges ids and pooled rows with all-to-all collectives (sharded.py, comm.py)."""

from embfuse.distributed.comm import CommTimer
from embfuse.distributed.planner import SHARDING_TYPES, Shard, ShardingPlan, plan_shards
from embfuse.distributed.sharded import ShardedEmbeddingBagCollection, shard

__all__ = ["CommTimer", "SHARDING_TYPES", "Shard", "ShardingPlan", "ShardedEmbeddingBagCollection", "plan_shards",
           "shard"]
