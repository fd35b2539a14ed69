"""Every error path of the core: wrong outputs, wrong arguments, unsupported pairs, mismatched preps."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

import torchdi
from torchdi import (
    AutoAutograd,
    AutoFiniteDiff,
    AutoFunc,
    AutoXLA,
    BackendUnavailableError,
    Cache,
    Constant,
    PreparationMismatchError,
    SecondOrder,
    UnsupportedOperatorError,
)

EAGER = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "fd": AutoFiniteDiff(),
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
}
EAGER_IDS = list(EAGER)
EAGER_VALUES = list(EAGER.values())


def vector_valued(x, *contexts):
    return x * 2


def scalar_valued(x, *contexts):
    return (x**2).sum()


# --------------------------------------------------------------------------- error classes


def test_error_classes_and_exports():
    assert issubclass(PreparationMismatchError, ValueError)
    assert issubclass(BackendUnavailableError, RuntimeError)
    assert issubclass(UnsupportedOperatorError, NotImplementedError)
    for name in ("PreparationMismatchError", "BackendUnavailableError", "UnsupportedOperatorError"):
        assert name in torchdi.__all__
        assert getattr(torchdi, name) is not None


@pytest.mark.parametrize(
    "backend",
    [*EAGER_VALUES, AutoFunc(chunk_size=3), AutoFiniteDiff(method="forward"), SecondOrder(AutoAutograd(), AutoFunc())],
)
def test_check_available_is_true_for_eager_backends(backend):
    assert torchdi.check_available(backend) is True


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_unavailable_backend_raises_backend_unavailable_error():
    assert torchdi.check_available(AutoXLA()) is False
    with pytest.raises(BackendUnavailableError, match="torch_xla"):
        torchdi.gradient(scalar_valued, AutoXLA(), torch.ones(2))
    with pytest.raises(BackendUnavailableError, match="torch_xla"):
        torchdi.prepare_hessian(scalar_valued, SecondOrder(AutoXLA(), AutoFunc()), torch.ones(2))


def test_check_available_rejects_non_backends():
    with pytest.raises(TypeError, match="torchdi backend"):
        torchdi.check_available("autograd")


def test_backend_settings_are_validated():
    with pytest.raises(ValueError, match="chunk_size"):
        AutoFunc(chunk_size=0)
    with pytest.raises(ValueError, match="method"):
        AutoFiniteDiff(method="sideways")
    with pytest.raises(ValueError, match="step"):
        AutoFiniteDiff(step=-1.0)
    with pytest.raises(TypeError, match="outer"):
        SecondOrder("func", AutoFunc())
    # frozen and hashable: usable as dict keys, equal by settings
    assert hash(AutoFunc(chunk_size=2)) == hash(AutoFunc(chunk_size=2))
    assert {AutoFunc(): 1}[AutoFunc()] == 1
    with pytest.raises(AttributeError):
        AutoFunc().chunk_size = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- scalar outputs


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize(
    "call",
    [
        lambda b, x: torchdi.gradient(vector_valued, b, x),
        lambda b, x: torchdi.value_and_gradient(vector_valued, b, x),
        lambda b, x: torchdi.prepare_gradient(vector_valued, b, x),
        lambda b, x: torchdi.hvp(vector_valued, b, x, (x,)),
        lambda b, x: torchdi.gradient_and_hvp(vector_valued, b, x, (x,)),
        lambda b, x: torchdi.prepare_hvp(vector_valued, b, x, (x,)),
    ],
    ids=["gradient", "value_and_gradient", "prepare_gradient", "hvp", "gradient_and_hvp", "prepare_hvp"],
)
def test_non_scalar_output_is_a_value_error_naming_the_shape(backend, call):
    with pytest.raises(ValueError, match=re.escape("(3, 2)")) as info:
        call(backend, torch.ones(3, 2))
    assert "scalar" in str(info.value)
    assert not isinstance(info.value, PreparationMismatchError)


def test_one_element_non_scalar_output_is_accepted():
    g = torchdi.gradient(lambda x: (x**2).sum().reshape(1, 1), AutoFunc(), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(g, torch.tensor([2.0, 4.0]))


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_f_must_return_floating_tensors(backend):
    with pytest.raises(TypeError, match="tensor"):
        torchdi.gradient(lambda x: float(x.sum()), backend, torch.ones(2))
    with pytest.raises(TypeError, match="floating"):
        torchdi.jacobian(lambda x: (x > 0).long(), backend, torch.ones(2))
    with pytest.raises(TypeError, match="single tensor"):
        torchdi.derivative(lambda x: {"y": x}, backend, 1.0)


# --------------------------------------------------------------------------- unsupported pairs


@pytest.mark.parametrize(
    "call",
    [
        lambda b: torchdi.hvp(scalar_valued, b, torch.ones(2), (torch.ones(2),)),
        lambda b: torchdi.prepare_hvp(scalar_valued, b, torch.ones(2), (torch.ones(2),)),
        lambda b: torchdi.gradient_and_hvp(scalar_valued, b, torch.ones(2), (torch.ones(2),)),
        lambda b: torchdi.hessian(scalar_valued, b, torch.ones(2)),
        lambda b: torchdi.value_gradient_and_hessian(scalar_valued, b, torch.ones(2)),
        lambda b: torchdi.second_derivative(lambda t: t**3, b, torch.tensor(1.0)),
    ],
    ids=["hvp", "prepare_hvp", "gradient_and_hvp", "hessian", "value_gradient_and_hessian", "second_derivative"],
)
def test_func_over_autograd_is_unsupported_and_names_alternatives(call):
    with pytest.raises(UnsupportedOperatorError) as info:
        call(SecondOrder(AutoFunc(), AutoAutograd()))
    message = str(info.value)
    assert "SecondOrder(AutoFunc(), AutoFunc())" in message
    assert "Backends that can" in message


def test_ad_over_finite_differences_is_unsupported():
    with pytest.raises(UnsupportedOperatorError, match="Backends that can"):
        torchdi.hvp(scalar_valued, SecondOrder(AutoFunc(), AutoFiniteDiff()), torch.ones(2), (torch.ones(2),))


def test_unsupported_second_order_still_serves_first_order_operators():
    backend = SecondOrder(AutoFunc(), AutoAutograd())
    g = torchdi.gradient(scalar_valued, backend, torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(g, torch.tensor([2.0, 6.0]))


# --------------------------------------------------------------------------- contexts


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize("bad", [torch.ones(2), 3.0, None], ids=["tensor", "float", "none"])
def test_unwrapped_context_is_a_type_error(backend, bad):
    x = torch.ones(2)
    calls = [
        lambda: torchdi.gradient(scalar_valued, backend, x, bad),
        lambda: torchdi.prepare_jacobian(vector_valued, backend, x, Constant(1.0), bad),
        lambda: torchdi.pushforward(vector_valued, backend, x, (x,), bad),
        lambda: torchdi.pullback(vector_valued, backend, x, (x,), Cache(torch.ones(2)), bad),
    ]
    for call in calls:
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "torchdi.Constant(...)" in message and "torchdi.Cache(...)" in message
        assert type(bad).__name__ in message


def test_unwrapped_context_error_names_position_with_prep():
    x = torch.ones(2)
    prep = torchdi.prepare_gradient(scalar_valued, AutoFunc(), x, Constant(1.0))
    with pytest.raises(TypeError, match=r"context 1 \(argument 4\)"):  # counted from 1, as in mismatch messages
        torchdi.gradient(scalar_valued, AutoFunc(), x, 1.0, prep=prep)


def test_base_context_class_is_not_a_context():
    from torchdi.contexts import Context

    with pytest.raises(TypeError, match="Constant"):
        torchdi.gradient(scalar_valued, AutoFunc(), torch.ones(2), Context(1.0))


# --------------------------------------------------------------------------- tangents


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize(
    ("fn", "f"),
    [
        (torchdi.pushforward, vector_valued),
        (torchdi.value_and_pushforward, vector_valued),
        (torchdi.prepare_pushforward, vector_valued),
        (torchdi.pullback, vector_valued),
        (torchdi.value_and_pullback, vector_valued),
        (torchdi.prepare_pullback, vector_valued),
        (torchdi.hvp, scalar_valued),
        (torchdi.gradient_and_hvp, scalar_valued),
        (torchdi.prepare_hvp, scalar_valued),
    ],
    ids=lambda v: getattr(v, "__name__", "f"),
)
def test_bad_tangents(backend, fn, f):
    x = torch.ones(3)
    with pytest.raises(TypeError, match="tuple"):
        fn(f, backend, x, torch.ones(3))  # a bare tensor
    with pytest.raises(TypeError, match="tuple"):
        fn(f, backend, x, [torch.ones(3)])  # a list
    with pytest.raises(ValueError, match="at least one"):
        fn(f, backend, x, ())
    with pytest.raises(ValueError, match=re.escape("(4,)")):
        fn(f, backend, x, (torch.ones(3), torch.ones(4)))
    with pytest.raises(ValueError, match="float64"):
        fn(f, backend, x, (torch.ones(3, dtype=torch.float64),))
    with pytest.raises(TypeError, match="tensors"):
        fn(f, backend, x, (1.0,))


def test_pytree_tangent_must_match_structure():
    x = {"a": torch.ones(2), "b": torch.ones(3)}
    with pytest.raises(ValueError, match="structure"):
        torchdi.pushforward(lambda d: d["a"].sum() * d["b"], AutoFunc(), x, ({"a": torch.ones(2)},))


def test_operators_without_tangents_refuse_them():
    from torchdi.operators._core import prepare_operator

    with pytest.raises(TypeError, match="takes no tangents"):
        prepare_operator("gradient", "gradient", scalar_valued, AutoFunc(), torch.ones(2), (torch.ones(2),), (), True)


# --------------------------------------------------------------------------- x


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_x_is_a_type_error(backend, dtype):
    x = torch.ones(3, dtype=dtype)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        torchdi.gradient(lambda v: v.float().sum(), backend, x)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        torchdi.jacobian(lambda v: v.float(), backend, x)
    with pytest.raises(TypeError, match="floating-point"):
        torchdi.gradient(lambda d: d["a"].float().sum(), backend, {"a": x})


def test_x_must_hold_tensors():
    with pytest.raises(TypeError, match="str"):
        torchdi.gradient(lambda d: d["a"].sum(), AutoFunc(), {"a": torch.ones(2), "b": "text"})
    with pytest.raises(ValueError, match="at least one tensor"):
        torchdi.gradient(lambda d: torch.zeros(()), AutoFunc(), {})


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize(
    "fn",
    [
        torchdi.derivative,
        torchdi.value_and_derivative,
        torchdi.prepare_derivative,
        torchdi.second_derivative,
        torchdi.value_derivative_and_second_derivative,
        torchdi.prepare_second_derivative,
    ],
)
def test_derivative_needs_scalar_x(backend, fn):
    with pytest.raises(ValueError, match=re.escape("(2,)")):
        fn(lambda t: t * 2, backend, torch.ones(2))
    with pytest.raises(TypeError, match="real Python number"):
        fn(lambda t: t * 2, backend, 1 + 2j)
    with pytest.raises(TypeError, match="real Python number"):
        fn(lambda t: t * 2, backend, True)
    with pytest.raises(TypeError, match="real Python number"):
        fn(lambda t: t["a"] * 2, backend, {"a": torch.ones(())})


def test_f_must_be_callable_and_backend_must_be_a_backend():
    with pytest.raises(TypeError, match="callable"):
        torchdi.gradient("not callable", AutoFunc(), torch.ones(2))
    with pytest.raises(TypeError, match="backend"):
        torchdi.gradient(scalar_valued, "func", torch.ones(2))
    with pytest.raises(TypeError, match="Prep"):
        torchdi.gradient(scalar_valued, AutoFunc(), torch.ones(2), prep="prep")


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("gradient", lambda b, out: torchdi.gradient(scalar_valued, b, torch.ones(3), out=out)),
        ("value_and_gradient", lambda b, out: torchdi.value_and_gradient(scalar_valued, b, torch.ones(3), out=out)),
        ("jacobian", lambda b, out: torchdi.jacobian(vector_valued, b, torch.ones(3), out=out)),
        ("value_and_jacobian", lambda b, out: torchdi.value_and_jacobian(vector_valued, b, torch.ones(3), out=out)),
        ("hessian", lambda b, out: torchdi.hessian(scalar_valued, b, torch.ones(3), out=out)),
        (
            "value_gradient_and_hessian",
            lambda b, out: torchdi.value_gradient_and_hessian(scalar_valued, b, torch.ones(3), out=out),
        ),
        ("derivative", lambda b, out: torchdi.derivative(vector_valued, b, torch.ones(()), out=out.reshape(-1)[:2])),
        (
            "value_and_derivative",
            lambda b, out: torchdi.value_and_derivative(vector_valued, b, torch.ones(()), out=out.reshape(-1)[:2]),
        ),
        ("second_derivative", lambda b, out: torchdi.second_derivative(vector_valued, b, torch.ones(()), out=out.reshape(-1)[:2])),
        (
            "value_derivative_and_second_derivative",
            lambda b, out: torchdi.value_derivative_and_second_derivative(
                vector_valued, b, torch.ones(()), out=out.reshape(-1)[:2]
            ),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_out_with_wrong_shape_is_a_value_error_naming_out(backend, name, call):
    out = torch.empty(5, 7)
    with pytest.raises(ValueError, match="out=") as info:
        call(backend, out)
    assert name in str(info.value)


def test_out_with_wrong_structure_is_a_value_error():
    x = {"a": torch.ones(2), "b": torch.ones(3)}
    with pytest.raises(ValueError, match="out="):
        torchdi.gradient(lambda d: d["a"].sum() + d["b"].sum(), AutoFunc(), x, out={"a": torch.empty(2)})
    with pytest.raises(ValueError, match="out="):
        torchdi.gradient(lambda d: d["a"].sum() + d["b"].sum(), AutoFunc(), x, out=torch.empty(5))


# --------------------------------------------------------------------------- PreparationMismatchError


def f_ctx(x, c, buf):
    buf.copy_(x["a"])
    return (buf**2).sum() * c.sum() + x["b"].sum()


def _dict_x(n=2, dtype=torch.float32, key="b"):
    return {"a": torch.ones(n, dtype=dtype), key: torch.ones(3, dtype=dtype)}


def _mismatch_lines(call) -> dict[str, str]:
    with pytest.raises(PreparationMismatchError) as info:
        call()
    lines = str(info.value).splitlines()
    assert "cannot serve this call" in lines[0]
    out = {}
    for line in lines[1:]:
        name, _, status = line.strip().partition(": ")
        out.setdefault(name, status)
    return out


@pytest.fixture
def gradient_prep():
    return torchdi.prepare_gradient(f_ctx, AutoFunc(), _dict_x(), Constant(torch.ones(3)), Cache(torch.ones(2)))


def _call_gradient(prep, x=None, contexts=None, f=f_ctx, backend=None):
    x = _dict_x() if x is None else x
    contexts = (Constant(torch.ones(3)), Cache(torch.ones(2))) if contexts is None else contexts
    return lambda: torchdi.gradient(f, backend or AutoFunc(), x, *contexts, prep=prep)


def test_matching_call_passes(gradient_prep):
    x = {"a": torch.tensor([1.0, -2.0]), "b": torch.zeros(3)}
    g = torchdi.gradient(f_ctx, AutoFunc(), x, Constant(torch.full((3,), 0.5)), Cache(torch.zeros(2)), prep=gradient_prep)
    torch.testing.assert_close(g["a"], 3.0 * x["a"])  # 2 * a * sum(c) with sum(c) = 1.5


def test_mismatch_shape(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, x=_dict_x(n=5)))
    assert lines["x"].startswith("mismatch")
    assert "shape=(2,)" in lines["x"] and "shape=(5,)" in lines["x"]
    assert "dim 0: 2 -> 5" in lines["x"]
    assert lines["context 1"] == "ok" and lines["context 2"] == "ok"
    assert lines["operator"] == lines["f"] == lines["backend"] == "ok"


def test_mismatch_dtype(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, x=_dict_x(dtype=torch.float64)))
    assert "torch.float32" in lines["x"] and "torch.float64" in lines["x"]


def test_mismatch_dict_key(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, x=_dict_x(key="c")))
    assert lines["x"].startswith("mismatch") and "'b'" in lines["x"] and "'c'" in lines["x"]


def test_mismatch_context_type(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, contexts=(Cache(torch.ones(3)), Cache(torch.ones(2)))))
    assert lines["x"] == "ok"
    assert lines["context 1"].startswith("mismatch")
    assert "expected Constant(" in lines["context 1"] and "received Cache(" in lines["context 1"]
    assert lines["context 2"] == "ok"


def test_mismatch_context_shape(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, contexts=(Constant(torch.ones(4)), Cache(torch.ones(2)))))
    assert "shape=(3,)" in lines["context 1"] and "shape=(4,)" in lines["context 1"]


def test_mismatch_fewer_contexts(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, contexts=(Constant(torch.ones(3)),)))
    assert lines["arguments"].startswith("mismatch") and "received 2" in lines["arguments"]
    assert lines["context 1"] == "ok"
    assert "received nothing" in lines["context 2"]


def test_mismatch_more_contexts(gradient_prep):
    contexts = (Constant(torch.ones(3)), Cache(torch.ones(2)), Constant(1.0))
    with pytest.raises(PreparationMismatchError) as info:
        _call_gradient(gradient_prep, contexts=contexts)()
    message = str(info.value)
    assert "received 4" in message
    assert "context 3: mismatch: not present at preparation" in message


def test_mismatch_different_f(gradient_prep):
    def other(x, c, buf):
        return f_ctx(x, c, buf)

    lines = _mismatch_lines(_call_gradient(gradient_prep, f=other))
    assert lines["f"].startswith("mismatch") and "prepare again" in lines["f"]
    assert lines["x"] == "ok"


def test_mismatch_different_backend(gradient_prep):
    lines = _mismatch_lines(_call_gradient(gradient_prep, backend=AutoFunc(chunk_size=4)))
    assert lines["backend"].startswith("mismatch")
    assert "AutoFunc(chunk_size=None, mode=None)" in lines["backend"] and "AutoFunc(chunk_size=4, mode=None)" in lines["backend"]


def test_mismatch_different_operator():
    x = torch.ones(3)
    prep = torchdi.prepare_gradient(scalar_valued, AutoFunc(), x)
    lines = _mismatch_lines(lambda: torchdi.jacobian(scalar_valued, AutoFunc(), x, prep=prep))
    assert lines["operator"] == "mismatch: expected 'gradient', received 'jacobian'"
    assert lines["x"] == "ok"


def test_mismatch_tangents():
    x = torch.ones(3)
    prep = torchdi.prepare_pushforward(vector_valued, AutoFunc(), x, (x, x), Constant(2.0))
    lines = _mismatch_lines(lambda: torchdi.pushforward(vector_valued, AutoFunc(), x, (x,), Constant(2.0), prep=prep))
    assert lines["x"] == "ok" and lines["tx"].startswith("mismatch") and lines["context 1"] == "ok"
    prep = torchdi.prepare_pullback(vector_valued, AutoFunc(), x, (x,))
    lines = _mismatch_lines(lambda: torchdi.pullback(vector_valued, AutoFunc(), x, (torch.ones(3, 1),), prep=prep))
    assert lines["ty"].startswith("mismatch") and "(3, 1)" in lines["ty"]


def test_mismatch_constant_kind_float_vs_tensor():
    x = torch.ones(3)
    prep = torchdi.prepare_gradient(scalar_valued, AutoFunc(), x, Constant(1.0))
    lines = _mismatch_lines(lambda: torchdi.gradient(scalar_valued, AutoFunc(), x, Constant(torch.tensor(1.0)), prep=prep))
    assert "float" in lines["context 1"] and "Tensor" in lines["context 1"]


def test_value_variant_shares_prep_and_changed_values_pass():
    x = torch.ones(3)
    prep = torchdi.prepare_gradient(scalar_valued, AutoAutograd(), x, Constant(1.0))
    y, g = torchdi.value_and_gradient(scalar_valued, AutoAutograd(), 2 * x, Constant(5.0), prep=prep)
    torch.testing.assert_close(y, torch.tensor(12.0))
    torch.testing.assert_close(g, 4 * x)


@pytest.mark.parametrize("backend", [AutoAutograd(), AutoFunc()], ids=["autograd", "func"])
def test_strict_false_skips_the_check(backend):
    prep = torchdi.prepare_gradient(scalar_valued, backend, torch.ones(2), strict=False)
    assert prep.strict is False
    x = torch.arange(5.0)
    g = torchdi.gradient(scalar_valued, backend, x, prep=prep)  # other shape: prepared again for it
    torch.testing.assert_close(g, 2 * x)
    strict = torchdi.prepare_gradient(scalar_valued, backend, torch.ones(2))
    with pytest.raises(PreparationMismatchError):
        torchdi.gradient(scalar_valued, backend, x, prep=strict)
