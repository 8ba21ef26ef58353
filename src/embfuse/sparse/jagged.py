"""The batch of all sparse features: TorchRec's KeyedJaggedTensor layout, names and methods.

Key-major layout: `lengths` holds the bag lengths of key 0 for every sample, then key 1, ...;
`values` holds the ids in that order, `weights` (optional) one float per value. With F keys and
stride B samples, lengths has F * B entries and offsets F * B + 1; with a batch size per key
(TorchRec's variable batch, `stride_per_key_per_rank`), key f has its own B_f entries.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Optional, Sequence

import torch
from torch import Tensor

from embfuse._triton import tracing
from embfuse.ops.errors import BadCountsError
from embfuse.sparse.tracing import Traceable, assert_counts, host_data, kept


def _offsets_of(lengths: Tensor) -> Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class _Jagged(metaclass=Traceable):
    """values / weights / lengths / offsets (made from the lengths on first use). torch.fx traces
    through these classes as TorchRec's: one made from traced values is one node, and
    KeyedJaggedTensor.concat of traced batches one call (torch.fx.wrap)."""

    _values: Tensor
    _weights: Optional[Tensor]
    _lengths: Optional[Tensor]
    _offsets: Optional[Tensor]

    def _set(self, values, weights, lengths, offsets):
        """Keep the parts after the checks that need no device read: dtypes and shapes; and,
        where offsets live on the host, that they start at 0 and never decrease."""
        kind = type(self).__name__
        if lengths is None and offsets is None:
            if values.dim() < 1 or values.shape[0]:
                raise ValueError(f"a {kind} needs lengths or offsets")
            lengths = torch.empty(0, dtype=torch.int32, device=values.device)  # no values, no bags (TorchRec's)
        counts = []
        for name, t in (("lengths", lengths), ("offsets", offsets)):
            if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                if t.numel():
                    raise BadCountsError(f"{kind}: {name} must be integers, got {t.dtype}")
                t = t.new_empty(0, dtype=torch.int32)  # (torch.tensor([]) is float; TorchRec takes it)
            if t is not None and t.dim() != 1:
                if t.numel():
                    raise ValueError(f"{kind}: {name} must be 1-D, got shape {tuple(t.shape)}")
                t = t.reshape(0)
            counts.append(t)
        lengths, offsets = counts
        if values.dim() < 1:
            raise ValueError(f"{kind}: values must have a first dimension (one entry a value), got a scalar")
        if weights is not None:  # (any dtype, as TorchRec's: a lookup checks for floats where it pools)
            if weights.shape[:1] != values.shape[:1]:
                raise ValueError(f"{kind}: weights has shape {tuple(weights.shape)}; values has "
                                 f"{tuple(values.shape)} (one weight a value, or a row a row of values)")
        # (inside a traced graph the offsets are data: the lookup's check finds what this would)
        if offsets is not None and offsets.numel() and host_data(offsets):
            dec = (offsets[1:] < offsets[:-1]).nonzero()
            if int(offsets[0]) != 0 or dec.numel():
                at = 0 if int(offsets[0]) != 0 else int(dec[0]) + 1
                raise ValueError(f"{kind}: offsets must start at 0 and never decrease; offsets[{at}] = "
                                 f"{int(offsets[at])}")
        self._values, self._weights, self._offsets = values, weights, offsets
        self._lengths = lengths  # (None when made from offsets: lengths() computes them when asked)

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights")
        return self._weights

    def weights_or_none(self) -> Optional[Tensor]:
        return self._weights

    def _lengths_now(self) -> Tensor:
        """lengths() without keeping them (construction-time checks leave lengths_or_none() as it was)."""
        return self._lengths if self._lengths is not None else self._offsets[1:] - self._offsets[:-1]

    def lengths(self) -> Tensor:
        lengths = self._lengths_now()
        if self._lengths is None and not tracing():  # (kept, as offsets are: not from inside a traced graph)
            self._lengths = lengths
        return lengths

    def offsets(self) -> Tensor:
        if self._offsets is not None:
            return self._offsets
        offsets = _offsets_of(self._lengths)
        # a traced graph computes them every call: kept on the batch, they would be a compiled
        # graph's output (under CUDA graphs, memory the next replay writes over)
        if not tracing():
            self._offsets = offsets
        return offsets

    # TorchRec's accessors that do not compute: what the batch was made with, or has computed since
    def lengths_or_none(self) -> Optional[Tensor]:
        return self._lengths

    def offsets_or_none(self) -> Optional[Tensor]:
        return self._offsets

    def _parts(self) -> list[Tensor]:
        return [t for t in (self._values, self._weights, self._lengths, self._offsets) if t is not None]

    def size_in_bytes(self) -> int:
        """Bytes of values, weights, lengths and offsets (those that exist)."""
        return sum(t.numel() * t.element_size() for t in self._parts())

    def record_stream(self, stream) -> None:
        """Tell the caching allocator that `stream` uses every tensor of this batch, a VBE batch's
        inverse indices too (see torch.Tensor.record_stream): for batches read on another stream."""
        inverse = getattr(self, "_inverse_indices", None)
        for t in self._parts() + ([] if inverse is None else [inverse[1]]):
            t.record_stream(stream)


def _samples(jt: "JaggedTensor", indent: str) -> str:
    """A JaggedTensor's samples as lists, TorchRec's `str` layout (values alone, or values and weights)."""
    values = [v.tolist() for v in jt.to_dense()]
    weights = jt.to_dense_weights()
    if weights is None:
        return f"{indent}{values}"
    return f'{indent}"values": {values},\n{indent}"weights": {[w.tolist() for w in weights]}'


def _padded(t: Tensor, offsets: Tensor, lengths: Tensor, length: Optional[int], pad: float) -> Tensor:
    B = lengths.numel()
    if length is None:
        length = int(lengths.max()) if B else 0
    lengths = lengths.long()
    bag = torch.repeat_interleave(torch.arange(B, device=t.device), lengths)
    pos = torch.arange(bag.numel(), device=t.device) - offsets.long()[:-1].repeat_interleave(lengths)
    keep = pos < length
    out = torch.full((B, length, *t.shape[1:]), pad, dtype=t.dtype, device=t.device)
    out[bag[keep], pos[keep]] = t[:bag.numel()][keep]
    return out


class JaggedTensor(_Jagged):
    """One feature's bags: values[offsets[b]:offsets[b+1]] is sample b's list (and weights)."""

    def __init__(self, values: Tensor, weights: Optional[Tensor] = None, lengths: Optional[Tensor] = None,
                 offsets: Optional[Tensor] = None):
        self._set(values, weights, lengths, offsets)

    def to(self, device, non_blocking: bool = False) -> "JaggedTensor":
        """The same samples on `device`: values, weights, lengths and offsets (if made) copied."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return JaggedTensor(move(self._values), move(self._weights), lengths=move(self.lengths()),
                            offsets=move(self._offsets))

    def to_dense(self) -> list[Tensor]:
        """One tensor per sample."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_dense_weights(self) -> Optional[list[Tensor]]:
        """One weights tensor per sample (None without weights)."""
        return None if self._weights is None else list(torch.split(self._weights, self.lengths().tolist()))

    def to_padded_dense(self, desired_length: Optional[int] = None, padding_value: float = 0.0) -> Tensor:
        """(B, L, ...): sample b's values in row b, cut or padded with `padding_value` to L =
        `desired_length` (default: the longest sample, a host read)."""
        return _padded(self._values, self.offsets(), self.lengths(), desired_length, padding_value)

    def to_padded_dense_weights(self, desired_length: Optional[int] = None,
                                padding_value: float = 0.0) -> Optional[Tensor]:
        """to_padded_dense of the weights (None without weights)."""
        if self._weights is None:
            return None
        return _padded(self._weights, self.offsets(), self.lengths(), desired_length, padding_value)

    @staticmethod
    def empty(is_weighted: bool = False, device=None, values_dtype=None, weights_dtype=None,
              lengths_dtype: torch.dtype = torch.int32) -> "JaggedTensor":
        """TorchRec's: no samples, no values (and no offsets at all)."""
        empty = torch.empty(0, dtype=lengths_dtype, device=device)
        return JaggedTensor(torch.empty(0, dtype=values_dtype, device=device),
                            torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
                            lengths=empty, offsets=empty)

    @staticmethod
    def from_dense_lengths(values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> "JaggedTensor":
        """TorchRec's: sample b's list is the first lengths[b] entries of values[b] (B, N, ...)."""
        keep = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
        return JaggedTensor(values[keep], kept(weights, keep), lengths=lengths)

    @staticmethod
    def from_dense(values: Sequence[Tensor], weights: Optional[Sequence[Tensor]] = None) -> "JaggedTensor":
        """TorchRec's: one tensor a sample (int32 lengths, as TorchRec's)."""
        cat = torch.cat(list(values), dim=0)
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int32, device=cat.device)
        return JaggedTensor(cat, None if weights is None else torch.cat(list(weights), dim=0), lengths=lengths)

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self.lengths()})"

    def __str__(self) -> str:
        """TorchRec's layout: each sample's values as a list (and weights, when there are)."""
        return f"JaggedTensor({{\n{_samples(self, '    ')}\n}})\n"


class KeyedJaggedTensor(_Jagged):
    """keys: feature names; values: every key's values, key-major (ids for a lookup, which checks
    their dtype; any dtype and shape [n, ...] otherwise, as TorchRec's generic container);
    lengths or offsets (F * B [+1]); weights: optional per-value floats; stride: B (inferred from
    the lengths when omitted). A key may appear twice (permute([1, 1])): indexing by it finds the
    last, as TorchRec's does.

    Variable batch size per feature (TorchRec's VBE): `stride_per_key_per_rank[f]` lists how many
    samples key f has from each rank (key f then has their sum of lengths), and `inverse_indices`
    = (keys, tensor (F, B)) maps each of the B samples of the full batch to its row of a key's
    deduplicated samples; stride() is then B (or, without inverse indices, the largest key's)."""

    def __init__(self, keys: Sequence[str], values: Tensor, weights: Optional[Tensor] = None,
                 lengths: Optional[Tensor] = None, offsets: Optional[Tensor] = None, stride: Optional[int] = None,
                 length_per_key: Optional[list[int]] = None, stride_per_key_per_rank=None, inverse_indices=None):
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must be a sequence of strings (feature names), got {keys!r}")
        self._keys = list(keys)
        self._set(values, weights, lengths, offsets)
        F = len(self._keys)
        n = self._lengths.numel() if self._lengths is not None else max(self._offsets.numel() - 1, 0)
        self._stride_per_key_per_rank = None
        self._inverse_indices = inverse_indices
        if stride_per_key_per_rank is not None:
            spkpr = (stride_per_key_per_rank.tolist() if torch.is_tensor(stride_per_key_per_rank)
                     else [list(r) for r in stride_per_key_per_rank])
            if len(spkpr) != F:
                raise ValueError(f"stride_per_key_per_rank has {len(spkpr)} rows for {F} keys")
            self._stride_per_key_per_rank = spkpr
            self._stride_per_key = [int(sum(r)) for r in spkpr]
            if sum(self._stride_per_key) != n:
                raise ValueError(f"lengths has {n} entries; stride_per_key_per_rank gives the keys "
                                 f"{self._stride_per_key} samples ({sum(self._stride_per_key)})")
            if stride is None:
                if inverse_indices is not None and inverse_indices[1].numel():
                    stride = inverse_indices[1].shape[-1]
                else:
                    stride = max(self._stride_per_key, default=0)
        else:
            if stride is None:
                if F and n % F:
                    raise ValueError(f"{n} lengths do not split evenly over {F} keys")
                stride = n // F if F else 0
            elif n != F * stride:
                raise ValueError(f"lengths has {n} entries; {F} keys x stride {stride} needs {F * stride}")
            self._stride_per_key = [stride] * F
        self._stride = stride
        self._bounds = list(itertools.accumulate(self._stride_per_key, initial=0))  # each key's lengths
        self._length_per_key = length_per_key
        counts = self._offsets if self._lengths is None else self._lengths
        if host_data(counts):
            self.validate()  # host lengths: the sums cost no device read (traced: the lookup's check)

    # TorchRec's own ComputeKJTToJTDict module passes this (its to_dict cache) on: embfuse keeps none
    _jt_dict = None
    _padded = False  # values past the lengths' sum (sparse/padded.py)

    # --- TorchRec's accessors ---
    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        """Number of values of each key (one host read the first time, if on a GPU). On the meta
        device, which holds no lengths, the values split as evenly as they go (TorchRec's rule)."""
        if self._length_per_key is None:
            F = len(self._keys)
            if F and self._values.is_meta:
                n = self._values.shape[0]
                self._length_per_key = [n // F + (f == 0) * (n % F) for f in range(F)]
            elif not self.variable_stride_per_key():
                self._length_per_key = self.lengths().reshape(F, self._stride).sum(1).tolist() if F else []
            else:
                ends = torch.cat([self.lengths().new_zeros(1, dtype=torch.int64), self.lengths().long().cumsum(0)])
                at = ends[torch.tensor(self._bounds, device=ends.device)]
                self._length_per_key = (at[1:] - at[:-1]).tolist()
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return list(itertools.accumulate(self.length_per_key(), initial=0))

    def length_per_key_or_none(self) -> Optional[list[int]]:
        return self._length_per_key

    def offset_per_key_or_none(self) -> Optional[list[int]]:
        return None if self._length_per_key is None else self.offset_per_key()

    def sync(self) -> "KeyedJaggedTensor":
        """Compute the per-key lengths now (a host read on a GPU), so later accessors need none."""
        self.length_per_key()
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        self._length_per_key = None
        return self

    def stride_per_key(self) -> list[int]:
        """Samples of each key (stride() for each, unless the batch size varies per key)."""
        return list(self._stride_per_key)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """TorchRec's: each key's samples from each rank ([] without a variable batch size)."""
        return [] if self._stride_per_key_per_rank is None else [list(r) for r in self._stride_per_key_per_rank]

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self):
        if self._inverse_indices is None:
            raise ValueError("this KeyedJaggedTensor has no inverse indices")
        return self._inverse_indices

    def inverse_indices_or_none(self):
        return self._inverse_indices

    def lengths_offset_per_key(self) -> list[int]:
        """Where each key's lengths start in lengths(), and their end."""
        return list(self._bounds)

    def index_per_key(self) -> dict[str, int]:
        """key -> its position in keys() (a repeated key: its last)."""
        return {k: i for i, k in enumerate(self._keys)}

    @staticmethod
    def from_lengths_sync(keys, values, lengths, weights=None, stride=None, stride_per_key_per_rank=None,
                          inverse_indices=None) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices)

    @staticmethod
    def from_offsets_sync(keys, values, offsets, weights=None, stride=None, stride_per_key_per_rank=None,
                          inverse_indices=None) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, weights, offsets=offsets, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices)

    @staticmethod
    def empty(is_weighted: bool = False, device=None, values_dtype=None, weights_dtype=None,
              lengths_dtype: torch.dtype = torch.int32) -> "KeyedJaggedTensor":
        """TorchRec's: no keys, no values, stride 0."""
        return KeyedJaggedTensor([], torch.empty(0, dtype=values_dtype, device=device),
                                 torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
                                 lengths=torch.empty(0, dtype=lengths_dtype, device=device), stride=0)

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """TorchRec's: no keys, the dtypes, device and stride of `kjt` (one call when traced)."""
        return _empty_like(kjt)

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> "KeyedJaggedTensor":
        jts = list(jt_dict.values())
        if not jts:
            raise ValueError("from_jt_dict needs at least one JaggedTensor")
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError("either every JaggedTensor has weights or none has")
        samples = [jt.lengths().numel() for jt in jts]
        return KeyedJaggedTensor(list(jt_dict), torch.cat([jt.values() for jt in jts]),
                                 torch.cat([jt.weights() for jt in jts]) if all(weighted) else None,
                                 lengths=torch.cat([jt.lengths() for jt in jts]),
                                 length_per_key=[jt.values().shape[0] for jt in jts],
                                 stride_per_key_per_rank=[[b] for b in samples] if len(set(samples)) > 1 else None)

    # --- slicing by key ---
    def _key_slices(self):
        at, lpk, opk = self._bounds, self.length_per_key(), self.offset_per_key()
        self._check_total(opk[-1])
        for i, key in enumerate(self._keys):
            yield key, slice(at[i], at[i + 1]), slice(opk[i], opk[i] + lpk[i])

    def _per_key(self) -> list[JaggedTensor]:
        """Each key's JaggedTensor, by position (keys may repeat). A key without samples has no
        offsets either, as JaggedTensor.empty (TorchRec's)."""
        return [JaggedTensor(self._values[vs], None if self._weights is None else self._weights[vs],
                             lengths=self.lengths()[ls], offsets=None if ls.stop > ls.start else self.lengths()[ls])
                for _, ls, vs in self._key_slices()]

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        """key -> JaggedTensor (a repeated key: its last occurrence, as TorchRec's), each with its
        offsets made now unless `compute_offsets` is False (then on first use)."""
        out = dict(zip(self._keys, self._per_key()))
        if compute_offsets:
            for jt in out.values():
                jt.offsets()
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        if key not in self._keys:
            raise KeyError(f"no key {key!r}; keys are {self._keys}")
        return self.to_dict()[key]

    def split(self, segments: Sequence[int]) -> list["KeyedJaggedTensor"]:
        """Consecutive groups of keys, segments[i] keys each."""
        if sum(segments) != len(self._keys):
            raise ValueError(f"segments {list(segments)} do not add up to the {len(self._keys)} keys")
        out, start = [], 0
        at, opk, lpk = self._bounds, self.offset_per_key(), self.length_per_key()
        spkpr = self._stride_per_key_per_rank
        self._check_total(opk[-1])
        for size in segments:
            keys = self._keys[start:start + size]
            vs = slice(opk[start], opk[start + size])
            out.append(KeyedJaggedTensor(
                keys, self._values[vs], None if self._weights is None else self._weights[vs],
                lengths=self.lengths()[at[start]:at[start + size]], stride=self._stride,
                length_per_key=lpk[start:start + size],
                stride_per_key_per_rank=None if spkpr is None else spkpr[start:start + size]))
            start += size
        return out

    def permute(self, indices: Sequence[int]) -> "KeyedJaggedTensor":
        """A KJT whose key i is this one's key indices[i] (keys may repeat or be left out)."""
        parts = self._per_key()
        jts = [parts[i] for i in indices]
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices], torch.cat([jt.values() for jt in jts]) if jts else self._values[:0],
            None if self._weights is None else torch.cat([jt.weights() for jt in jts]) if jts else self._weights[:0],
            lengths=torch.cat([jt.lengths() for jt in jts]) if jts else self.lengths()[:0], stride=self._stride,
            length_per_key=[self.length_per_key()[i] for i in indices],
            stride_per_key_per_rank=None if self._stride_per_key_per_rank is None else
            [self._stride_per_key_per_rank[i] for i in indices])

    @staticmethod
    def concat(kjts: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of every KJT in order (same stride, keys distinct; with a variable batch size per
        key, each key keeps its own)."""
        return _concat(kjts)

    def _check_total(self, total: int) -> None:
        """Slicing by key reads the per-key lengths anyway: they must add up to the values (a padded
        batch's, to at most them). Traced, they may be data-dependent: see assert_counts."""
        n = self._values.shape[0]
        fits = total <= n if self._padded else total == n
        if tracing():
            assert_counts(self.length_per_key(), fits)
        elif not fits:
            raise ValueError(f"lengths add up to {total}, past the {n} values of the padded batch" if self._padded
                             else f"lengths add up to {total} but there are {n} values")

    # --- moving ---
    def _tensors(self):
        return [t for t in (self._values, self.lengths(), self._weights) if t is not None]

    def pin_memory(self) -> "KeyedJaggedTensor":
        """The KJT in pinned host memory, packed as `to` packs it (one buffer, 16-byte aligned
        parts) so that a later `.to("cuda", non_blocking=True)` is that buffer's one copy with no
        packing on the host (a data loader worker pays for the packing instead)."""
        self.length_per_key()
        buf, starts, sizes = self._pack(pin=True)
        out = self._with(*self._unpack(buf, starts, sizes))
        out._packed = (buf, starts, sizes)
        return out

    def _pack(self, pin: bool):
        parts = self._tensors()
        sizes = [t.numel() * t.element_size() for t in parts]
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + -(-s // 16) * 16)
        buf = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pin)
        for t, a, s in zip(parts, starts, sizes):
            buf[a:a + s] = t.contiguous().view(-1).view(torch.uint8)
        return buf, starts, sizes

    def _unpack(self, buf, starts, sizes):
        return [buf[a:a + s].view(t.dtype).view(t.shape) for t, a, s in zip(self._tensors(), starts, sizes)]

    def _with(self, values, lengths, weights=None):
        inverse = self._inverse_indices
        if inverse is not None and inverse[1].device != values.device:
            inverse = (inverse[0], inverse[1].to(values.device, non_blocking=True))
        return type(self)(self._keys, values, weights, lengths=lengths, stride=self._stride,
                          length_per_key=self._length_per_key,
                          stride_per_key_per_rank=self._stride_per_key_per_rank, inverse_indices=inverse)

    def to(self, device, non_blocking: bool = False) -> "KeyedJaggedTensor":
        """Move to `device` in ONE copy: values, lengths and weights are packed into one byte
        buffer (16-byte aligned parts), copied, and viewed back as their dtypes on arrival (a KJT
        from `pin_memory()` is packed already). The per-key lengths are summed here first, so the
        moved KJT never reads them back."""
        device = torch.device(device)
        if self.device() == device:
            return self
        self.length_per_key()  # on the source side, where it costs no device read
        packed = getattr(self, "_packed", None)
        if packed is None:
            pin = non_blocking and self.device().type == "cpu" and device.type == "cuda"
            packed = self._pack(pin)
        buf, starts, sizes = packed
        return self._with(*self._unpack(buf.to(device, non_blocking=non_blocking), starts, sizes))

    # --- checks and TorchRec interop ---
    def validate(self) -> "KeyedJaggedTensor":
        """Raise if lengths are negative or do not add up to the values, or an inverse index names
        no sample of its feature (one host read)."""
        if self._weights is not None and self._weights.shape != self._values.shape[:1]:
            raise ValueError(f"weights has shape {tuple(self._weights.shape)}; values has "
                             f"{tuple(self._values.shape)}")
        lengths = self._lengths_now()
        neg, total = (lengths < 0).any(), lengths.sum()
        neg, total = torch.stack([neg.long(), total.long()]).tolist()
        if neg:
            i = int((lengths < 0).nonzero()[0])
            f = bisect.bisect_right(self._bounds, i) - 1
            raise ValueError(f"feature {self._keys[f]!r}: lengths[{i}] (sample {i - self._bounds[f]}) = "
                             f"{int(lengths[i])} is negative")
        self._check_total(total)
        inverse = self._inverse_indices
        if inverse is not None and self._stride_per_key_per_rank is not None and inverse[1].device.type == "cpu":
            keys, index = inverse
            strides = torch.tensor([self._stride_per_key[self._keys.index(k)] if k in self._keys else 2**62
                                    for k in keys])
            bad = ((index < 0) | (index >= strides[:, None])).nonzero()
            if bad.numel():
                f, b = bad[0].tolist()
                raise ValueError(f"inverse_indices of feature {keys[f]!r}: [{b}] = {int(index[f, b])} is not one of "
                                 f"its {int(strides[f])} samples")
        return self

    @staticmethod
    def from_torchrec(kjt) -> "KeyedJaggedTensor":
        variable = kjt.variable_stride_per_key()
        return KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights_or_none(), lengths=kjt.lengths(),
                                 stride=kjt.stride(),
                                 stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
                                 inverse_indices=kjt.inverse_indices_or_none())

    def to_torchrec(self):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT

        return TorchRecKJT(keys=self._keys, values=self._values, weights=self._weights, lengths=self.lengths(),
                           stride=self._stride, stride_per_key_per_rank=self._stride_per_key_per_rank,
                           inverse_indices=self._inverse_indices)

    def __repr__(self) -> str:
        return (f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values}, "
                f"lengths={self.lengths()}, weights={self._weights})")

    def __str__(self) -> str:
        """TorchRec's layout: per key, each sample's values (and weights) as lists."""
        if not self._keys:
            return "KeyedJaggedTensor()\n"
        parts = []
        for key, jt in zip(self._keys, self._per_key()):
            body = _samples(jt, "        ")
            shown = f"{{\n{body}\n    }}" if jt.weights_or_none() is not None else body.strip()
            parts.append(f'    "{key}": ' + shown)
        return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"


def _concat(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    variable = any(k.variable_stride_per_key() for k in kjts)
    if not variable and len({k.stride() for k in kjts}) > 1:
        raise ValueError(f"cannot concat KJTs of strides {[k.stride() for k in kjts]}")
    weighted = {k.weights_or_none() is not None for k in kjts}
    if any(k._padded for k in kjts):
        raise ValueError("cannot concat padded batches (their padding would sit between keys): unpad() them first")
    if len(weighted) > 1:
        raise ValueError("either every KJT has weights or none has")
    return KeyedJaggedTensor(
        [key for k in kjts for key in k.keys()], torch.cat([k.values() for k in kjts]),
        torch.cat([k.weights() for k in kjts]) if weighted == {True} else None,
        lengths=torch.cat([k.lengths() for k in kjts]), stride=None if variable else kjts[0].stride(),
        length_per_key=[n for k in kjts for n in k.length_per_key()],
        stride_per_key_per_rank=[r for k in kjts for r in (k.stride_per_key_per_rank()
                                                          or [[s] for s in k.stride_per_key()])]
        if variable else None)


torch.fx.wrap("_concat")
torch.fx.wrap("kept")  # (sparse/tracing.py: fx wraps a name in the module that calls it)


@torch.fx.wrap
def _empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    w = kjt.weights_or_none()
    return KeyedJaggedTensor([], kjt.values().new_empty((0,) + tuple(kjt.values().shape[1:])),
                             None if w is None else w.new_empty(0), lengths=kjt.lengths().new_empty(0),
                             stride=kjt.stride())

