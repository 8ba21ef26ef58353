"""TrainPipeline against the plain loop, batch for batch: the same losses and the same tables,
dense weights and optimizer state, bitwise (gloo, 2 ranks; NCCL with one GPU on the GPU)."""


from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

import embfuse.distributed as ed
from embfuse import EmbeddingBagCollection, KeyedJaggedTensor
from embfuse.distributed.comm import InputDist
from embfuse.optim import Adagrad
from tests.distributed.test_sharded import KEYS, PLANS, batch, kjt_of, tables, vbe_batch
from tests.distributed.twins import assert_trained_alike, dense, twins
from tests.distributed.worlds import run_world


class Model(torch.nn.Module):
    def __init__(self, sparse, width):
        super().__init__()
        self.sparse, self.bottom, self.top = sparse, torch.nn.Linear(3, 4), torch.nn.Linear(4 + width, 1)

    def forward(self, b):
        x = torch.cat([self.bottom(b["dense"]), self.sparse(b["sparse_features"]).values()], 1)
        logit = self.top(x).squeeze(1)
        return F.binary_cross_entropy_with_logits(logit, b["label"]), logit.detach()


def batches(rank, n, weighted=False, vbe=False):
    """`vbe`: batches whose features have their own batch sizes (TorchRec's VBE), 3 + rank samples."""
    out = []
    for step in range(n):
        kjt = vbe_batch(rank, step, weighted)[0] if vbe else kjt_of(batch(rank, step, weighted), weighted)
        g = torch.Generator().manual_seed(step * 10 + rank)
        B = kjt.inverse_indices()[1].shape[1] if vbe else kjt.stride()
        out.append({"dense": torch.randn(B, 3, generator=g), "sparse_features": kjt,
                    "label": torch.randint(0, 2, (B,), generator=g).float()})
    return out


def _pipeline_equals_plain_loop(rank, world, device="cpu", plan="mixed_unplaced", vbe=False):
    plain, piped = twins(Model, plan, device)
    data = batches(rank, 5, vbe=vbe)
    opt = torch.optim.Adam(dense(plain), lr=0.01)
    losses = []
    for b in data:
        b = {k: v.to(device) for k, v in b.items()}
        opt.zero_grad()
        loss, _ = plain(b)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    opt2 = torch.optim.Adam(dense(piped), lr=0.01)
    pipe = ed.TrainPipeline(piped, opt2, device)
    if torch.device(device).type == "cuda":  # the exchange's stream ahead of the backward's (NOTES, session 33)
        assert pipe._dist.priority < torch.cuda.current_stream().priority
    calls = []
    exchange = piped.sparse.input_dist
    piped.sparse.input_dist = lambda kjt: calls.append(kjt) or exchange(kjt)
    seen = []  # exchanges started when each batch's lookup begins: its own, a step ahead
    piped.sparse.register_forward_pre_hook(lambda m, args: seen.append(len(calls)))
    it = iter(data)
    got = []
    while True:
        try:
            loss, _ = pipe.progress(it)
        except StopIteration:
            break
        got.append(loss.detach())
    assert len(got) == len(losses) and seen == list(range(1, len(data) + 1)) and len(calls) == len(data)
    for a, b in zip(got, losses):
        assert torch.equal(a, b), (a, b)
    assert_trained_alike(plain, piped)


def test_the_pipeline_trains_as_the_plain_loop_bitwise():
    run_world(_pipeline_equals_plain_loop, 2)


def test_the_pipeline_trains_batches_whose_features_have_their_own_batch_sizes_as_the_plain_loop():
    """VBE batches: the prefetched exchange carries each batch's padding and inverse indices to
    its own step's output (a batch's rows expanded by another's would change the losses)."""
    run_world(_pipeline_equals_plain_loop, 2, "cpu", "mixed", True)


def _bad_batch_in_the_pipeline(rank, world):
    torch.manual_seed(1)
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables())
    model = Model(ed.shard(EmbeddingBagCollection(tables(), optimizer=Adagrad(lr=0.1)), PLANS["row_wise"]), width)
    data = batches(rank, 3)
    if rank == 1:  # the second batch of rank 1 has an id past its table
        kjt = data[1]["sparse_features"]
        values = kjt.values().clone()
        values[-1] = 1000
        data[1]["sparse_features"] = KeyedJaggedTensor(KEYS, values, lengths=kjt.lengths())
    pipe = ed.TrainPipeline(model, None, "cpu")
    it = iter(data)
    pipe.progress(it)  # the first batch trains (the second's exchange, started meanwhile, failed)
    before = model.sparse.full_state_dict()
    try:
        pipe.progress(it)
        raise AssertionError("the bad batch trained")
    except IndexError as e:
        assert str(e).startswith("rank 1's batch: "), str(e)
    after = model.sparse.full_state_dict()
    for k in before:
        assert torch.equal(after[k], before[k]), k


def test_a_bad_batch_in_the_pipeline_raises_at_its_own_step_on_every_rank():
    run_world(_bad_batch_in_the_pipeline, 2)


def test_what_the_exchange_made_on_its_stream_is_recorded_to_the_stream_that_reads_it():
    """TrainPipeline runs a batch's input exchange on its own stream and the lookup on the
    current one: what the exchange made there (the ids that arrived; a VBE batch's output rows,
    which the backward reads) is recorded to the reading stream, or its memory could go to the
    next batch's exchange while the backward still reads it."""
    owner = SimpleNamespace(device=torch.device("cuda", 0), comm_timer=None)
    recv, rows = torch.arange(4), torch.tensor([[0], [0]])
    calls = []
    with mock.patch.object(torch.Tensor, "record_stream", lambda t, stream: calls.append((id(t), stream))), \
            mock.patch.object(torch.cuda, "current_stream", lambda device: ("current", device)):
        assert InputDist(owner, None, 2, [2], [[1]], recv, None, rows).wait() is recv
        assert InputDist(owner, None, 2, [2], [[1]], recv, None).wait() is recv
    current = ("current", owner.device)
    assert calls == [(id(recv), current), (id(rows), current), (id(recv), current)]
