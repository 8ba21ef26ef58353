"""embfuse._triton: the direct launcher (calls that Triton would compile differently, a pointer
off 16-byte alignment, an int equal to 1 or a multiple of 16, get their own kernel; a batch's
counts of values and of examples, which change from batch to batch, compile none) and the eager
autograd path of the registered ops (eager_autograd, backward_needs_op)."""

import contextlib
import functools
import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

import sys

import embfuse
from embfuse import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from embfuse._triton import _direct
from embfuse.distributed.assembly import move_columns, move_table
from embfuse.ops.bags import POOLINGS
from embfuse.ops.chain import layer_norm_act
from embfuse.ops.embedding_bag import _embedding_bag_fwd_checked_kernel, _embedding_bag_fwd_kernel
from embfuse.ops import tuning
from embfuse.optim import SGD, Adagrad, Adam
from tests.conftest import DEVICES
from .tolerances import assert_close, random_bags

# (the modules: embfuse.ops binds the names of its functions over them)
ebag, emb, ecoll = (sys.modules[f"embfuse.ops.{m}"] for m in ("embedding_bag", "embedding", "collection"))


@pytest.mark.gpu
def test_direct_launches_respecialise_on_alignment_and_int_values():
    flat = torch.randn(20 * 1000 + 1, device="cuda")
    aligned, off_by_one = flat[:-1].view(1000, 20), flat[1:].view(1000, 20)
    ids = torch.randint(0, 1000, (37, 5), device="cuda")
    # a kernel reused for the wrong specialisation would pool the wrong rows (padding 1 is a
    # constexpr to Triton) or read misaligned vectors: each case comes after another one. The
    # plain pooling kernel (`off`) and the one that folds in a small batch's check (default).
    for mode, kernel in (("off", _embedding_bag_fwd_kernel), ("deferred", _embedding_bag_fwd_checked_kernel)):
        for weight, padding_idx in [(aligned, 17), (off_by_one, 17), (aligned, 1), (aligned, 16), (off_by_one, 1),
                                    (aligned, 17)]:
            for _ in range(2):  # the second call takes the kept kernel
                out = embfuse.embedding_bag(ids, weight, mode="sum", padding_idx=padding_idx, bounds_check=mode)
                ref = F.embedding_bag(ids.cpu(), weight.cpu().double(), mode="sum", padding_idx=padding_idx)
                assert_close(out, ref, torch.float32, reduction=5)
        # the calls took the direct path: five specialisations (two alignments, paddings 17, 1, 16)
        assert len(_direct(kernel).compiled) >= 5


def _variants() -> dict:
    """Every embfuse kernel's count of compiled variants: Triton's own, and the direct launcher's."""
    from triton.runtime.jit import JITFunction

    out = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("embfuse."):
            for k, v in vars(module).items():
                if isinstance(v, JITFunction):
                    out[f"{name}.{k}"] = (sum(len(c[0]) for c in v.device_caches.values()), len(_direct(v).compiled))
    return out


def _batch(short: int, examples: int):
    """2 * examples bags of 32 ids (two features of `examples` bags) less `short` ids in the last
    bag: its lengths, values and starts."""
    lengths = torch.full((2 * examples,), 32, device="cuda")
    lengths[-1] -= short
    values = torch.randint(0, 500, (int(lengths.sum()),), device="cuda")
    return lengths, values, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])


# (ids taken off the last bag, examples): counts of values that are a multiple of 16 and then are not, at
# 64 examples; then a last, smaller batch of 50 examples and a batch of one (an int equal to 1 is also
# specialised), and 64 again
BATCHES = ((1, 64), (7, 64), (16, 64), (0, 64), (0, 50), (3, 50), (0, 1), (5, 1), (0, 64))


def _no_new_variants(steps) -> None:
    """steps(short, examples) on BATCHES (both parities of the checks' status pairs, several calls
    each) compiles no variant after the first batch (0, 64)."""
    steps(0, 64)
    torch.cuda.synchronize()
    before = _variants()
    for short, examples in BATCHES:
        steps(short, examples)
    torch.cuda.synchronize()
    grew = {k: (before.get(k), v) for k, v in _variants().items() if v != before.get(k)}
    assert not grew, grew


@pytest.mark.gpu
def test_a_batchs_counts_compile_no_new_kernel_variants():
    """Triton specialises an int on divisibility by 16 and on the value 1, and a pointer on its
    alignment: a count of values or of examples (or a status pair) that does so differently from
    batch to batch would compile a variant in the middle of training, about half a second each
    (the demo's first epoch and its last, smaller batch: benchmarks/NOTES.md, sessions 63 and 65).
    The default path: a collection (Adam), a bag and a gather module with fused updates."""
    configs = [EmbeddingBagConfig(1000, 16, "t0", feature_names=["f0"]),
               EmbeddingBagConfig(500, 8, "t1", feature_names=["f1"])]
    ebc = EmbeddingBagCollection(configs, device="cuda", optimizer=Adam(lr=0.01))
    bag = embfuse.nn.EmbeddingBag(500, 16, mode="sum", optimizer=SGD(lr=0.1), device="cuda")
    gather = embfuse.nn.Embedding(500, 16, optimizer=SGD(lr=0.1), device="cuda")

    def steps(short: int, examples: int) -> None:
        lengths, values, starts = _batch(short, examples)
        kjt = KeyedJaggedTensor(["f0", "f1"], values, lengths=lengths, stride=examples)
        for _ in range(3):
            ebc(kjt).values().sum().backward()
            bag(values, starts).sum().backward()
            gather(values).sum().backward()

    _no_new_variants(steps)


@pytest.mark.gpu
def test_a_batchs_counts_compile_no_new_variants_of_the_separate_check_or_dense_backward(monkeypatch):
    """The same, where a batch's ids are checked in a launch of their own (more than
    tuning.FOLD_IDS of them; here the threshold is lowered) and gradients are dense."""
    monkeypatch.setattr(tuning, "FOLD_IDS", 0)
    monkeypatch.setattr(tuning, "FOLD_GATHER_IDS", 0)
    weight = torch.randn(500, 16, device="cuda", requires_grad=True)

    def steps(short: int, examples: int) -> None:
        _, values, starts = _batch(short, examples)
        for _ in range(3):
            embfuse.embedding_bag(values, weight, starts, mode="mean").sum().backward()
            embfuse.embedding(values, weight).sum().backward()
            weight.grad = None

    _no_new_variants(steps)


@pytest.mark.gpu
def test_a_batchs_counts_compile_no_new_variants_of_combiners_or_hot_rows():
    """The same for TensorFlow's combiners (sqrtn, mean) with fused Adagrad, and for a collection
    that trains hot rows apart."""
    tables = [EmbeddingBagConfig(500, 16, "t0", feature_names=["f0"], combiner="sqrtn"),
              EmbeddingBagConfig(500, 8, "t1", feature_names=["f1"], combiner="mean")]
    combiners = EmbeddingBagCollection(tables, device="cuda", optimizer=Adagrad(lr=0.1))
    hot = EmbeddingBagCollection([EmbeddingBagConfig(500, 16, "t0", feature_names=["f0"]),
                                  EmbeddingBagConfig(500, 8, "t1", feature_names=["f1"])],
                                 device="cuda", optimizer=SGD(lr=0.1), hot_rows=16, hot_refresh=2**62,
                                 hot_min_values=0)

    def steps(short: int, examples: int) -> None:
        lengths, values, _ = _batch(short, examples)
        kjt = KeyedJaggedTensor(["f0", "f1"], values, lengths=lengths, stride=examples)
        for _ in range(3):
            combiners(kjt).values().sum().backward()
            hot(kjt).values().sum().backward()

    _no_new_variants(steps)


@pytest.mark.gpu
def test_a_batchs_size_compiles_no_new_variants_of_vbe_the_feature_chain_or_the_assembly():
    """The same for a batch with a batch size per feature (TorchRec's VBE: the kernel that pads its
    lengths), the per-feature LayerNorm chain of the FX passes (forward and backward) and a
    sharded collection's output assembly (both ways)."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(500, 16, "t0", feature_names=["f0", "f1"])], device="cuda")
    norm = torch.randn(2, 16, device="cuda", requires_grad=True)
    table = move_table([(1, 0, 16, 0), (0, 0, 16, 16)], [16, 16], "cuda")

    def steps(short: int, examples: int) -> None:
        lengths, values, _ = _batch(short, examples)
        strides = [examples, max(1, examples // 2)]
        lengths = lengths[-sum(strides):].clone()  # (the short bag is the last; a view's offset would add
        values = values[-int(lengths.sum()):].clone()  # variants for its alignment)
        inverse = torch.stack([torch.arange(examples, device="cuda") % s for s in strides])
        kjt = KeyedJaggedTensor(["f0", "f1"], values, lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                                inverse_indices=(["f0", "f1"], inverse))
        side, out = torch.randn(examples * 32, device="cuda"), torch.empty(examples, 32, device="cuda")
        for _ in range(3):
            layer_norm_act(ebc(kjt).values().view(examples, 2, 16), norm, act="tanh").sum().backward()
            move_columns(side, out, table, examples, 16, to_out=True)
            move_columns(side, out, table, examples, 16, to_out=False)

    _no_new_variants(steps)


def _refuse(*args, **kwargs):
    raise AssertionError("an eager call recording a gradient went through the registered op")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_recorded_eager_bags_skip_the_op_dispatch_and_agree_with_the_op(device, mode, monkeypatch):
    """An eager embedding_bag that autograd records runs the op's body, setup and backward in an
    autograd.Function (eager_autograd), not the registered op: output and gradients bitwise
    the op's, called directly. (A float16 table on the CPU: fp32 / fp64 ones run torch's own
    lookup there, the test below.)"""
    w = torch.randn(30, 8, device=device, dtype=torch.float16 if device == "cpu" else torch.float32)
    ids, offsets = random_bags(6, 5, 30, device)
    psw = torch.rand(ids.shape, device=device, dtype=w.dtype) if mode == "sum" else None
    g = torch.randn(6, 8, device=device, dtype=w.dtype)
    weights = [w.clone().requires_grad_(), w.clone().requires_grad_()]
    psws = [None, None] if psw is None else [psw.clone().requires_grad_(), psw.clone().requires_grad_()]
    ref, _ = torch.ops.embfuse.embedding_bag(weights[0], ids, offsets, psws[0], None, POOLINGS[mode], -1, False, 0)
    ref.backward(g)
    monkeypatch.setattr(ebag, "_embedding_bag_op", _refuse)
    monkeypatch.setattr(ebag, "_embedding_bag_backward_op", _refuse)
    out = embfuse.embedding_bag(ids, weights[1], offsets, mode=mode, per_sample_weights=psws[1],
                                include_last_offset=True)
    out.backward(g)
    assert torch.equal(out, ref) and torch.equal(weights[1].grad, weights[0].grad)
    assert psw is None or torch.equal(psws[1].grad, psws[0].grad)


@pytest.mark.parametrize("device", DEVICES)
def test_recorded_eager_lookups_skip_the_op_dispatch_and_agree_with_the_op(device, monkeypatch):
    """As above for embedding (its double backward keeps the op: tests/ops/test_embedding.py)."""
    w = torch.randn(30, 8, device=device, dtype=torch.float16 if device == "cpu" else torch.float32)
    ids = torch.randint(0, 30, (4, 5), device=device)
    g = torch.randn(4, 5, 8, device=device, dtype=w.dtype)
    weights = [w.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = torch.ops.embfuse.embedding(weights[0], ids.reshape(-1), None, -1, False, 0)
    ref.backward(g.view(-1, 8))
    monkeypatch.setattr(emb, "_embedding_op", _refuse)
    monkeypatch.setattr(emb, "_embedding_backward_op", _refuse)
    out = embfuse.embedding(ids, weights[1])
    out.backward(g)
    assert torch.equal(out.view(-1, 8), ref) and torch.equal(weights[1].grad, weights[0].grad)


def test_recorded_eager_collections_skip_the_op_dispatch(monkeypatch):
    """A collection whose weights record a gradient: its eager forward and backward take the
    op's body (the gradients against torch: tests/nn/test_collection.py)."""
    from embfuse.nn import EmbeddingBagCollection, EmbeddingBagConfig

    monkeypatch.setattr(ecoll, "_collection_op", _refuse)
    monkeypatch.setattr(ecoll, "_collection_backward_op", _refuse)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(9, 4, "t", feature_names=["a", "b"])])
    kjt = embfuse.KeyedJaggedTensor(["a", "b"], torch.tensor([1, 8, 0, 3, 3]), lengths=torch.tensor([2, 0, 1, 2]))
    ebc(kjt).values().sum().backward()
    expect = torch.zeros(9, 4)
    expect[[1, 8, 0, 3]] = torch.tensor([1.0, 1, 1, 2])[:, None]
    assert torch.equal(ebc.weights.grad.view(9, 4), expect)


@pytest.mark.parametrize("mode,sparse", [("sum", False), ("sum", True), ("mean", False), ("mean", True),
                                         ("max", False)])
def test_recorded_cpu_lookups_are_torchs_own(mode, sparse):
    """On the CPU an fp32 / fp64 recorded call runs torch's own lookup (validate.torch_records):
    bitwise torch's output and gradients, its autograd node; options where embfuse differs from
    torch on purpose (scale_grad_by_freq) and the row-wise gradient keep embfuse's backward."""
    ids, offsets = random_bags(6, 5, 30, "cpu")
    w = torch.randn(30, 8, dtype=torch.float64)
    g = torch.randn(6, 8, dtype=torch.float64)
    ours, theirs = w.clone().requires_grad_(), w.clone().requires_grad_()
    out = embfuse.embedding_bag(ids, ours, offsets, mode=mode, sparse=sparse, include_last_offset=True)
    want = F.embedding_bag(ids, theirs, offsets, mode=mode, sparse=sparse, include_last_offset=True)
    out.backward(g)
    want.backward(g)
    assert type(out.grad_fn) is type(want.grad_fn)
    assert torch.equal(out, want) and torch.equal(ours.grad.to_dense(), theirs.grad.to_dense())
    node = embfuse.embedding(ids, ours, sparse=sparse).grad_fn.next_functions[0][0]  # (under its view)
    assert type(node) is type(F.embedding(ids, theirs, sparse=sparse).grad_fn)
    if mode != "max":
        for kw in (dict(scale_grad_by_freq=True), dict(sparse="rowwise")):
            out = embfuse.embedding_bag(ids, ours, offsets, mode=mode, include_last_offset=True, **kw)
            assert type(out.grad_fn).__name__.startswith("Eager_embedding_bag")


@pytest.mark.parametrize("lookup", ["embedding", "embedding_bag"])
def test_batched_gradients_of_eager_lookups(lookup, monkeypatch):
    """gradcheck's batched check (autograd's is_grads_batched runs the backward on a batched
    gradient), which torch's own test_embedding.py asks of nn.functional.embedding: the eager
    backward then takes the registered op, whose fallback takes the batch entry by entry. (The
    CPU's own torch lookup turned off: the path a GPU table takes.)"""
    monkeypatch.setattr(ebag, "torch_records", lambda *a: False)
    monkeypatch.setattr(emb, "torch_records", lambda *a: False)
    ids = torch.tensor([[0, 1, 1, 2], [3, 5, 7, 11]])
    fn = {"embedding": lambda w: embfuse.embedding(ids, w),
          "embedding_bag": lambda w: embfuse.embedding_bag(ids, w, mode="mean")}[lookup]
    w = torch.randn(20, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (w,), check_batched_grad=True)
    if lookup == "embedding":  # (the one with a double backward)
        assert torch.autograd.gradgradcheck(fn, (w,), check_batched_grad=True)




@pytest.mark.parametrize("traced", [False, True])
def test_a_launch_never_takes_one_tensor_twice(traced):
    """Inductor clones each argument a traced kernel writes, one clone per argument: a buffer
    passed twice splits in two, and the kernel reads what it never wrote (benchmarks/NOTES.md,
    session 42). Traced launches (here: under a fake mode, refused before anything runs) and
    interpreted ones refuse overlapping arguments; disjoint views of one buffer and empty views
    pass."""
    from embfuse._triton import interpreting, launch
    from embfuse.ops.chain import _layer_norm_act_fwd_kernel

    if not traced and not interpreting():
        pytest.skip("an eager launch is checked only by the interpreter (CI)")
    mode = torch._subclasses.FakeTensorMode() if traced else contextlib.nullcontext()
    with mode:
        x = torch.randn(2, 3, 8, device=DEVICES[-1])
        y, params = torch.empty_like(x), torch.randn(2, 3, 8, device=x.device)

        def run(x, w, b, y, overlapping=False):
            launch(_layer_norm_act_fwd_kernel, overlapping)[(1, 3)](
                x, w, b, y, 2, 3, 8, 1e-5, HAS_W=True, HAS_B=b.numel() > 0, ACT=0, BLOCK_B=2, BLOCK_D=8)

        with pytest.raises(RuntimeError, match="overlapping tensors as arguments 0 and 3"):
            run(x, params[0], params[1], x)
        with pytest.raises(RuntimeError, match="arguments 1 and 2"):
            run(x, params[0], params[0, 1:], y)
        if not traced:
            run(x, params[0], params[1], y)  # disjoint rows of one buffer
            run(x, params[0], params[0, :0], y)  # an empty view (never read)
            run(x, params[0], params[1], x, overlapping=True)  # (in place, as an eager fold's status)


_TRACED_WRITES = """
import json, sys
import torch, triton
import torch._higher_order_ops.triton_kernel_wrap as wrap
if hasattr(wrap, "identify_accessed_tensors"):  # (newer torch)
    writes_of = lambda kernel, kw: [d.name for d in wrap.identify_accessed_tensors(kernel, kw, {}).read_writes.writes]
else:
    writes_of = lambda kernel, kw: wrap.identify_mutated_tensors(kernel, kw, {})
if not torch.cuda.is_available():  # a stand-in Hopper target: the IR needs one, not a GPU
    from triton.backends.compiler import GPUTarget

    class Target:
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_benchmarker(self): return None
    triton.runtime.driver.set_active(Target())
writes = []
for module, name, kwargs in json.loads(sys.argv[1]):
    kernel = getattr(__import__(module, fromlist=[name]), name)
    kwargs = {k: torch.empty(v[1], dtype=getattr(torch, v[2])) if isinstance(v, list) and v[:1] == ["tensor"] else v
              for k, v in kwargs.items()}
    writes.append(sorted(writes_of(kernel, kwargs)))
print(json.dumps(writes))
"""


def _reduction_launch(first, kind):
    """(module, kernel, arguments, the arguments it writes) of a launch of the reduction: kind
    None the gradient kernel, else the fused update of that optimizer kind (weight decay, dropped
    bits). Tensor arguments as ("tensor", shape, dtype), the child's JSON."""
    t = lambda *shape, dtype="float32": ("tensor", shape, dtype)  # noqa: E731
    inputs = dict(keys=t(8, dtype="int32"), perm=t(8, dtype="int64"), src_row=t(8, dtype="int64"), scale=t(8),
                  src=t(8, 4))
    kw = dict(n=8, src_stride=4, src_bags=8, src_meta=t(4, dtype="int64"), up_keys=t(10, dtype="int32"),
              up_vals=t(10, 4), up_info=t(10, 2, dtype="int32"), counters=t(1, dtype="int32"), at=0, levels=1,
              FIRST=first, HAS_SRC_ROW=True, HAS_SCALE=True, COUNT=True, VEC=4, BLOCK_K=64, BLOCK_D=4, ROW_D=4,
              **{k: v if first else None for k, v in inputs.items()})
    written = ["up_info", "up_keys", "up_vals"] + ([] if first else ["counters"])
    if kind is None:
        return "embfuse.ops.segments", "_segment_grad_kernel", dict(kw, grad=t(16, 4)), written + ["grad"]
    kw.update(weight=t(16, 4), state1=t(16, 4), state2=t(16, 4), lr=0.1, eps=1e-8, weight_decay=0.1,
              one_minus_beta1=0.1, one_minus_beta2=0.01, bc2_sqrt=1.0, seed=3, graph_hyper=None, KIND=kind, WD=True,
              DROP=8, QUARTERS=kind == 3, GRAPH_HYPER=False)
    states = {0: [], 1: ["state1"], 2: ["state1"], 3: ["state1", "state2"]}[kind]
    return "embfuse.optim.fused", "_fused_update_kernel", kw, written + ["weight"] + states


_REDUCTIONS = [(first, kind) for first in (True, False) for kind in (None, 0, 1, 2, 3)]


@functools.cache
def _traced_writes():
    """For each of _REDUCTIONS, the arguments that torch's trace of a traced launch
    (identify_accessed_tensors, identify_mutated_tensors in older torch: what Inductor copies
    before the launch) counts as written, from the kernel's IR, built in one child process (the
    interpreter's kernels have none)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(embfuse.__path__[0]), env.get("PYTHONPATH")) if p)
    cases = json.dumps([_reduction_launch(*c)[:3] for c in _REDUCTIONS])
    out = subprocess.run([sys.executable, "-c", _TRACED_WRITES, cases], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(_REDUCTIONS, json.loads(out.stdout.splitlines()[-1])))


@pytest.mark.parametrize("first, kind", _REDUCTIONS)
def test_traced_reductions_count_as_written_only_what_they_write(first, kind):
    """A store whose address a helper returns made torch count every tensor the helper took as
    written (pytorch#195628): Inductor copied the keys, the permutation and the whole gradient
    before each traced reduction (benchmarks/NOTES.md, session 43)."""
    pytest.importorskip("triton")
    assert _traced_writes()[first, kind] == sorted(_reduction_launch(first, kind)[3])
