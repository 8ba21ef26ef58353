"""`embfuse demo`: train the DLRM click model with embfuse's and with torch's embeddings, side by side.

Both models start from the same weights and see the same batches; per epoch one line with train
AUC, test AUC and log-loss; at the end a table (examples/s, time in embedding ops, memory) and
a plot of the loss curves and throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from embfuse.demo.data import Dataset
from embfuse.demo.model import DLRM, EmbfuseSparse, TorchSparse


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    scores, labels = scores.double().cpu(), labels.double().cpu()
    pos = labels.sum()
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct score's first sample
    avg_rank = first.double() + (counts.double() + 1) / 2
    rank_sum = avg_rank[inverse][labels > 0].sum()
    return float((rank_sum - pos * (pos + 1) / 2) / (pos * neg))


@dataclass
class Result:
    name: str
    lines: list[dict] = field(default_factory=list)  # per epoch
    step_losses: list[float] = field(default_factory=list)
    examples_per_s: float = 0.0
    embedding_ms_per_step: float = 0.0
    memory_mb: float = 0.0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(data: Dataset, idx: torch.Tensor, batch_size: int, device, seed: int | None):
    """(dense, kjt, label) on the device; shuffled when `seed` is given. The KJT crosses in one copy."""
    if seed is not None:
        idx = idx[torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))]
    pin = device.type == "cuda"
    for i in range(0, idx.numel(), batch_size):
        dense, kjt, label = data.batch(idx[i:i + batch_size])
        if pin:
            dense, kjt, label = dense.pin_memory(), kjt.pin_memory(), label.pin_memory()
        yield (dense.to(device, non_blocking=True), kjt.to(device, non_blocking=True),
               label.to(device, non_blocking=True))


@torch.no_grad()
def evaluate(model, batches) -> tuple[float, float]:
    scores, labels = [], []
    for dense, kjt, label in batches:
        scores.append(model(dense, kjt))
        labels.append(label)
    s, y = torch.cat(scores), torch.cat(labels)
    return auc(s, y), float(F.binary_cross_entropy_with_logits(s, y))


def embedding_time_ms(model, batches, device, steps: int = 20, warmup: int = 3) -> float:
    """Forward + backward (+ update) of the sparse part alone: the median step after `warmup`
    untimed ones, as the benchmarks time (one slow step, a compile or a page fault, moves no
    figure)."""
    sparse = model.sparse
    times = []
    for k, (_, kjt, _) in enumerate(batches):
        if len(times) == steps:
            break
        _sync(device)
        t0 = time.perf_counter()
        out = sparse(kjt)
        out = [out] if torch.is_tensor(out) else out  # (no cat of a list: it would be timed too)
        torch.autograd.backward(out, [torch.full_like(o, 1e-6) for o in out])
        sparse.step()
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return float(torch.tensor(times).median()) * 1e3 if times else 0.0


WARMUP_STEPS = 5  # not timed: Triton compiles each kernel on its first call


def restarts_timing(epoch: int, step: int) -> bool:
    """Whether the throughput's count starts again before this step of `epoch` (both from 0):
    after WARMUP_STEPS steps, and again at the second epoch. A fresh machine's first epoch
    compiles Triton kernels, which took longer than all the epochs' training when kernels were
    specialised on each batch's count of ids (benchmarks/NOTES.md, sessions 62 and 63); a batch
    that takes another launch shape can still compile its own."""
    return (epoch, step) in ((0, WARMUP_STEPS), (1, 0))


def train(name, model, data, train_idx, test_idx, args, device, progress=None) -> Result:
    res = Result(name)
    opt = torch.optim.Adam(model.dense_parameters(), lr=args.lr_dense)
    seen, elapsed = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        _sync(device)
        t0 = time.perf_counter()
        for step, (dense, kjt, label) in enumerate(_batches(data, train_idx, args.batch_size, device,
                                                            seed=args.seed + epoch)):
            if restarts_timing(epoch, step):
                _sync(device)
                t0, seen, elapsed = time.perf_counter(), 0, 0.0
            loss = F.binary_cross_entropy_with_logits(model(dense, kjt), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            model.sparse.step()
            res.step_losses.append(loss.item())
            seen += label.numel()
            if progress is not None:
                progress(label.numel())
        _sync(device)
        elapsed += time.perf_counter() - t0
        model.eval()
        train_auc, train_loss = evaluate(model, _batches(data, train_idx[:len(test_idx)], 4096, device, None))
        test_auc, test_loss = evaluate(model, _batches(data, test_idx, 4096, device, None))
        res.lines.append({"epoch": epoch + 1, "train_auc": train_auc, "train_logloss": train_loss,
                          "test_auc": test_auc, "test_logloss": test_loss})
    res.examples_per_s = seen / elapsed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res.embedding_ms_per_step = embedding_time_ms(model, _batches(data, train_idx, args.batch_size, device, 0),
                                                  device)
    res.memory_mb = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                     else model.sparse.memory_bytes()) / 2**20
    return res


def build(kind: str, data: Dataset, args, device) -> DLRM:
    multi = {k for k, v in data.sparse.items() if v.dim() == 2}
    cls = EmbfuseSparse if kind == "embfuse" else TorchSparse
    torch.manual_seed(args.seed)  # the tables' initial values (same_start then makes both models' equal)
    sparse = cls(data.rows, args.dim, args.lr_sparse, device, multi)
    torch.manual_seed(args.seed + 1)  # the same dense layers for both models
    model = DLRM(sparse, data.dense.shape[1], len(data.sparse), args.dim).to(device)
    return model


def same_start(a: DLRM, b: DLRM) -> None:
    """Copy a's embedding tables into b (their inits differ): both models start equal."""
    with torch.no_grad():
        for x, y in zip(a.sparse.tables(), b.sparse.tables()):
            y.copy_(x)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        losses = torch.tensor(r.step_losses)
        k = max(1, losses.numel() // 100)
        smooth = losses[: losses.numel() // k * k].view(-1, k).mean(1)
        ax1.plot(torch.arange(smooth.numel()) * k, smooth, label=r.name)
        ax2.plot([x["epoch"] for x in r.lines], [x["test_logloss"] for x in r.lines], marker="o", label=r.name)
    ax3.bar([r.name for r in results], [r.examples_per_s for r in results], color=["tab:blue", "tab:orange"])
    ax1.set(title="training loss (smoothed)", xlabel="step", ylabel="log-loss")
    ax2.set(title="test log-loss", xlabel="epoch")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # epochs are whole
    ax3.set(title="training throughput", ylabel="examples / s")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
