"""pytree registrations of the jagged classes: torch.export and torch.compile take and return
them. Tensors are the leaves; keys, strides and widths the spec."""

import torch
import torch.fx._pytree
import torch.utils._pytree
from torch import Tensor

from embfuse.sparse.jagged import JaggedTensor, KeyedJaggedTensor
from embfuse.sparse.keyed_tensor import KeyedTensor
from embfuse.sparse.padded import PaddedKeyedJaggedTensor


def _jt_flatten(jt: JaggedTensor):
    return [jt.values(), jt.weights_or_none(), jt.lengths_or_none(), jt.offsets_or_none()], None


def _jt_unflatten(leaves, context) -> JaggedTensor:
    values, weights, lengths, offsets = leaves
    return JaggedTensor(values, weights, lengths=lengths, offsets=offsets)


def _kjt_flatten(kjt: KeyedJaggedTensor):
    inverse = kjt.inverse_indices_or_none()
    leaves = [kjt.values(), kjt.weights_or_none(), kjt.lengths_or_none(), kjt.offsets_or_none(),
              None if inverse is None else inverse[1]]
    return leaves, (kjt.keys(), kjt.stride(), kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
                    None if inverse is None else inverse[0])


def _kjt_unflatten(leaves, context, cls=KeyedJaggedTensor) -> KeyedJaggedTensor:
    values, weights, lengths, offsets, *rest = leaves  # (a spec saved without the inverse indices: 4)
    inverse = rest[0] if rest else None
    keys, stride, spkpr, inverse_keys = context
    return cls(keys, values, weights, lengths=lengths, offsets=offsets, stride=stride, stride_per_key_per_rank=spkpr,
               inverse_indices=None if inverse_keys is None else (inverse_keys, inverse))


def _padded_unflatten(leaves, context) -> PaddedKeyedJaggedTensor:
    return _kjt_unflatten(leaves, context, PaddedKeyedJaggedTensor)


def _kt_flatten(kt: KeyedTensor):
    return [kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())


def _kt_unflatten(values, context) -> KeyedTensor:
    keys, lengths, key_dim = context
    return KeyedTensor(keys, lengths, values[0], key_dim)


def _kt_flatten_spec(kt: KeyedTensor, spec) -> list[Tensor]:
    """The values in the spec's key order (an exported program's input whose keys come in
    another order)."""
    keys = spec.context[0]
    return [kt.values() if kt.keys() == keys else KeyedTensor.regroup([kt], [keys])[0]]


# each leaf's attribute, for the key paths torch.export names its inputs and outputs by
_JT_LEAVES = ("_values", "_weights", "_lengths", "_offsets")
_KJT_LEAVES = _JT_LEAVES + ("_inverse_indices",)


def _with_keys(flatten, names):
    """A flatten_with_keys_fn (torch.export needs one for every input and output class)."""
    def flatten_with_keys(t):
        leaves, context = flatten(t)
        return [(torch.utils._pytree.GetAttrKey(n), leaf) for n, leaf in zip(names, leaves)], context
    return flatten_with_keys


def register() -> None:
    """Register the four classes (once: embfuse.sparse does it on import)."""
    for cls, flatten, unflatten, names in ((JaggedTensor, _jt_flatten, _jt_unflatten, _JT_LEAVES),
                                           (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten, _KJT_LEAVES),
                                           (PaddedKeyedJaggedTensor, _kjt_flatten, _padded_unflatten, _KJT_LEAVES)):
        torch.utils._pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"embfuse.{cls.__name__}",
                                                 flatten_with_keys_fn=_with_keys(flatten, names))
        torch.fx._pytree.register_pytree_flatten_spec(cls, lambda t, spec, flatten=flatten: flatten(t)[0])
    torch.utils._pytree.register_pytree_node(KeyedTensor, _kt_flatten, _kt_unflatten,
                                             serialized_type_name="embfuse.KeyedTensor",
                                             flatten_with_keys_fn=_with_keys(_kt_flatten, ("_values",)))
    torch.fx._pytree.register_pytree_flatten_spec(KeyedTensor, _kt_flatten_spec)
