"""The translation hook ``to_device_tensor`` and the buffer helpers ``copyto_`` / ``copyfrom``."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import torchdi
from torchdi import copyfrom, copyto_, to_device_tensor

Pair = namedtuple("Pair", ["lr", "steps"])


# --------------------------------------------------------------------------- to_device_tensor


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_tensor_on_its_device_is_the_same_object(device):
    t = torch.arange(3.0)
    assert to_device_tensor(t, device) is t


def test_tensor_keeps_dtype_and_values():
    t = torch.tensor([1, 2], dtype=torch.int32)
    out = to_device_tensor(t, "cpu")
    assert out.dtype == torch.int32 and torch.equal(out, t)


def test_numpy_array_becomes_tensor():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    t = to_device_tensor(a, "cpu")
    assert isinstance(t, torch.Tensor)
    assert t.dtype == torch.float32 and t.shape == (2, 2) and t.device.type == "cpu"
    assert torch.equal(t, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert to_device_tensor(np.arange(3), None).dtype == torch.int64


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(np.float32(1.5), torch.float32), (np.float64(2.5), torch.float64), (np.int64(3), torch.int64)],
)
def test_numpy_scalar_becomes_0d_tensor(value, dtype):
    t = to_device_tensor(value, "cpu")
    assert isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == dtype
    assert t.item() == value


def test_python_float_becomes_0d_tensor():
    t = to_device_tensor(0.1, "cpu")
    assert isinstance(t, torch.Tensor)
    assert t.dim() == 0 and t.is_floating_point()
    assert t.dtype in (torch.float64, torch.get_default_dtype())
    assert t.item() == pytest.approx(0.1, rel=1e-7)
    assert to_device_tensor(-2.5, None).item() == -2.5


def test_python_complex_becomes_0d_complex_tensor():
    t = to_device_tensor(1 + 2j, None)
    assert isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_complex()
    assert t.item() == 1 + 2j


class Opaque:
    pass


@pytest.mark.parametrize("value", [3, True, False, "mean", None, Opaque(), (lambda: 1)], ids=["int", "True", "False", "str", "None", "object", "function"])
def test_static_values_are_unchanged(value):
    assert to_device_tensor(value, "cpu") is value


def test_containers_are_walked():
    tree = {
        "lr": 0.5,
        "steps": 3,
        "arr": np.ones(2),
        "nested": [torch.zeros(1), (2.0, "name"), None],
        "pair": Pair(0.25, 10),
    }
    out = to_device_tensor(tree, "cpu")
    assert type(out) is dict and list(out) == list(tree)
    assert isinstance(out["lr"], torch.Tensor) and out["lr"].item() == 0.5
    assert out["steps"] == 3 and type(out["steps"]) is int
    assert isinstance(out["arr"], torch.Tensor)
    assert type(out["nested"]) is list
    assert out["nested"][0] is tree["nested"][0]
    assert type(out["nested"][1]) is tuple
    assert isinstance(out["nested"][1][0], torch.Tensor) and out["nested"][1][1] == "name"
    assert out["nested"][2] is None
    assert type(out["pair"]) is Pair
    assert isinstance(out["pair"].lr, torch.Tensor) and out["pair"].steps == 10
    # the input is not modified
    assert tree["lr"] == 0.5 and isinstance(tree["arr"], np.ndarray)


def test_dict_subclass_keeps_its_type():
    out = to_device_tensor(OrderedDict(a=1.0, b=2), None)
    assert type(out) is OrderedDict and isinstance(out["a"], torch.Tensor) and out["b"] == 2


def test_user_registration():
    @dataclass
    class Interval:  # local: its registration cannot affect other tests
        low: float
        high: float

    iv = Interval(0.0, 1.0)
    assert to_device_tensor(iv, "cpu") is iv  # unknown objects are static until registered

    @torchdi.to_device_tensor.register(Interval)
    def _(obj, device):
        return torch.tensor([obj.low, obj.high], device=device)

    out = to_device_tensor(iv, "cpu")
    assert torch.equal(out, torch.tensor([0.0, 1.0]))
    walked = to_device_tensor({"bounds": [iv]}, "cpu")
    assert torch.equal(walked["bounds"][0], torch.tensor([0.0, 1.0]))


def test_to_device_tensor_is_singledispatch_and_exported():
    assert torchdi.to_device_tensor is to_device_tensor
    assert hasattr(to_device_tensor, "register") and hasattr(to_device_tensor, "registry")


# --------------------------------------------------------------------------- copyto_


def test_copyto_tensor_returns_dst_in_place():
    dst = torch.empty(2, 3)
    ptr = dst.data_ptr()
    src = torch.arange(6.0).reshape(2, 3)
    out = copyto_(dst, src)
    assert out is dst and dst.data_ptr() == ptr
    assert torch.equal(dst, src)
    src.add_(1)  # a copy, not a view
    assert not torch.equal(dst, src)


def test_copyto_pytree():
    dst = {"a": torch.zeros(2), "b": [torch.zeros(1, 2), torch.zeros(())]}
    leaves = [dst["a"], dst["b"][0], dst["b"][1]]
    src = {"a": torch.ones(2), "b": [torch.full((1, 2), 2.0), torch.tensor(3.0)]}
    out = copyto_(dst, src)
    assert out is dst
    assert dst["a"] is leaves[0] and dst["b"][0] is leaves[1] and dst["b"][1] is leaves[2]
    torch.testing.assert_close(dst, src)


def test_copyto_casts_dtype():
    dst = torch.zeros(3, dtype=torch.float32)
    copyto_(dst, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert dst.dtype == torch.float32 and torch.equal(dst, torch.tensor([1.0, 2.0, 3.0]))


def test_copyto_from_numpy_and_scalars():
    dst = {"arr": torch.zeros(2), "s": torch.zeros(())}
    copyto_(dst, {"arr": np.array([4.0, 5.0]), "s": 7.0})
    assert torch.equal(dst["arr"], torch.tensor([4.0, 5.0]))
    assert dst["s"].item() == 7.0


def test_copyto_static_leaves_must_agree():
    dst = {"t": torch.zeros(1), "n": 3}
    copyto_(dst, {"t": torch.ones(1), "n": 3})
    assert dst["t"].item() == 1.0
    with pytest.raises(ValueError, match="not a tensor"):
        copyto_(dst, {"t": torch.ones(1), "n": 4})


def test_copyto_shape_mismatch():
    with pytest.raises(ValueError, match=r"shape mismatch.*\(2,\).*\(3,\)"):
        copyto_(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="shape mismatch"):
        copyto_({"a": torch.zeros(2, 2)}, {"a": torch.zeros(4)})


def test_copyto_structure_mismatch():
    with pytest.raises(ValueError, match="structure mismatch"):
        copyto_({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="structure mismatch"):
        copyto_([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
    with pytest.raises(ValueError, match="structure mismatch"):
        copyto_(torch.zeros(2), {"a": torch.zeros(2)})


def test_copyto_failure_leaves_dst_untouched_for_structure_errors():
    dst = {"a": torch.zeros(2)}
    with pytest.raises(ValueError):
        copyto_(dst, {"a": torch.ones(2), "b": torch.ones(2)})
    assert torch.equal(dst["a"], torch.zeros(2))


# --------------------------------------------------------------------------- copyfrom


def test_copyfrom_to_host():
    src = {"g": torch.arange(3.0), "n": 2}
    out = copyfrom(src)
    assert type(out) is dict and out["n"] == 2
    assert out["g"].device.type == "cpu" and torch.equal(out["g"], src["g"])


def test_copyfrom_into_out():
    src = (torch.ones(2), {"h": torch.full((2, 2), 3.0)})
    out = (torch.empty(2), {"h": torch.empty(2, 2)})
    leaves = (out[0], out[1]["h"])
    returned = copyfrom(src, out=out)
    assert returned is out and out[0] is leaves[0] and out[1]["h"] is leaves[1]
    torch.testing.assert_close(out, src)


def test_copyfrom_into_wrong_out():
    with pytest.raises(ValueError, match="shape mismatch"):
        copyfrom(torch.ones(2), out=torch.empty(3))


def test_helpers_are_exported():
    assert torchdi.copyto_ is copyto_ and torchdi.copyfrom is copyfrom
    for name in ("to_device_tensor", "copyto_", "copyfrom"):
        assert name in torchdi.__all__
