"""Hot rows resident in L2 (ops/residency.py, ops/l2.py): the hot set's choice, the remap, the
kernels reading hot rows from their copy (interpreted in CI), and the modules' option."""

import pytest
import torch

import embfuse
from embfuse.ops import l2
from embfuse.ops.bags import ROW_START, SUM, bag_of_value
from embfuse.ops.collection import Plan, collection_forward
from embfuse.ops.embedding_bag import embedding_bag_forward
from embfuse.ops.residency import (IN_PLACE_SHARE, MIN_HIT_RATE, Resident, choose, copy_hot, layout,
                                   remap_reference, remap_values_reference, remap_words)
from embfuse.ops.validate import remap_ids, validate_bags, validate_collection
from tests.conftest import KERNEL_DEVICE, requires_kernels
from tests.ops.test_collection import FEATURES, TABLES, batch


def _powerlaw(n, rows, generator=None):
    """Ids with a few very hot rows: rank^-1.2, ranks scattered over the table."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    rank = ((1 - u) ** (-1 / 0.2) - 1).clamp(max=rows - 1).long()
    return (rank * 2_654_435_761) % rows


def _ranked(n, rows, generator=None):
    """_powerlaw's ranks as the ids: rows numbered by frequency, the hottest first."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return ((1 - u) ** (-1 / 0.2) - 1).clamp(max=rows - 1).long()


def test_remap_words_match_a_count_of_hot_rows_below():
    num_rows = 200
    hot = torch.tensor([0, 5, 31, 32, 33, 63, 64, 150, 199])
    words = remap_words(hot, num_rows)
    is_hot, slot = remap_reference(torch.arange(num_rows), words)
    assert torch.equal(is_hot.nonzero().flatten(), hot)
    assert torch.equal(slot[hot], torch.arange(hot.numel()))


def test_choose_takes_hot_rows_first_within_the_budget_and_lays_tables_out_in_runs():
    row_starts, row_bytes = [0, 1000, 1500], [16, 64]
    g = torch.Generator().manual_seed(1)
    rows = torch.cat([_powerlaw(20000, 1000, g), 1000 + _powerlaw(20000, 500, g)])
    hs = choose(rows, row_starts, row_bytes, budget=4096)
    assert hs.nbytes <= 4096 and hs.rows.numel() > 0
    assert torch.equal(hs.rows, torch.sort(hs.rows).values)
    # table 0's rows are slots [0, k0), table 1's the run after them
    (f0, k0), (f1, k1) = hs.tables
    assert (f0, f1) == (0, k0) and k0 + k1 == hs.rows.numel()
    assert bool((hs.rows[:k0] < 1000).all()) and bool((hs.rows[k0:] >= 1000).all())
    assert hs.nbytes == k0 * 16 + k1 * 64
    # chosen from the even lookups: every row taken is looked up at least as often per byte as
    # any row left out; judged on the odd ones
    ids, counts = torch.unique(rows[0::2], return_counts=True)
    density = counts / torch.where(ids < 1000, 16.0, 64.0)
    taken = torch.isin(ids, hs.rows)
    assert density[taken].min() >= density[~taken].max() or hs.nbytes + 64 > 4096
    hit = torch.isin(rows[1::2], hs.rows).double().mean().item()
    assert hs.hit_rate == pytest.approx(hit) and hit > MIN_HIT_RATE


def test_choose_reads_in_place_the_run_of_rows_that_serves_the_most_lookups():
    # two tables, rows 16 and 64 bytes, a 100-byte gap between them in the weights; the second
    # table's ids are numbered by frequency from row 40 on: its rows 40.. are the hot run
    row_starts, row_bytes, row_at = [0, 1000, 1500], [16, 64], [0, 1000 * 16 + 100]
    g = torch.Generator().manual_seed(2)
    rows = torch.cat([_powerlaw(4000, 1000, g), 1040 + _ranked(40000, 460, g)])[torch.randperm(44000, generator=g)]
    copy = choose(rows, row_starts, row_bytes, budget=4096)
    hs = choose(rows, row_starts, row_bytes, budget=4096, row_at=row_at)
    assert copy.in_place is None and hs.in_place is not None
    first, end, at = hs.in_place
    assert first == 1040 and end > first and at == row_at[1] + 40 * 64
    assert hs.nbytes == (end - first) * 64 <= copy.nbytes
    judged = rows[1::2]
    assert hs.hit_rate == pytest.approx(hs.serves(judged).double().mean().item())
    assert hs.hit_rate >= IN_PLACE_SHARE * copy.hit_rate and copy.hit_rate == pytest.approx(
        copy.serves(judged).double().mean().item())
    assert hs.rows.numel() == 0 and all(k == 0 for _, k in hs.tables)
    # the run must be where the counted lookups crowd: a run that served more lookups would be
    # at most as many bytes (the run from every counted row on, counted on the even lookups)
    counted = rows[0::2]
    best = max(((counted >= r) & (counted < r + (end - first))).sum().item() for r in range(1040, 1100))
    assert ((counted >= first) & (counted < end)).sum().item() == best


def test_choose_keeps_the_copy_when_the_hot_rows_are_scattered():
    g = torch.Generator().manual_seed(1)
    rows = torch.cat([_powerlaw(20000, 1000, g), 1000 + _powerlaw(20000, 500, g)])
    hs = choose(rows, [0, 1000, 1500], [16, 64], budget=4096, row_at=[0, 16000])
    assert hs.in_place is None and hs.rows.numel() > 0


def test_choose_turns_itself_off_when_nothing_is_hot():
    rows = torch.randint(0, 100_000, (50_000,))
    hs = choose(rows, [0, 100_000], [512], budget=1 << 20)
    assert hs.rows.numel() == 0 and hs.nbytes == 0 and "nothing is hot" in hs.reason


def _resident(weights, plan, values, offsets, B, budget):
    """A Resident built as the modules build it, from this batch's own counts: (Resident, the
    values' features)."""
    F = plan.meta.shape[0]
    feature = (bag_of_value(offsets, values.numel()) // B).clamp(0, F - 1)
    g = plan.meta[:, ROW_START][feature] + values.long()
    row_starts = [t[3] for t in plan.tables] + [plan.num_rows]
    views = [weights[e:e + r * d].view(r, d) for r, d, e, _ in plan.tables]
    hs = choose(g, row_starts, [d * weights.element_size() for _, d, _, _ in plan.tables], budget)
    assert hs.rows.numel() > 0
    hot = torch.full((hs.nbytes // weights.element_size() + sum(d for _, d, _, _ in plan.tables),), float("nan"),
                     dtype=weights.dtype, device=weights.device)
    elem, rel = layout(views, hot, hs)
    copy_hot(hot, views, hs, row_starts, elem)
    info = [[row_starts[t], plan.tables[t][0], rel[t]] for t in plan.feature_table]
    return Resident(hot, hs.words, torch.tensor(info, device=weights.device), False), feature


@requires_kernels
@pytest.mark.parametrize("weighted", [False, True])
def test_collection_kernel_reading_hot_rows_gives_the_same_bits(weighted):
    """Mixed widths (1, 3, 16, 33), a shared table, sum / mean / sqrtn: the remapped ids read the
    copy, which holds the same values, so the pooled rows are bitwise those of the plain lookup."""
    dev = KERNEL_DEVICE
    cols, col = [], 0
    for t, _ in FEATURES:
        cols.append(col)
        col += TABLES[t][1]
    P = Plan(TABLES, [(t, p, c) for (t, p), c in zip(FEATURES, cols)], dev)
    B = 6
    values, offsets, psw = batch(B, dev, weighted=weighted, hot=True)
    weights = torch.randn(P.num_elements, device=dev)
    res, feature = _resident(weights, P, values, offsets, B, budget=64)
    new = remap_ids(values, offsets, P.limits, B, res)
    assert torch.equal(new, remap_values_reference(values, feature, res))
    # the same ids from the check's own pass, which also checks
    for mode in ("deferred", "sync"):
        folded, *_ = validate_collection(values, offsets, psw, P.limits, B, [str(f) for f in range(5)],
                                         ["t"] * 5, mode, kernel=True, remap=res)
        assert torch.equal(folded, new)
    assert not torch.equal(new, values.long())
    rest = (offsets, psw, P.meta, B, P.total_dim, P.max_dim, P.layout.vec)
    plain = collection_forward(weights, values, *rest, weight_sums=P.weight_sums)
    assert torch.equal(plain, collection_forward(weights, new, *rest, weight_sums=P.weight_sums))
    # reading the copy, not the table: a copy of other values changes exactly the hot lookups
    res.hot.fill_(0)
    assert not torch.equal(plain, collection_forward(weights, new, *rest, weight_sums=P.weight_sums))


@requires_kernels
@pytest.mark.parametrize("mode", [SUM, 1])  # sum, mean (max compares ids: the module does not rewrite them)
def test_single_table_kernel_reading_hot_rows_gives_the_same_bits(mode):
    dev = KERNEL_DEVICE
    rows, D, B = 300, 8, 16
    g = torch.Generator().manual_seed(2)
    ids = _powerlaw(B * 6, rows, g).to(dev)
    offsets = torch.arange(0, B * 6 + 1, 6, device=dev)
    weight = torch.randn(rows, D, device=dev)
    P = Plan([(rows, D)], [(0, "sum", 0)], dev)
    res, _ = _resident(weight.view(-1), P, ids, offsets, B, budget=16 * D * 4)
    new = remap_ids(ids, None, None, 1, res, rows)
    for mode_ in ("deferred", "sync"):
        assert torch.equal(validate_bags(ids, offsets, rows, bounds_check=mode_, kernel=True, remap=res)[0], new)
    plain, _ = embedding_bag_forward(weight, ids, offsets, None, mode, -1)
    hot, _ = embedding_bag_forward(weight, new, offsets, None, mode, -1)
    assert torch.equal(plain, hot)


def test_remap_leaves_ids_outside_their_table_as_they_are():
    """A bad id keeps its value (the check's verdict stands on it) and reads no remap word."""
    P = Plan([(40, 4), (30, 4)], [(0, "sum", 0), (1, "sum", 4)], "cpu")
    values = torch.tensor([3, 3, 3, 3, 7, -1, 40, 5, 5, 5, 5, 29, 30, -7])
    offsets = torch.tensor([0, 7, 14])
    res, feature = _resident(torch.randn(P.num_elements), P, values, offsets, 1, budget=64)
    new = remap_values_reference(values, feature, res)
    bad = torch.tensor([5, 6, 12, 13])
    assert torch.equal(new[bad], values[bad]) and new[0] != 3


def test_l2_support_off_the_gpu_says_why():
    s = l2.support("cpu")
    assert not s.ok and "cpu" in s.reason


def _criteo_like(device, pin, **kw):
    tables = [embfuse.EmbeddingBagConfig(5000, 16, "a", feature_names=["f0"]),
              embfuse.EmbeddingBagConfig(300, 8, "b", feature_names=["f1", "f2"], pooling="mean")]
    torch.manual_seed(3)
    return embfuse.EmbeddingBagCollection(tables, device=device, pin_hot_rows_in_l2=pin, **kw)


def _kjt(device, B=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (3 * B,), generator=g)
    n = lengths.view(3, B).sum(1).tolist()
    values = torch.cat([_powerlaw(n[0], 5000, g), _powerlaw(n[1], 300, g), _powerlaw(n[2], 300, g)])
    return embfuse.KeyedJaggedTensor(["f0", "f1", "f2"], values.to(device), lengths=lengths.to(device))


def test_option_is_a_no_op_on_the_cpu_with_the_reason():
    plain, pinned = _criteo_like("cpu", False), _criteo_like("cpu", True)
    kjt = _kjt("cpu")
    with torch.no_grad():
        assert torch.equal(plain(kjt).values(), pinned(kjt).values())
    report = pinned.l2_residency
    assert not report.active and "cpu" in report.reason
    assert plain.l2_residency is None
    bag = embfuse.nn.EmbeddingBag(300, 8, mode="sum", pin_hot_rows_in_l2=True)
    ids = torch.randint(0, 300, (4, 3))
    assert torch.equal(bag(ids), torch.nn.functional.embedding_bag(ids, bag.weight, mode="sum"))
    with pytest.raises(ValueError, match="refresh"):
        embfuse.nn.EmbeddingBag(300, 8, pin_hot_rows_in_l2=True, l2_refresh=0)


@pytest.mark.gpu
def test_collection_on_the_gpu_bitwise_state_dict_window_and_refresh():
    plain, pinned = _criteo_like("cuda", False), _criteo_like("cuda", True)
    kjt = _kjt("cuda")
    stream = torch.cuda.current_stream()
    before = l2.stream_window(stream)
    with torch.no_grad():
        want, got = plain(kjt).values(), pinned(kjt).values()
    assert torch.equal(want, got)
    report = pinned.l2_residency
    assert report.active and report.hit_rate >= MIN_HIT_RATE
    assert 0 < report.window_bytes <= l2.support().max_persisting_bytes
    assert l2.stream_window(stream) == before  # the user's stream is left as it was
    # the state_dict is the plain module's, in the user's row order
    sd_plain, sd_pinned = plain.state_dict(), pinned.state_dict()
    assert sd_plain.keys() == sd_pinned.keys() and all(torch.equal(sd_plain[k], sd_pinned[k]) for k in sd_plain)
    # a changed table (in-place, or loaded) is copied again before the next lookup reads it
    with torch.no_grad():
        pinned.weights.mul_(2)
        plain.weights.mul_(2)
        assert torch.equal(plain(kjt).values(), pinned(kjt).values())
        sd = {k: v + 1 for k, v in plain.state_dict().items()}
        plain.load_state_dict(sd)
        pinned.load_state_dict(sd)
        assert torch.equal(plain(kjt).values(), pinned(kjt).values())
    # a lookup that trains does not read the copy, and the next inference sees its update
    trained = _criteo_like("cuda", True, optimizer=embfuse.optim.SGD(lr=0.5))
    reference = _criteo_like("cuda", False, optimizer=embfuse.optim.SGD(lr=0.5))
    for m in (trained, reference):
        with torch.no_grad():
            m(kjt)
        m(kjt).values().square().sum().backward()
    with torch.no_grad():
        assert torch.equal(trained(kjt).values(), reference(kjt).values())
        # the LayerNorm epilogue reads the copy too
        w, b = torch.randn(3, 8, device="cuda"), torch.randn(3, 8, device="cuda")
        eight = [embfuse.EmbeddingBagConfig(5000, 8, "a", feature_names=["f0"]),
                 embfuse.EmbeddingBagConfig(300, 8, "b", feature_names=["f1", "f2"])]
        e_plain = embfuse.EmbeddingBagCollection(eight, device="cuda")
        e_pinned = embfuse.EmbeddingBagCollection(eight, device="cuda", pin_hot_rows_in_l2=True)
        e_pinned.load_state_dict(e_plain.state_dict())
        assert torch.equal(e_plain.forward_layer_norm(kjt, w, b, activation="tanh"),
                           e_pinned.forward_layer_norm(kjt, w, b, activation="tanh"))
        assert e_pinned.l2_residency.active


def _captured(lookup):
    """(graph, output) of `lookup` captured into a CUDA graph kept for inspection, after one
    warm-up call on a side stream (as torch.cuda.graphs asks)."""
    stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        lookup()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = lookup()
    return graph, out


@pytest.mark.gpu
def test_a_lookup_captured_in_a_cuda_graph_is_the_plain_one():
    """A replay would have to copy the hot rows again (the table may change between replays), and
    measured so none gained (benchmarks/NOTES.md, session 27): the graph holds the plain lookup,
    which reads the table as it is at replay; eager lookups stay resident."""
    plain, pinned = _criteo_like("cuda", False), _criteo_like("cuda", True)
    kjt = _kjt("cuda")
    with torch.no_grad():
        pinned(kjt)  # counts and copies eagerly
        graph, out = _captured(lambda: pinned(kjt).values())
        assert l2.kernel_node_windows(graph) and not any(n for _, n in l2.kernel_node_windows(graph))
        for scale in (1.0, 3.0):
            pinned.weights.mul_(scale)
            plain.weights.mul_(scale)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain(kjt).values())
        assert torch.equal(pinned(kjt).values(), plain(kjt).values())  # eager again after capture
    assert pinned.l2_residency.active


@pytest.mark.gpu
def test_kernels_captured_under_a_window_keep_it_in_their_graph_nodes():
    hot, other = torch.zeros(1 << 16, device="cuda"), torch.zeros(1024, device="cuda")
    other.add_(1)  # (the kernel loaded before the capture)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=s):
        other.add_(1)
        with l2.persisting(hot, 4096):
            hot.add_(1)
        other.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    assert l2.stream_window(s) == (0, 0)  # put back after the block
    assert sorted(l2.kernel_node_windows(graph)) == [(0, 0), (0, 0), (hot.data_ptr(), 4096)]
    graph.replay()
    torch.cuda.synchronize()
    assert bool((hot == 1).all()) and bool((other == 3).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_table_module_on_the_gpu(dtype):
    torch.manual_seed(4)
    plain = embfuse.nn.EmbeddingBag(4000, 32, mode="mean", device="cuda", dtype=dtype)
    pinned = embfuse.nn.EmbeddingBag(4000, 32, mode="mean", device="cuda", dtype=dtype, pin_hot_rows_in_l2=True)
    pinned.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(5)
    ids = _powerlaw(512 * 20, 4000, g).view(512, 20).cuda()
    with torch.no_grad():
        assert torch.equal(plain(ids), pinned(ids))
        assert pinned.l2_residency.active and not pinned.l2_residency.in_place
        # cast to a wider or narrower dtype, the hot set is sized again before the copy is made
        other = torch.float16 if dtype == torch.float32 else torch.float32
        plain.to(other)
        pinned.to(other)
        assert torch.equal(plain(ids), pinned(ids)) and pinned.l2_residency.active
        plain.to(dtype)
        pinned.to(dtype)
    # with grad recorded the lookup is the plain one (and its gradient torch's)
    assert torch.equal(plain(ids), pinned(ids))


@pytest.mark.gpu
def test_ids_numbered_by_frequency_are_read_in_place_and_kept_in_a_cuda_graph():
    """No copy and no rewrite: the window lies over the table's first rows. A captured lookup
    keeps it (nothing to copy at replay) and reads the table as it is at replay."""
    torch.manual_seed(6)
    plain = embfuse.nn.EmbeddingBag(200_000, 64, mode="sum", device="cuda")  # 51 MB: past any window
    pinned = embfuse.nn.EmbeddingBag(200_000, 64, mode="sum", device="cuda", pin_hot_rows_in_l2=True)
    pinned.load_state_dict(plain.state_dict())
    ids = _ranked(4096 * 20, 200_000, torch.Generator().manual_seed(7)).view(4096, 20).cuda()
    with torch.no_grad():
        assert torch.equal(plain(ids), pinned(ids))
        report, hs = pinned.l2_residency, pinned._residency.hot_set
        assert report.active and report.in_place and report.window_bytes > 0 and report.hit_rate >= MIN_HIT_RATE
        assert hs.in_place[0] == 0 and hs.in_place[2] == 0 and report.hot_rows == hs.in_place[1]
        graph, out = _captured(lambda: pinned(ids))
        assert (pinned.weight.data_ptr(), report.window_bytes) in l2.kernel_node_windows(graph)
        for scale in (1.0, 3.0):
            pinned.weight.mul_(scale)
            plain.weight.mul_(scale)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain(ids))
        # a table cast to another dtype is sized again: the run's bytes are the new dtype's
        plain.half()
        pinned.half()
        assert torch.equal(plain(ids), pinned(ids))
        assert pinned.l2_residency.in_place and 0 < pinned.l2_residency.window_bytes < report.window_bytes
        # a collection: the run is found in its flat buffer, over the second table's first rows
        tables = [embfuse.EmbeddingBagConfig(1000, 16, "a", feature_names=["f0"]),
                  embfuse.EmbeddingBagConfig(200_000, 64, "b", feature_names=["f1"], pooling="mean")]
        c_plain = embfuse.EmbeddingBagCollection(tables, device="cuda")
        c_pinned = embfuse.EmbeddingBagCollection(tables, device="cuda", pin_hot_rows_in_l2=True)
        c_pinned.load_state_dict(c_plain.state_dict())
        g = torch.Generator().manual_seed(8)
        values = torch.cat([torch.randint(0, 1000, (4096,), generator=g), _ranked(4096 * 20, 200_000, g)])
        kjt = embfuse.KeyedJaggedTensor(["f0", "f1"], values.cuda(),
                                        lengths=torch.tensor([1] * 4096 + [20] * 4096, device="cuda"))
        assert torch.equal(c_plain(kjt).values(), c_pinned(kjt).values())
        assert c_pinned.l2_residency.in_place
        first, end, at = c_pinned._residency.hot_set.in_place  # (with these ids it takes in a's last rows too)
        a, b = c_pinned.table_weights()
        assert first <= 1000 < end
        assert at == (a[first] if first < 1000 else b[first - 1000]).data_ptr() - c_pinned.weights.data_ptr()
