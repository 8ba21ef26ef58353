"""`torchrun --nproc_per_node=N -m tests.distributed.torchrun_compare`: every plan and optimizer
against the unsharded collection (tables with TensorFlow's combiners and VBE batches too), a bad
batch on the last rank, a checkpoint from every rank loaded into one collection, TrainPipeline
against the plain loop, and the overlap pass (eager stages, and functional collectives under torch.compile)
against the eager model, on this launch's ranks (NCCL and CUDA tables when there is a GPU, gloo
and CPU tables otherwise)."""

import gc
import os
import tempfile

import torch
import torch.distributed as dist

from tests.distributed.test_pipeline import _pipeline_equals_plain_loop
from tests.fx.test_overlap import _compiled, _overlap
from tests.distributed.test_sharded import _all_plans, _errors, _save, _tf_plans, _vbe

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        device = "cuda" if cuda else "cpu"
        _all_plans(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: every plan matches the unsharded collection")
        _tf_plans(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: so do tables with TensorFlow's combiners")
        _vbe(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: and batches whose features have their own batch sizes")
        _errors(dist.get_rank(), dist.get_world_size(), device)
        _errors(dist.get_rank(), dist.get_world_size(), device, tf=True)
        print(f"rank {dist.get_rank()}: a bad batch on rank {dist.get_world_size() - 1} raised here too, "
              "nothing changed")
        with tempfile.TemporaryDirectory() as folder:
            _save(dist.get_rank(), dist.get_world_size(), os.path.join(folder, "full.pt"), device)
        print(f"rank {dist.get_rank()}: full_state_dict loads into one unsharded collection, bitwise")
        _pipeline_equals_plain_loop(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: TrainPipeline trains as the plain loop, bitwise")
        _pipeline_equals_plain_loop(dist.get_rank(), dist.get_world_size(), device,
                                    "mixed" if dist.get_world_size() > 1 else "mixed_unplaced", True)
        print(f"rank {dist.get_rank()}: and so on batches whose features have their own batch sizes")
        _overlap(dist.get_rank(), dist.get_world_size(), device)
        _overlap(dist.get_rank(), dist.get_world_size(), device, True)
        print(f"rank {dist.get_rank()}: the overlap pass's graph trains as the eager model, bitwise (VBE batches too)")
        _compiled(dist.get_rank(), dist.get_world_size(), "functional", device)
        print(f"rank {dist.get_rank()}: the functional overlap trains under torch.compile as the eager model")
    finally:
        gc.collect()  # torch.compile's cycles, collected before exit (tests/distributed/worlds.py says why)
        dist.destroy_process_group()
