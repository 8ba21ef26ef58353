"""Graph passes on torch.fx graphs. overlap.py: each sharded collection's all-to-alls split into
requests and waits, scheduled around the ops that do not need them."""

from embfuse.fx.overlap import ShardedTracer, overlap_collectives, split_collectives, trace

__all__ = ["ShardedTracer", "overlap_collectives", "split_collectives", "trace"]
