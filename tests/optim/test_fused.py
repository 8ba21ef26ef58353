import copy

import pytest
import torch
import torch.nn.functional as F

import embfuse
from embfuse.optim import Adagrad, Adam, RowWiseAdagrad, SGD, apply_sparse_update, apply_sparse_update_reference
from embfuse.optim.rules import init_state
from tests.conftest import DEVICES, KERNEL_DEVICE, requires_kernels
from tests.tolerances import assert_close, random_bags

# SGD and row-wise Adagrad with and without weight decay (the kernel compiles each separately;
# without it, row-wise Adagrad takes its step sizes before the tile's rows are split in groups)
OPTIMIZERS = [SGD(lr=0.1, weight_decay=0.01), SGD(lr=0.1),
              Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
              RowWiseAdagrad(lr=0.1, weight_decay=0.01), RowWiseAdagrad(lr=0.1), Adam(lr=0.05, weight_decay=0.01)]
OPT_IDS = ["sgd", "sgd-no-decay", "adagrad", "rowwise", "rowwise-no-decay", "adam"]


@requires_kernels
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 3, 64, 129])
def test_kernel_update_matches_float64_reference(opt, dtype, D):
    N, n = 30, 200
    base = torch.randn(N, D, device=KERNEL_DEVICE)
    ids = torch.randint(0, N, (n,), device=KERNEL_DEVICE)
    ids[::3] = 7  # a hot row: runs longer than a chunk
    ids[::11] = -1  # positions that update nothing
    src = torch.randn(50, D, device=KERNEL_DEVICE)
    src_row = torch.randint(0, 50, (n,), device=KERNEL_DEVICE)
    scale = torch.rand(n, device=KERNEL_DEVICE) + 0.5
    w, state = base.to(dtype), init_state(opt, N, D, KERNEL_DEVICE)
    for k in state:
        state[k].uniform_(0.1, 1.0)
    w64, state64 = w.double(), {k: v.double() for k, v in state.items()}
    # two steps in fp32; one in fp16/bf16, where rounding the table between steps can move
    # kernel and reference an ulp apart and the next step carries that on
    for step in (1, 2) if dtype == torch.float32 else (1,):
        apply_sparse_update(w, state, opt, ids, src.to(dtype), src_row, scale, step, padding_idx=3, kernel=True)
        apply_sparse_update_reference(w64, state64, opt, ids, src.to(dtype).double(), src_row, scale.double(), step,
                                      padding_idx=3)
    assert_close(w, w64, dtype, reduction=8)
    for k in state:
        assert_close(state[k], state64[k], torch.float32, reduction=n)
    assert torch.equal(w[3], base.to(dtype)[3])  # padding row untouched


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=requires_kernels)], ids=["reference", "kernel"])
@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.05)],
                         ids=["sgd", "adagrad", "rowwise", "adam"])
def test_no_weight_decay_adds_no_term(kernel, opt):
    """Without weight decay a rule adds no 0 * w to the gradient (torch.optim's rule, the
    kernels' WD): an inf weight stays inf where a 0 * inf term would make its row NaN."""
    device = KERNEL_DEVICE if kernel else "cpu"
    w = torch.randn(5, 4, device=device)
    w[2, 0] = float("inf")
    state = init_state(opt, 5, 4, device)
    ids = torch.tensor([2, 0, 2], device=device)
    apply_sparse_update(w, state, opt, ids, torch.randn(3, 4, device=device), None, None, 1, kernel=kernel)
    assert w[2, 0] == float("inf") and torch.isfinite(w[2, 1:]).all() and torch.isfinite(w[0]).all()


@requires_kernels
def test_kernel_update_is_bitwise_deterministic():
    N, D, n = 2, 64, 1200  # runs of ~600 positions: two pieces each
    ids = torch.randint(0, N, (n,), device=KERNEL_DEVICE)
    src = torch.randn(n, D, device=KERNEL_DEVICE)
    results = []
    for _ in range(3):
        w = torch.ones(N, D, device=KERNEL_DEVICE)
        state = init_state(Adam(), N, D, KERNEL_DEVICE)
        apply_sparse_update(w, state, Adam(), ids, src, kernel=True)
        results.append((w, state["exp_avg_sq"]))
    ref_w, ref_state = torch.ones(N, D, dtype=torch.float64), init_state(Adam(), N, D, "cpu")
    ref_state = {k: v.double() for k, v in ref_state.items()}
    apply_sparse_update_reference(ref_w, ref_state, Adam(), ids.cpu(), src.double().cpu(), None, None, 1)
    assert_close(results[0][0], ref_w, torch.float32, reduction=n)
    assert all(torch.equal(results[0][0], r[0]) and torch.equal(results[0][1], r[1]) for r in results)


@requires_kernels
@pytest.mark.parametrize("opt,dtype", [(Adam(lr=0.05, betas=(0.8, 0.9), weight_decay=0.01), torch.float32),
                                       (Adagrad(lr=0.1, lr_decay=0.5), torch.float32),
                                       (SGD(lr=0.1, stochastic_rounding=True), torch.bfloat16)],
                         ids=["adam", "adagrad-lr-decay", "sgd-stochastic-rounding"])
def test_an_update_reads_a_graphs_step_as_it_reads_the_hosts(opt, dtype):
    """Inside a CUDA graph the update takes its per-step hyper-parameters and seed from a float64
    copy on the GPU that the graph advances (rules.graph_hyper): three good steps and a bad one
    there give step 4's update bitwise, as the host's step number 4 does."""
    from embfuse.optim.rules import HYPER_STEP

    N, D, n = 20, 8, 300
    ids = torch.randint(0, N, (n,), device=KERNEL_DEVICE)
    src = torch.randn(n, D, device=KERNEL_DEVICE)
    hyper = torch.tensor([*opt.hyper(1), 0], dtype=torch.float64, device=KERNEL_DEVICE)
    for good in (1, torch.tensor(True), torch.tensor(False), 1, 1):
        opt.graph_hyper(hyper, good)
    assert hyper[HYPER_STEP] == 4 and opt.per_step()
    before = torch.randn(N, D).to(KERNEL_DEVICE, dtype)
    results = []
    for step in (4, hyper):
        w, state = before.clone(), init_state(opt, N, D, KERNEL_DEVICE)
        apply_sparse_update(w, state, opt, ids, src, step=step, kernel=True)
        results.append([w, *state.values()])
    for host, graph in zip(*results):
        assert torch.equal(host, graph)
    assert not torch.equal(results[0][0], before)


def _pair(device, mode, torch_opt, opt, N=12, D=5):
    ours = embfuse.nn.EmbeddingBag(N, D, mode=mode, optimizer=opt, device=device)
    theirs = torch.nn.EmbeddingBag(N, D, mode=mode, device=device)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    return ours, theirs, torch_opt(theirs.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("name,opt,torch_opt", [
    ("sgd", SGD(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
    ("adagrad", Adagrad(lr=0.5, lr_decay=0.1, initial_accumulator_value=0.1),
     lambda p: torch.optim.Adagrad(p, lr=0.5, lr_decay=0.1, initial_accumulator_value=0.1)),
    ("adam", Adam(lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
])
def test_training_equals_torch_optim_on_the_dense_gradient(device, mode, name, opt, torch_opt):
    ours, theirs, topt = _pair(device, mode, torch_opt, opt)
    for step in range(3):
        x, offsets = random_bags(6, 5, 12, device)
        x[::2] = 4  # duplicates within the batch
        if name == "adam":  # torch's dense Adam moves untouched rows too: touch every row
            x = torch.cat([torch.arange(12, device=device), x])
            offsets = torch.cat([offsets[:1], offsets[1:] + 12])
        g = torch.randn(offsets.numel() - 1, 5, device=device)
        ours(x, offsets[:-1]).backward(g)
        topt.zero_grad()
        theirs(x, offsets[:-1]).backward(g)
        topt.step()
        assert ours.weight.grad is None
        assert_close(ours.weight, theirs.weight, torch.float32, reduction=x.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_rowwise_adagrad_by_hand(device):
    m = embfuse.nn.Embedding(4, 2, optimizer=RowWiseAdagrad(lr=1.0, eps=0.0), device=device)
    with torch.no_grad():
        m.weight.zero_()
    m(torch.tensor([1, 1, 2], device=device)).backward(torch.tensor([[1.0, 3.0], [1.0, 1.0], [0.0, 2.0]],
                                                                     device=device))
    # row 1: g = (2, 4), mean g^2 = 10, w = -g / sqrt(10); row 2: g = (0, 2), mean g^2 = 2
    expected = torch.tensor([[0.0, 0.0], [-2.0, -4.0], [0.0, -2.0], [0.0, 0.0]]) / torch.tensor(
        [[1.0], [10.0 ** 0.5], [2.0 ** 0.5], [1.0]])
    assert_close(m.weight.detach(), expected, torch.float32)
    assert_close(m.optimizer_sum, torch.tensor([0.0, 10.0, 2.0, 0.0]), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_round_trip_is_bitwise(device):
    torch.manual_seed(1)
    batches = [random_bags(8, 6, 40, device) for _ in range(4)]
    grads = [torch.randn(8, 16, device=device) for _ in range(4)]

    def train(m, steps):
        for (x, off), g in zip(batches[steps], grads[steps]):
            m(x, off[:-1]).backward(g)

    straight = embfuse.nn.EmbeddingBag(40, 16, mode="sum", optimizer=Adam(lr=0.01), device=device)
    start = {k: v.clone() if torch.is_tensor(v) else v for k, v in straight.state_dict().items()}
    train(straight, slice(0, 4))
    first = embfuse.nn.EmbeddingBag(40, 16, mode="sum", optimizer=Adam(lr=0.01), device=device)
    first.load_state_dict(start)
    train(first, slice(0, 2))
    resumed = embfuse.nn.EmbeddingBag(40, 16, mode="sum", optimizer=Adam(lr=0.01), device=device)
    resumed.load_state_dict(first.state_dict())
    train(resumed, slice(2, 4))
    assert resumed._fused.step == 4
    for k, v in straight.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, resumed.state_dict()[k]), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["deferred", "sync"])
def test_rejected_batch_changes_nothing(device, mode):
    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", optimizer=Adagrad(lr=0.1), device=device, bounds_check=mode)
    m(torch.tensor([[1, 2]], device=device)).sum().backward()
    before = {k: v.clone() for k, v in m.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(IndexError, match="out of range"):
        m(torch.tensor([[1, 10]], device=device)).sum().backward()
        embfuse.check_errors()  # "deferred" on a GPU: the step ran, harmlessly, and is taken back
    for k, v in before.items():
        assert torch.equal(v, m.state_dict()[k]), k
    assert m._fused.step == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fused_steps_on_ids_the_check_narrowed_are_bitwise_those_on_the_ids(device, mode, monkeypatch):
    """A fused lookup's int64 ids, read as the int32 its check writes (tuning.narrows; here every
    batch), train bitwise as "off" on the ids as given; a bad batch among them changes nothing."""
    from embfuse.ops import tuning

    monkeypatch.setattr(tuning, "NARROW_IDS", -1)
    monkeypatch.setattr(tuning, "NARROW_DIM", 0)
    batches = [random_bags(8, 6, 40, device) for _ in range(3)]
    mods = [embfuse.nn.EmbeddingBag(40, 16, mode=mode, optimizer=RowWiseAdagrad(lr=0.1), device=device,
                                    bounds_check=check) for check in ("off", "deferred")]
    mods[1].load_state_dict(mods[0].state_dict())
    for x, off in batches:
        for m in mods:
            m(x, off[:-1]).backward(torch.ones(8, 16, device=device))
    embfuse.check_errors()
    before = {k: v.clone() for k, v in mods[1].state_dict().items() if torch.is_tensor(v)}
    for k, v in mods[0].state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), k
    x, off = batches[0]
    bad = x.clone()
    bad[3] = 40
    with pytest.raises(IndexError, match="input\\[3\\] = 40 is out of range"):
        mods[1](bad, off[:-1]).backward(torch.ones(8, 16, device=device))
        embfuse.check_errors()
    for k, v in before.items():
        assert torch.equal(v, mods[1].state_dict()[k]), k
    assert mods[1]._fused.step == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tables_train_with_fp32_state(device, dtype):
    m = embfuse.nn.EmbeddingBag(20, 8, mode="sum", optimizer=Adagrad(lr=0.1), device=device, dtype=dtype)
    ref = m.weight.detach().double().cpu()
    state = torch.zeros(20, 8, dtype=torch.float64)
    x = torch.randint(0, 20, (4, 3), device=device)
    g = torch.randn(4, 8, device=device).to(dtype)
    m(x).backward(g)
    assert m.optimizer_sum.dtype == torch.float32 and m.weight.dtype == dtype
    apply_sparse_update_reference(ref, {"sum": state}, Adagrad(lr=0.1), x.reshape(-1).cpu(), g.double().cpu(),
                                  torch.arange(4).repeat_interleave(3), None, 1)
    assert_close(m.weight.detach(), ref, dtype, reduction=3)
    assert "optimizer_step" in m.state_dict() and "optimizer_step" not in torch.nn.EmbeddingBag(2, 2).state_dict()


def test_apply_optimizer_in_backward_and_the_rest_of_the_model():
    bag = embfuse.nn.EmbeddingBag(10, 4, mode="sum")
    emb = embfuse.nn.Embedding(10, 4)
    embfuse.optim.apply_optimizer_in_backward(SGD(lr=0.1), [bag, emb])
    dense = torch.nn.Linear(8, 1)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    w_bag, w_emb, w_dense = bag.weight.detach().clone(), emb.weight.detach().clone(), dense.weight.detach().clone()
    x = torch.tensor([[1, 2], [3, 3]])
    loss = dense(torch.cat([bag(x), emb(x).sum(1)], dim=1)).sum()
    loss.backward()
    dense_opt.step()
    assert bag.weight.grad is None and emb.weight.grad is None
    assert not torch.equal(bag.weight, w_bag) and not torch.equal(emb.weight, w_emb)
    assert not torch.equal(dense.weight, w_dense)
    assert torch.equal(bag.weight[0], w_bag[0])  # untouched row
    with torch.no_grad():  # evaluation: no update, no step
        bag(x)
    assert bag._fused.step == 1


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="fused optimizer supports sum, mean, sqrtn and wmean"):
        embfuse.nn.EmbeddingBag(10, 4, mode="max", optimizer=SGD())(torch.tensor([[1]]))


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_weights_get_gradients_with_a_fused_table(device):
    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", optimizer=SGD(lr=0.0), device=device)
    x, off = torch.tensor([1, 2, 3], device=device), torch.tensor([0, 2], device=device)
    p = torch.rand(3, device=device, requires_grad=True)
    m(x, off, per_sample_weights=p).sum().backward()
    p2 = p.detach().clone().requires_grad_()
    F.embedding_bag(x, m.weight.detach(), off, mode="sum", per_sample_weights=p2).sum().backward()
    assert_close(p.grad, p2.grad, torch.float32, reduction=4)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=requires_kernels)], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(kernel, dtype):
    """Each weight's exact update lands a quarter of an ulp past +-1: round to nearest loses it;
    stochastic rounding moves about a quarter of the weights one ulp, and only those."""
    N, D = 64, 64
    device = KERNEL_DEVICE if kernel else "cpu"
    ulp = torch.finfo(dtype).eps  # the spacing just above 1.0
    sign = torch.where(torch.arange(N, device=device) % 2 == 0, 1.0, -1.0)[:, None]
    ids = torch.arange(N, device=device)
    src = -0.25 * ulp * sign.expand(N, D)  # SGD lr=1: w - g = sign * (1 + ulp / 4)
    moved = {}
    for rounding in (False, True):
        w = (sign * torch.ones(N, D, device=device)).to(dtype)
        for _ in range(2):  # the same step twice: the same random bits
            w_step = w.clone()
            apply_sparse_update(w_step, {}, SGD(lr=1.0, stochastic_rounding=rounding), ids, src, step=5,
                                kernel=kernel)
            assert moved.get(rounding) is None or torch.equal(w_step, moved[rounding])
            moved[rounding] = w_step
    assert torch.equal(moved[False], (sign * torch.ones(N, D, device=device)).to(dtype))
    magnitude = moved[True].abs().double()
    assert bool(((magnitude == 1) | (magnitude == 1 + ulp)).all())
    assert abs((magnitude > 1).double().mean().item() - 0.25) < 0.03  # 4.4 sigma over 4096 weights


@pytest.mark.parametrize("make,exc,msg", [
    (lambda: SGD(lr=-1), ValueError, "SGD: lr must be >= 0, got -1"),
    (lambda: SGD(lr=float("nan")), ValueError, "SGD: lr must be finite"),
    (lambda: SGD(lr="0.1"), TypeError, "SGD: lr must be a number, got '0.1'"),
    (lambda: Adagrad(eps=-1), ValueError, "Adagrad: eps must be >= 0"),
    (lambda: Adagrad(lr_decay=-0.5), ValueError, "lr_decay must be >= 0"),
    (lambda: RowWiseAdagrad(initial_accumulator_value=-1), ValueError, "initial_accumulator_value must be >= 0"),
    (lambda: Adam(betas=(1.5, 0.9)), ValueError, r"Adam: betas\[0\] must be in \[0, 1\), got 1.5"),
    (lambda: Adam(betas=(0.9,)), ValueError, "betas must be a pair"),
    (lambda: Adam(weight_decay=float("inf")), ValueError, "weight_decay must be finite"),
    (lambda: SGD(lr=0.1, stochastic_rounding="yes"), TypeError, "stochastic_rounding must be True or False"),
])
def test_bad_hyper_parameters_are_refused_at_construction(make, exc, msg):
    with pytest.raises(exc, match=msg):
        make()


def test_a_step_counts_only_once_its_update_ran(monkeypatch):
    """An update that raises leaves the step count as it was; a checkpoint with a negative or
    fractional step count is refused by load_state_dict, naming the key."""
    import embfuse.optim.lookup as lookup

    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", optimizer=Adam(lr=0.01))
    m(torch.tensor([[1, 2]])).sum().backward()
    before = {k: v.clone() for k, v in m.state_dict().items()}

    def fail(*args, **kwargs):
        raise RuntimeError("update failed")

    monkeypatch.setattr(lookup, "apply_sparse_update", fail)
    with pytest.raises(RuntimeError, match="update failed"):
        m(torch.tensor([[1, 3]])).sum().backward()
    monkeypatch.undo()
    assert m._fused.step == 1
    for k, v in before.items():
        assert torch.equal(v, m.state_dict()[k]), k
    for bad in (torch.tensor(-2), torch.tensor(1.5)):
        with pytest.raises(RuntimeError, match="optimizer_step: the step count must be a non-negative integer"):
            m.load_state_dict({**before, "optimizer_step": bad})
    assert m._fused.step == 1


def test_a_loaded_step_count_reaches_the_gpus_copy():
    """load_state_dict sets the count that a CUDA graph's update starts from (FusedOptimizer.step_copies,
    made here on the CPU: the GPU's is made by the first step there), not only the host's."""
    from embfuse.optim.rules import HYPER_STEP

    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", optimizer=Adam(lr=0.01))
    m(torch.tensor([[1, 2]])).sum().backward()
    copy = m._fused.step_copy(torch.device("cpu"))
    assert copy[HYPER_STEP] == 1
    m.load_state_dict({**m.state_dict(), "optimizer_step": torch.tensor(7)})
    assert m._fused.step == 7 and copy[HYPER_STEP] == 7


def _raw_graph_of_adam():
    """An nn.EmbeddingBag with fused Adam after one warm-up step outside the graph, an eager copy
    of it, the ids its step reads and a torch.cuda.graph of that step."""
    torch.manual_seed(0)
    m = embfuse.nn.EmbeddingBag(50, 8, mode="sum", optimizer=Adam(lr=0.1), device="cuda")
    ids = torch.randint(0, 50, (16, 3), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up step, outside the graph
        m(ids).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    eager = copy.deepcopy(m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(ids).square().sum().backward()
    return m, eager, ids, graph


def _trained_alike(m, eager):
    embfuse.check_errors()
    for name, value in eager.state_dict().items():
        if name != "optimizer_step":  # (raw replays do not advance the host's count)
            torch.testing.assert_close(m.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_a_bad_replay_of_a_raw_graph_leaves_the_gpus_step_count():
    """torch.cuda.graph of a fused Adam step: a bad replay, once reported, takes nothing back (it
    advanced neither count), so the replays after it train as the good batches' steps run eagerly.
    (The report once wrote the host's count, which raw replays do not advance, over the GPU's.)"""
    m, eager, ids, graph = _raw_graph_of_adam()
    for k in range(4):
        if k == 1:
            ids[2, 1] = 50
            graph.replay()
            with pytest.raises(embfuse.BadIdError, match=r"deferred: 1 replay\(s\)"):
                embfuse.check_errors()
        ids.copy_(torch.randint(0, 50, (16, 3), device="cuda"))
        graph.replay()
        eager(ids).square().sum().backward()
    _trained_alike(m, eager)


@pytest.mark.gpu
def test_a_captured_update_waits_for_the_side_stream_that_advances_its_step(monkeypatch):
    """Inside a CUDA graph Adam's per-step hyper-parameters are advanced on a side stream beside
    the backward's sort (FusedOptimizer._graph_step): held back there by a long sleep, the update
    must still read them after they are written, as the eager steps do."""
    slow = Adam.graph_hyper

    def held_back(self, hyper, good):
        torch.cuda._sleep(50_000_000)  # (tens of milliseconds: the update would run first)
        slow(self, hyper, good)

    monkeypatch.setattr(Adam, "graph_hyper", held_back)  # (eager steps never call it)
    m, eager, ids, graph = _raw_graph_of_adam()
    for _ in range(3):
        ids.copy_(torch.randint(0, 50, (16, 3), device="cuda"))
        graph.replay()
        eager(ids).square().sum().backward()
    _trained_alike(m, eager)


def test_dtype_conversions_leave_optimizer_state_float32():
    m = embfuse.nn.EmbeddingBag(10, 4, mode="sum", optimizer=Adam(lr=0.01))
    m(torch.tensor([[1, 2]])).sum().backward()
    state = m.optimizer_exp_avg.clone()
    m.half()
    assert m.weight.dtype == torch.float16
    assert m.optimizer_exp_avg.dtype == torch.float32 and torch.equal(m.optimizer_exp_avg, state)
    m.double()
    assert m.weight.dtype == torch.float64 and m.optimizer_exp_avg_sq.dtype == torch.float32
    ebc = embfuse.EmbeddingBagCollection([embfuse.EmbeddingBagConfig(10, 4, "t", feature_names=["f"])],
                                         optimizer=embfuse.optim.Adagrad(lr=0.1))
    ebc.bfloat16()
    assert ebc.weights.dtype == torch.bfloat16 and ebc.optimizer_sum.dtype == torch.float32


@requires_kernels
def test_adam_kernel_first_steps_from_zero_state_match_float64():
    """Adam from zero state (every table's start), held to a few fp32 roundings: the kernel once
    took 1 - beta2 in fp32 (1 - 0.999 is 1.3e-5 off there), which the table's tolerance hides."""
    opt, N, D = Adam(lr=0.5), 6, 8
    ids = torch.tensor([0, 2, 2, 5], device=KERNEL_DEVICE)
    w = torch.randn(N, D, device=KERNEL_DEVICE)
    state = init_state(opt, N, D, KERNEL_DEVICE)
    w0, w64, state64 = w.clone(), w.double(), {k: v.double() for k, v in state.items()}
    for step in (1, 2, 3):
        src = torch.randn(4, D, device=KERNEL_DEVICE)
        apply_sparse_update(w, state, opt, ids, src, None, None, step, kernel=True)
        apply_sparse_update_reference(w64, state64, opt, ids, src.double(), None, None, step)
    for ours, exact in [(w - w0, w64 - w0.double()), (state["exp_avg"], state64["exp_avg"]),
                        (state["exp_avg_sq"], state64["exp_avg_sq"])]:
        torch.testing.assert_close(ours.double().cpu(), exact.cpu(), rtol=4e-6, atol=0)
