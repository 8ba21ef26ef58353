"""`torchrun --nproc_per_node=N --no-python embfuse demo`: the DLRM click model with its tables
sharded over the ranks (embfuse.distributed, the default plan), trained twice from the same start:
by the plain loop and by TrainPipeline. Each step takes `--batch-size` examples split across the
ranks; the dense layers are replicated and their gradients averaged (all-reduce) before each
step. Per epoch, rank 0 prints train / test AUC over every rank's predictions.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import embfuse.distributed as ed
from embfuse.demo.run import Result, auc, build, restarts_timing


class Averaged:
    """The dense optimizer, after averaging the replicated dense gradients over the ranks."""

    def __init__(self, params, lr):
        self.params = list(params)
        self.opt = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=False)

    def step(self):
        world = dist.get_world_size()
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        flat /= world
        for p, g in zip(self.params, torch.split(flat, [p.numel() for p in self.params])):
            p.grad.copy_(g.view_as(p))
        self.opt.step()


class WithLoss(torch.nn.Module):
    """model(batch) -> (loss, logits), as TrainPipeline takes it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, b):
        logits = self.model(b["dense"], b["sparse_features"])
        return F.binary_cross_entropy_with_logits(logits, b["label"]), logits.detach()


def _host_batches(data, idx, batch_size, rank, world, seed, pin):
    """This rank's part of each global batch, on the host (pinned when the GPU trains)."""
    if seed is not None:
        idx = idx[torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))]
    for i in range(0, idx.numel() - world + 1, batch_size):  # (a last batch smaller than the world: dropped)
        mine = torch.tensor_split(idx[i:i + batch_size], world)[rank]
        dense, kjt, label = data.batch(mine)
        if pin:
            dense, kjt, label = dense.pin_memory(), kjt.pin_memory(), label.pin_memory()
        yield {"dense": dense, "sparse_features": kjt, "label": label}


@torch.no_grad()
def _evaluate(model, data, idx, device, rank, world) -> tuple[float, float]:
    """AUC and log-loss over every rank's predictions (each rank scores a slice; every rank runs
    the same number of forwards, as the collectives need)."""
    parts = torch.tensor_split(idx, world)
    size = max(p.numel() for p in parts)
    mine = torch.cat([parts[rank], parts[rank][-1:].expand(size - parts[rank].numel())])  # padded alike
    scores = []
    for i in range(0, size, 4096):
        dense, kjt, label = data.batch(mine[i:i + 4096])
        scores.append(model(dense.to(device), kjt.to(device)))
    scores = torch.cat(scores)
    every = [torch.empty_like(scores) for _ in range(world)]
    dist.all_gather(every, scores)
    s = torch.cat([e[:p.numel()] for e, p in zip(every, parts)]).cpu()
    y = data.label[torch.cat(list(parts))].float()
    return auc(s, y), float(F.binary_cross_entropy_with_logits(s.double(), y.double()))


def _train(name, model, data, train_idx, test_idx, args, device, rank, world, pipelined, say) -> Result:
    res = Result(name)
    loss_model = WithLoss(model)
    opt = Averaged(model.dense_parameters(), args.lr_dense)
    pipe = ed.TrainPipeline(loss_model, opt, device) if pipelined else None
    pin = device.type == "cuda"
    seen, elapsed = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        batches = _host_batches(data, train_idx, args.batch_size, rank, world, args.seed + epoch, pin)
        t0, step = time.perf_counter(), 0
        while True:
            if restarts_timing(epoch, step):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                t0, seen, elapsed = time.perf_counter(), 0, 0.0
            if pipe is not None:
                try:
                    loss, _ = pipe.progress(batches)
                except StopIteration:
                    break
            else:
                b = next(batches, None)
                if b is None:
                    break
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                opt.zero_grad()
                loss, _ = loss_model(b)
                loss.backward()
                opt.step()
            res.step_losses.append(loss.detach())
            seen += args.batch_size
            step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        elapsed += time.perf_counter() - t0
        model.eval()
        train_auc, train_loss = _evaluate(model, data, train_idx[:len(test_idx)], device, rank, world)
        test_auc, test_loss = _evaluate(model, data, test_idx, device, rank, world)
        line = {"epoch": epoch + 1, "train_auc": train_auc, "train_logloss": train_loss, "test_auc": test_auc,
                "test_logloss": test_loss}
        res.lines.append(line)
        say(f"{name:18s} epoch {epoch + 1}: train AUC {train_auc:.4f}  test AUC {test_auc:.4f}  test log-loss "
            f"{test_loss:.4f}")
    res.step_losses = [float(x) for x in res.step_losses]
    res.examples_per_s = seen / elapsed
    return res


def run(args, data, say) -> list[Result]:
    """Both loops on this rank (under torchrun); the results (rank 0 prints)."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_idx, test_idx = data.split(args.test_fraction, args.seed)
    say(f"{data.name}: {len(train_idx):,} training and {len(test_idx):,} test examples over {world} rank(s) "
        f"({dist.get_backend()}), batch {args.batch_size} = {world} x ~{args.batch_size // world}")
    results = []
    for name, pipelined in (("sharded, plain", False), ("sharded, pipelined", True)):
        model = build("embfuse", data, args, device)  # the same seed: both loops start alike
        model.sparse.ebc = ed.shard(model.sparse.ebc)
        if name == "sharded, plain":
            say(str(model.sparse.ebc.plan))
        results.append(_train(name, model, data, train_idx, test_idx, args, device, rank, world, pipelined, say))
    return results
