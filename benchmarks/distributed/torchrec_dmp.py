"""The peer of `embfuse bench --distributed`: TorchRec's DistributedModelParallel over FBGEMM's
TBE, the same 26 Criteo-like tables x 128, the same power-law batches (B16384 a rank: weak
scaling), row-wise Adagrad fused into the backward (apply_optimizer_in_backward), TorchRec's
default planner. Each step timed as `embfuse bench --distributed` times its own (time_steps:
forward, sum, backward with the fused update, synchronised, every rank started together),
median of STEPS after WARMUP.
`PYTHONPATH=src:FBGEMM:TORCHREC torchrun --nproc_per_node=N benchmarks/distributed/torchrec_dmp.py`
(NOTES, session 32: how the wheels were carried)."""

import os
import statistics

import torch
import torch.distributed as dist

_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def _has_kernel_or_no_op(op, key):
    """The trimmed FBGEMM (shared/peers/fbgemm_for_device.sh) leaves out the inference library,
    whose ops `import torchrec` registers fake kernels for; an op that does not exist is skipped."""
    try:
        return _has_kernel(op, key)
    except RuntimeError:
        return True


torch._C._dispatch_has_kernel_for_dispatch_key = _has_kernel_or_no_op
import torchrec  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: E402

from embfuse.bench.collection import make_batch, table_rows  # noqa: E402
from embfuse.bench.distributed import time_steps  # noqa: E402
from embfuse.bench.workloads import Workload  # noqa: E402

STEPS, WARMUP = 20, 5
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", torch.cuda.current_device())
B = int(os.environ.get("BATCH", 16384))
w = Workload("criteo-sharded", "collection-train-rowwise", 1_000_000, 128, B, 20, "powerlaw", 1.05, "csr", tables=26)
torch.manual_seed(0)
ebc = torchrec.EmbeddingBagCollection(
    tables=[torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=r, feature_names=[f"f{i}"])
            for i, r in enumerate(table_rows(w))], device=torch.device("meta"))
apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
model = DistributedModelParallel(ebc, device=dev)
if rank == 0:
    print(model.plan, flush=True)


def batch(i):
    k = make_batch(w, dev, seed=1000 * rank + i)
    return torchrec.KeyedJaggedTensor(keys=k.keys(), values=k.values().long(), lengths=k.lengths().long())


batches = [batch(i) for i in range(4)]
step = statistics.median(time_steps(model, batches, STEPS, WARMUP, dev)[0])
every = [None] * world
dist.all_gather_object(every, step)
if rank == 0:
    print(f"TorchRec {torchrec.__version__} DMP, world {world}, B{B} a rank: step (us) by rank "
          f"{[round(s * 1e6) for s in every]}, examples/s all ranks {sum(B / s for s in every):,.0f}", flush=True)
dist.destroy_process_group()
