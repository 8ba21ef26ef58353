import pytest
import torch

from embfuse import KeyedTensor


def test_keyed_tensor_regroup_and_from_tensor_list():
    """TorchRec's KeyedTensor.regroup / regroup_as_dict / from_tensor_list."""
    a = KeyedTensor.from_tensor_list(["x", "y"], [torch.rand(4, 2), torch.rand(4, 3)])
    b = KeyedTensor(["z"], [1], torch.rand(4, 1))
    assert a.length_per_key() == [2, 3] and a.values().shape == (4, 5)
    g1, g2 = KeyedTensor.regroup([a, b], [["z", "x"], ["y"]])
    assert torch.equal(g1, torch.cat([b["z"], a["x"]], 1)) and torch.equal(g2, a["y"])
    d = KeyedTensor.regroup_as_dict([a, b], [["y", "z"]], ["yz"])
    assert list(d) == ["yz"] and torch.equal(d["yz"], torch.cat([a["y"], b["z"]], 1))
    with pytest.raises(KeyError, match="no KeyedTensor holds key 'w'"):
        KeyedTensor.regroup([a], [["w"]])
    assert a._key_indices() == {"x": 0, "y": 1}  # what TorchRec's own regroup functions read
