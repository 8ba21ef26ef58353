"""`torchrun --nproc_per_node=N -m tests.distributed.torchrun_compare`: every plan and optimizer
against the unsharded collection, and TrainPipeline against the plain loop, on this launch's ranks (NCCL and CUDA tables when there is a
GPU, gloo and CPU tables otherwise)."""

import os

import torch
import torch.distributed as dist

from tests.distributed.test_pipeline import _pipeline_equals_plain_loop
from tests.distributed.test_sharded import _all_plans

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        device = "cuda" if cuda else "cpu"
        _all_plans(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: every plan matches the unsharded collection")
        _pipeline_equals_plain_loop(dist.get_rank(), dist.get_world_size(), device)
        print(f"rank {dist.get_rank()}: TrainPipeline trains as the plain loop, bitwise")
    finally:
        dist.destroy_process_group()
