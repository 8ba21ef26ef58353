"""Graph passes on torch.fx graphs.

- `optimize(model)`: an eager model's embedding stage in its fast form (optimize.py): lookups
  batched into collections, per-feature chains fused, host-to-device copies combined.
- `passes`: each pass on its own.
- `capture(model, example_inputs, step)`: a step of an optimized model in a CUDA graph that
  replays batches of any bag lengths (capture.py).
- overlap.py: each sharded collection's all-to-alls split into requests and waits, scheduled
  around the ops that do not need them.
"""

from embfuse.fx import passes
from embfuse.fx.capture import CapturedStep, capture
from embfuse.fx.optimize import optimize, trace as trace_model
from embfuse.fx.overlap import ShardedTracer, overlap_collectives, split_collectives, trace

__all__ = ["CapturedStep", "capture", "optimize", "passes", "trace_model", "ShardedTracer", "overlap_collectives",
           "split_collectives", "trace"]
