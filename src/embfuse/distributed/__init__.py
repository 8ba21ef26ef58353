"""Sharded collections on torch.distributed (NCCL on GPUs, gloo on CPUs), launched by torchrun:
`shard(ebc, plan)` spreads an EmbeddingBagCollection's tables over the ranks (planner.py) and
exchanges ids and pooled rows with all-to-all collectives (sharded.py, comm.py); TrainPipeline
overlaps the next batches' copy and exchange with this batch's compute (pipeline.py)."""

from embfuse.distributed.comm import CommTimer, InputDist, OutputDist
from embfuse.distributed.planner import SHARDING_TYPES, Shard, ShardingPlan, plan_shards
from embfuse.distributed.sharded import ShardedEmbeddingBagCollection, shard
from embfuse.distributed.pipeline import TrainPipeline

__all__ = ["CommTimer", "InputDist", "OutputDist", "SHARDING_TYPES", "Shard", "ShardingPlan",
           "ShardedEmbeddingBagCollection", "TrainPipeline", "plan_shards", "shard"]
