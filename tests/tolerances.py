"""One dtype -> tolerance table for every comparison with a float64 reference.

rtol covers rounding the result to the storage dtype once; atol is per pooled element and is
multiplied by the reduction size (fp32 accumulation error grows with the number of terms)."""

import torch

TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (8e-3, 1e-4),
    torch.float64: (1e-12, 1e-13),
}


def assert_close(actual, expected, dtype, reduction=1):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol,
                               atol=atol * max(1, reduction), equal_nan=False)


def random_bags(num_bags, max_len, num_embeddings, device, index_dtype=torch.int64, empty=True):
    """Random CSR bags: lengths in [0, max_len] with at least one empty bag when `empty`."""
    lengths = torch.randint(0, max_len + 1, (num_bags,))
    if empty and num_bags > 1:
        lengths[num_bags // 2] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, num_embeddings, (int(offsets[-1]),))
    return ids.to(device, index_dtype), offsets.to(device, index_dtype)
