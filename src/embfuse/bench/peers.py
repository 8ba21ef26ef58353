"""The peers' modules, built in one place: FBGEMM_GPU's table-batched embedding (TBE)."""

from __future__ import annotations


class Unsupported(Exception):
    """A provider cannot run a workload (missing package, unsupported mode)."""


def fbgemm_bounds_check(checked: bool):
    """FBGEMM's BoundsCheckMode: its default WARNING (checked) or NONE."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    return BoundsCheckMode.WARNING if checked else BoundsCheckMode.NONE


def fbgemm_tbe(shapes, *, dtype: str = "float32", pooling: str = "sum", optimizer: str | None = None,
               checked: bool = True):
    """An FBGEMM TBE on the GPU over tables of `shapes` ((rows, dim) each): weights of `dtype`,
    `pooling` sum or mean, `optimizer` None (forward only), "sgd" or "rowwise" (exact SGD /
    exact row-wise Adagrad fused into its backward, lr 0.01, eps 1e-8), its default bounds
    check (WARNING) or none. Raises Unsupported when fbgemm_gpu does not import."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError as e:
        raise Unsupported(f"fbgemm_gpu does not import: {e}") from None
    if pooling not in ("sum", "mean"):
        raise Unsupported("TBE measured for sum/mean pooling only")
    precision = {"float32": SparseType.FP32, "float16": SparseType.FP16, "bfloat16": SparseType.BF16}[dtype]
    kwargs = {}
    if optimizer is not None:
        kwargs = dict(optimizer=EmbOptimType.EXACT_SGD if optimizer == "sgd" else EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                      learning_rate=0.01, eps=1e-8)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for rows, dim in shapes],
        weights_precision=precision, output_dtype=precision,
        cache_precision=SparseType.FP16 if precision == SparseType.FP16 else SparseType.FP32,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN,
        bounds_check_mode=fbgemm_bounds_check(checked), **kwargs)
