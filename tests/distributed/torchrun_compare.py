"""`torchrun --nproc_per_node=N -m tests.distributed.torchrun_compare`: every plan and optimizer
against the unsharded collection on this launch's ranks (NCCL and CUDA tables when there is a
GPU, gloo and CPU tables otherwise)."""

import os

import torch
import torch.distributed as dist

from tests.distributed.test_sharded import _all_plans

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        _all_plans(dist.get_rank(), dist.get_world_size(), "cuda" if cuda else "cpu")
        print(f"rank {dist.get_rank()}: every plan matches the unsharded collection")
    finally:
        dist.destroy_process_group()
