import pytest
import torch

import embfuse
from tests.conftest import DEVICES
from tests.tolerances import assert_close


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_bag_state_dict_round_trips_with_torch(device):
    ours = embfuse.nn.EmbeddingBag(20, 6, mode="sum", padding_idx=0, device=device)
    theirs = torch.nn.EmbeddingBag(20, 6, mode="sum", padding_idx=0, device=device)
    theirs.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randint(0, 20, (5, 3), device=device)
    assert_close(ours(x), theirs(x), torch.float32, reduction=3)
    ours.load_state_dict(torch.nn.EmbeddingBag(20, 6, device=device).state_dict())
    assert isinstance(ours, torch.nn.EmbeddingBag)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_from_pretrained_and_training_step_match_torch(device):
    pretrained = torch.randn(15, 4, device=device)
    ours = embfuse.nn.Embedding.from_pretrained(pretrained.clone(), freeze=False, sparse=True)
    theirs = torch.nn.Embedding.from_pretrained(pretrained.clone(), freeze=False, sparse=True)
    assert type(ours) is embfuse.nn.Embedding
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randint(0, 15, (8, 2), device=device)
        for m, opt in [(ours, opt_o), (theirs, opt_t)]:
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    assert_close(ours.weight, theirs.weight, torch.float32, reduction=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam"])
def test_rowwise_sparse_module_trains_with_torch_sparse_optimizers(device, optimizer):
    """sparse="rowwise" hands torch's sparse optimizers one entry per touched row."""
    ours = embfuse.nn.EmbeddingBag(30, 4, mode="mean", sparse="rowwise", device=device)
    theirs = torch.nn.EmbeddingBag(30, 4, mode="mean", sparse=True, device=device)
    theirs.load_state_dict(ours.state_dict())
    make = getattr(torch.optim, optimizer)
    opts = [make(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for _ in range(3):
        x = torch.randint(0, 30, (8, 5), device=device)
        x[:, 0] = 2
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
        assert ours.weight.grad._nnz() == x.unique().numel()
    assert_close(ours.weight, theirs.weight, torch.float32, reduction=40)


def test_modules_pass_bounds_check_through():
    bag = embfuse.nn.EmbeddingBag(5, 2, mode="sum", bounds_check="skip")
    with pytest.warns(UserWarning, match="skipped 1"):
        out = bag(torch.tensor([[1, 7]]))
    assert_close(out, bag.weight[1:2], torch.float32)
    with pytest.raises(IndexError, match="out of range for a table of 5 rows"):
        embfuse.nn.Embedding(5, 2)(torch.tensor([5]))


def test_options_a_fused_module_cannot_take_are_refused_at_construction():
    import pytest

    with pytest.raises(ValueError, match="mode='max'"):
        embfuse.nn.EmbeddingBag(10, 4, mode="max", optimizer=embfuse.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="sparse=True"):
        embfuse.nn.EmbeddingBag(10, 4, sparse=True, optimizer=embfuse.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="scale_grad_by_freq=True"):
        embfuse.nn.Embedding(10, 4, scale_grad_by_freq=True, optimizer=embfuse.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="hot_rows is a path of the fused training step"):
        embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(10, 4, "t", feature_names=["f"])], hot_rows=4)
    with pytest.raises(TypeError, match="num_embeddings must be an int, got 2.5"):
        embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(2.5, 4, "t", feature_names=["f"])])
    with pytest.raises(TypeError, match="padding_idx must be an int or None, got True"):
        embfuse.embedding_bag(torch.tensor([1]), torch.randn(10, 4), torch.tensor([0]), padding_idx=True)
    w = torch.randn(10, 4)
    with pytest.raises(TypeError, match="per_sample_weights must have the same type as weight") as e:
        embfuse.embedding_bag(torch.tensor([1, 2]), w, torch.tensor([0]), mode="sum",
                              per_sample_weights=torch.rand(2, dtype=torch.float64))
    assert isinstance(e.value, RuntimeError)
