"""Where a sharded collection's batch goes (sharded.py's step 1): each rank's slots (one per
(rank, feature) it holds), the lengths and counts of every slot, the header of counts, and the
send buffer.

A feature of a table-wise table goes whole to its rank, one of a column-wise table whole to every
piece's rank: their ids move as block copies, as given. Only a row-wise feature's ids are read
one by one: bucketed by row block (sorted stably, so each bag keeps its order) and made local to
the block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from embfuse.ops import errors
from embfuse.ops.bags import SKIPPED
from embfuse.ops.safe import feature_rules, safe_bags
from embfuse.ops.validate import check_index_dtype, collection_status
from embfuse.sparse.jagged import KeyedJaggedTensor

# a header row per rank pair: the sender's status, its batch size, then its ids per slot of the receiver
STATUS, BATCH, COUNTS = 0, 1, 2


@dataclass
class Routed:
    """A batch routed on its rank: `given` the batch as given (one key a feature) and `offsets`
    its offsets, which an error message points into; `kjt` the batch as it is pooled (after
    TensorFlow's safe rules, if any feature has them); `lens` (slots, B) each slot's lengths;
    `values` / `psw` the pooled batch's ids (int64) and weights (fp32); `rows` the row-wise
    features' (local ids, weights) in slot order (Routing's keys), or None."""

    given: KeyedJaggedTensor
    offsets: Tensor
    kjt: KeyedJaggedTensor
    values: Tensor
    psw: Optional[Tensor]
    rows: Optional[tuple]
    lens: Tensor
    B: int


class Routing:
    """The host tables of the routing of one plan (`shards`, `kinds`: per feature, in
    `feature_names` order; `entries[r]`: rank r's features, one slot each, from `slot_base[r]`).
    `sources`: the batch's key each feature reads; a feature of several tables is one feature a
    table here, named as the collection names its outputs (f"{feature}@{table}"). `safe`: each
    feature's TensorFlow rule (ops/safe.py safe_rule) or None: such features are pooled after the
    safe pass, made here before the routing, so their dropped ids travel as ids < 0 (with weight 0
    in a weighted batch; as SKIPPED to the first row shard, for row-wise tables) and their default
    ids as ids."""

    def __init__(self, feature_names, sources, shards, kinds, rows, entries, slot_base, is_weighted, device,
                 weight_dtype=torch.float32, safe=None):
        F, nslots = len(feature_names), slot_base[-1]
        self.feature_names, self.sources, self.is_weighted, self.device = feature_names, sources, is_weighted, device
        self.weight_dtype = weight_dtype  # what the weights cross ranks in: the tables' accumulation dtype
        self.rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.rules, self.limits = feature_rules(safe, self.rows)
        self.defaults = [r is not None and r[2] is not None for r in safe or [None] * F]
        # each slot's source: (feature, None) for a whole feature, (feature, j) for row shard j.
        # The lengths of every slot are rows of [the batch's (F, B) lengths; each row-wise
        # feature's (shards, B) counts]: `slot_rows` picks them.
        # A row-wise feature's ids are bucketed by key = its place among them x the most shards
        # + the id's shard: one stable sort puts every row-wise feature's ids in slot order.
        self.row_features = [i for i, (k, ss) in enumerate(zip(kinds, shards)) if k == "row_wise" and len(ss) > 1]
        self.most_shards = max([len(shards[i]) for i in self.row_features], default=1)
        key_base = [0] * F
        for k, i in enumerate(self.row_features):
            key_base[i] = k * self.most_shards
        self.key_base = torch.tensor(key_base, dtype=torch.int64, device=device)
        self.blocks = torch.tensor([ss[0].rows if i in self.row_features else r for i, (ss, r) in
                                    enumerate(zip(shards, rows))], dtype=torch.int64, device=device)
        row_base = {i: F + key_base[i] for i in self.row_features}
        source = {}
        for i, (f, ss) in enumerate(zip(feature_names, shards)):
            for j, s in enumerate(ss):
                source[slot_base[s.rank] + entries[s.rank].index(f)] = (i, j if i in row_base else None)
        self.slot_source = [source[slot] for slot in range(nslots)]
        self.slot_rows = torch.tensor([f if j is None else row_base[f] + j for f, j in self.slot_source],
                                      dtype=torch.int64, device=device)
        self.world, self.slot_base = len(entries), slot_base
        self.header_width = H = COUNTS + max(len(e) for e in entries)
        # the header is one gather of (status, each slot's ids, B, 0): few launches, each costs host time
        src = [nslots + 2] * (self.world * H)
        for r in range(self.world):
            src[r * H + STATUS], src[r * H + BATCH] = 0, nslots + 1
            for e in range(len(entries[r])):
                src[r * H + COUNTS + e] = 1 + slot_base[r] + e
        self.header_src = torch.tensor(src, dtype=torch.int64, device=device)
        self._fields = (None, None)  # (B, the device tensor [B, 0]) of the last batch

    def features(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch unpadded, one key a feature, in the collection's feature order (a feature of
        several tables repeated, under its output names)."""
        if kjt.keys() == self.feature_names and not kjt._padded:  # (a VBE batch made one stride: nn/vbe.py)
            return kjt
        missing = [f for f in self.sources if f not in kjt.keys()]
        if missing:  # (a KeyError: every rank raises it, see input_dist)
            raise KeyError(f"the batch has no feature {missing[0]!r} (its keys: {kjt.keys()})")
        kjt = kjt.unpad() if kjt._padded else kjt  # (the exchange reads its sizes on the host anyway)
        if kjt.keys() != self.sources:
            kjt = kjt.permute([kjt.keys().index(f) for f in self.sources])
        if self.sources != self.feature_names:
            kjt = KeyedJaggedTensor(self.feature_names, kjt.values(), kjt.weights_or_none(), lengths=kjt.lengths(),
                                    stride=kjt.stride(), length_per_key=kjt.length_per_key_or_none())
        return kjt

    def route(self, kjt: KeyedJaggedTensor, strides: Optional[Tensor] = None) -> tuple[Tensor, Routed]:
        """The header to exchange (this batch's status and counts a slot) and the routed batch.
        Bad ids and lengths are clamped where they are read one by one, so that routing a bad
        batch stays in bounds (it is then never sent). `strides`: a VBE batch padded to one
        stride, each feature's own batch size (nn/vbe.py one_stride)."""
        kjt = self.features(kjt)
        values, lengths = kjt.values(), kjt.lengths()
        psw = kjt.weights_or_none() if self.is_weighted else None
        if self.is_weighted and psw is None:
            raise ValueError("a weighted collection (is_weighted=True) needs a batch with weights")
        check_index_dtype("values", values)
        check_index_dtype("lengths", lengths)
        for name, t in (("values", values), ("lengths", lengths)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; this rank's shards are on {self.device}")
        B, F, n = kjt.stride(), len(self.feature_names), values.numel()
        if F * B == 0 and n:
            raise errors.BadBatchError(f"the batch has no bags but {n} values")
        Bs, dev = max(B, 1), self.device
        lengths = lengths.long()
        offsets = torch.zeros(F * B + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        status = collection_status(values, offsets, self.limits, B)
        # ids as int64 and weights in weight_dtype whatever each rank was given: the collectives
        # need every rank to send one dtype
        psw = psw.to(self.weight_dtype) if psw is not None else None
        values = values.long()
        pooled, given_offsets = kjt, offsets
        if self.rules is not None:  # (a bad batch is never sent)
            values, offsets, psw = safe_bags(values, offsets, psw, self.rules, B, status.view(1), self.weight_dtype,
                                             strides=strides)
            lengths = offsets.diff()
            per_key = [c + B * d for c, d in zip(kjt.length_per_key(), self.defaults)]  # (host counts, as below)
            pooled = KeyedJaggedTensor(self.feature_names, values, psw, lengths=lengths, stride=B,
                                       length_per_key=per_key)
            n = values.numel()
        lens = lengths.view(F, B)
        rows = None
        if self.row_features:
            starts = [0]
            for c in pooled.length_per_key():  # (host counts: read only if the batch does not carry them)
                starts.append(min(max(starts[-1] + c, 0), n))  # (in bounds whatever the lengths)
            spans = [torch.arange(starts[i], starts[i + 1], device=dev) for i in self.row_features]
            at = spans[0] if len(spans) == 1 else torch.cat(spans)
            # (bad lengths: garbage from here on, clamped in bounds, never sent)
            bag = (torch.searchsorted(offsets, at, right=True) - 1).clamp(0, max(F * B - 1, 0))
            feature = bag // Bs
            ids = torch.minimum(values[at].clamp(min=0), self.rows[feature] - 1)
            shard = ids // self.blocks[feature]
            K = len(self.row_features) * self.most_shards
            key = (self.key_base[feature] + shard).clamp(max=K - 1)
            order = torch.sort(key.int(), stable=True).indices
            local = ids - shard * self.blocks[feature]
            if self.rules is not None:  # (dropped ids go as SKIPPED)
                local = torch.where(values[at] < 0, SKIPPED, local)
            rows = (local[order], None if psw is None else psw[at][order])
            counts = torch.zeros(K * Bs, dtype=torch.int64, device=dev).index_add_(
                0, key * Bs + bag - feature * Bs, torch.ones_like(key))
            lens = torch.cat([lens, counts.view(K, Bs)[:, :B]])
        lens = lens.index_select(0, self.slot_rows)
        if self._fields[0] != B:
            self._fields = (B, torch.tensor([B, 0], dtype=torch.int64, device=dev))
        header = torch.cat([status.view(1), lens.sum(1), self._fields[1]])[self.header_src]
        return header, Routed(kjt, given_offsets, pooled, values, psw, rows, lens, B)

    def send_buffer(self, routed: Routed, counts: list[int]) -> tuple[Tensor, list[int]]:
        """One int64 buffer to send and its size for each destination (`counts`: each slot's
        ids, from the header). Destination d's part: its slots' lengths, then their ids, then
        their weights' bits (fp32 as int32, widened, or fp64 as int64; `unpack_weights` undoes it): views of the
        batch for whole features, of the sorted blocks for row-wise ones (one split call each,
        not a slice each: the host's time here is the GPU's idle time), then one copy."""
        psw, B = routed.psw, routed.B
        size = [0] * len(self.feature_names)  # each feature's ids (a row-wise one's: the sum of its shards')
        count = {}
        for (i, j), c in zip(self.slot_source, counts):
            size[i] = c if j is None else size[i] + c  # (a column-wise feature: each copy is the whole)
            count[(i, j)] = c
        keys = [(i, j) for i in self.row_features for j in range(self.most_shards)]  # the sorted ids' order

        def pieces(whole: Tensor, rows: Optional[Tensor]) -> dict:
            """(feature, None) -> the feature's ids in `whole`; (feature, shard) -> its ids in `rows`."""
            out = dict(zip([(i, None) for i in range(len(size))], torch.split(whole, size)))
            if rows is not None:
                out.update(zip(keys, torch.split(rows, [count.get(k, 0) for k in keys])))
            return out

        rows = routed.rows or (None, None)
        ids = pieces(routed.values, rows[0])
        bits = None if psw is None else pieces(weight_bits(psw), None if rows[1] is None else weight_bits(rows[1]))
        lens = torch.split(routed.lens, [b - a for a, b in zip(self.slot_base, self.slot_base[1:])])
        parts, sizes = [], []
        for d in range(self.world):
            slots = range(self.slot_base[d], self.slot_base[d + 1])
            parts.append(lens[d].reshape(-1))
            parts += [ids[self.slot_source[k]] for k in slots]
            if bits is not None:
                parts += [bits[self.slot_source[k]] for k in slots]
            sizes.append(len(slots) * B + (2 if psw is not None else 1) * sum(counts[k] for k in slots))
        return torch.cat(parts), sizes


def weight_bits(w: Tensor) -> Tensor:
    """fp32 or fp64 weights as int64 bits, to cross ranks in the ids' buffer (exact both ways)."""
    return w.view(torch.int64) if w.dtype == torch.float64 else w.view(torch.int32).long()


def unpack_weights(bits: Tensor, dtype: torch.dtype) -> Tensor:
    """Weights sent by Routing.send_buffer (weight_bits) as `dtype` (fp32 or fp64) again."""
    return bits.view(torch.float64) if dtype == torch.float64 else bits.int().view(torch.float32)
