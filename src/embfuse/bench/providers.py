"""The implementations measured side by side: each turns (workload, tables, batch) into a
zero-argument forward call, or raises `Unsupported`."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import embfuse
from embfuse.bench.peers import Unsupported, fbgemm_tbe as _tbe
from embfuse.bench.workloads import Workload


def attempt(row: dict, measure) -> None:
    """Run `measure(row)` (which fills in the figures); a provider that cannot run is recorded
    in the row as skipped (Unsupported) or as an error, so the other providers are still measured.
    Whatever `measure` built (tables, modules) is freed when it returns."""
    try:
        measure(row)
    except Unsupported as e:
        row["skipped"] = str(e)
    except Exception as e:  # noqa: BLE001 - keep measuring the other providers
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.empty_cache()


def _lookup(lookup, w: Workload, tables, ids, offsets):
    if w.kind == "embedding":
        return lambda: [lookup(ids, t) for t in tables]
    # CSR batches carry B+1 offsets (the last is the end): torch's include_last_offset form
    last = offsets is not None
    return lambda: [lookup(ids, t, offsets, mode=w.mode, include_last_offset=last) for t in tables]


def torch_native(w, tables, ids, offsets):
    return _lookup(F.embedding if w.kind == "embedding" else F.embedding_bag, w, tables, ids, offsets)


@functools.cache
def _compiled(kind):
    fn = F.embedding if kind == "embedding" else F.embedding_bag
    return torch.compile(fn, dynamic=True)


def torch_compiled(w, tables, ids, offsets):
    return _lookup(_compiled(w.kind), w, tables, ids, offsets)


def embfuse_default(w, tables, ids, offsets):
    """What a user gets: embfuse's default, checked (bounds_check="deferred")."""
    return _lookup(embfuse.embedding if w.kind == "embedding" else embfuse.embedding_bag, w, tables, ids, offsets)


def embfuse_unchecked(w, tables, ids, offsets):
    fn = embfuse.embedding if w.kind == "embedding" else embfuse.embedding_bag
    return _lookup(functools.partial(fn, bounds_check="off"), w, tables, ids, offsets)


def fbgemm_tbe(w, tables, ids, offsets, checked=True):
    """FBGEMM_GPU's table-batched embedding, all tables in one call; its default bounds check
    (WARNING) or none."""
    if w.kind == "embedding":
        raise Unsupported("TBE measured for sum/mean pooling only")
    tbe = _tbe([tuple(t.shape) for t in tables], dtype=w.dtype, pooling=w.mode, checked=checked)
    with torch.no_grad():
        for dst, src in zip(tbe.split_embedding_weights(), tables):
            dst.copy_(src)
    if offsets is None:
        B, L = ids.shape
        flat, offs = ids.reshape(-1), torch.arange(0, B * L + 1, L, device=ids.device)
    else:
        flat, offs = ids, offsets
    T, n = len(tables), flat.numel()
    all_ids = flat.repeat(T)
    all_offs = torch.cat([offs[:-1] + t * n for t in range(T)] + [offs[-1:] + (T - 1) * n])
    D = tables[0].shape[1]

    def call():
        out = tbe(all_ids, all_offs)  # (B, T * D), feature-major within a row
        return [out[:, t * D:(t + 1) * D] for t in range(T)]

    return call


PROVIDERS = {
    "torch": torch_native,
    "torch.compile": torch_compiled,
    "embfuse": embfuse_default,
    "embfuse-off": embfuse_unchecked,
    "fbgemm": fbgemm_tbe,
    "fbgemm-none": functools.partial(fbgemm_tbe, checked=False),
}
