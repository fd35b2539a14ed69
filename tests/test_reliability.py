"""Issue 10, the reliability pass: one test per item, on every backend the item concerns.

No silent zeros, no unsafe casts, no raw torch errors. Compiled coverage uses
``AutoCompile(compiler="aot_eager")``: what is tested is torchdi's handling, not inductor.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import subprocess
import sys
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import pytest
import torch

import torchdi as td
from torchdi import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    Constant,
    PreparationMismatchError,
    SecondOrder,
    UnsupportedOperatorError,
)

COMPILED = AutoCompile(compiler="aot_eager")
BACKENDS = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "finitediff": AutoFiniteDiff(),
    "compile": COMPILED,
}
EXACT = {"autograd", "func", "compile"}  # AD backends: exact up to rounding
ALL = pytest.mark.parametrize("name", list(BACKENDS))
AD = pytest.mark.parametrize("name", sorted(EXACT))


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if name in EXACT else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, want, **tolerance)


def cubic(x: torch.Tensor) -> torch.Tensor:
    return (x**3).sum()


# --- item 1: inference_mode / no_grad around an operator ----------------------------------------


@ALL
@pytest.mark.parametrize("outer", ["inference_mode", "no_grad"])
def test_item01_derivatives_inside_inference_mode_and_no_grad(name: str, outer: str) -> None:
    backend = BACKENDS[name]
    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    tx = (torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),)
    grad_prep = td.prepare_gradient(cubic, backend, x)
    context = torch.inference_mode() if outer == "inference_mode" else torch.no_grad()
    with context:
        prepared = td.gradient(cubic, backend, x, prep=grad_prep)
        one_shot = td.gradient(cubic, backend, x)
        (hv,) = td.hvp(cubic, backend, x, tx)
        (jv,) = td.pushforward(lambda x: x**3, backend, x, tx)
        prepared_inside = td.prepare_gradient(cubic, backend, x)
        from_inside = td.gradient(cubic, backend, x, prep=prepared_inside)
    want = 3 * x**2
    for got in (prepared, one_shot, from_inside):
        _close(name, got, want)
    _close(name, hv, 6 * x * tx[0])
    _close(name, jv, 3 * x**2 * tx[0])


# --- item 2: out= follows PyTorch's casting and device rule ---------------------------------------


@pytest.mark.parametrize("name", ["autograd", "compile"])
@pytest.mark.parametrize("out_dtype", [torch.long, torch.bool, torch.int32])
def test_item02_unsafe_out_dtype_raises_naming_both_dtypes(name: str, out_dtype: torch.dtype) -> None:
    backend = BACKENDS[name]
    x = torch.tensor([1.4, 3.4, 5.4])
    out = torch.zeros(3, dtype=out_dtype)
    with pytest.raises(RuntimeError, match=rf"dtype torch.float32.*out= dtype {out_dtype}"):
        td.gradient(lambda x: (x**2).sum() / 2, backend, x, out=out)
    assert not out.any()  # nothing written


@pytest.mark.parametrize("name", ["autograd", "compile"])
def test_item02_complex_result_into_real_out_and_wrong_device_raise(name: str) -> None:
    backend = BACKENDS[name]
    z = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=r"complex64.*out= dtype torch.float32"):
        td.gradient(lambda z: (z * z.conj()).real.sum(), backend, z, out=torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"device cpu but out= is on device meta"):
        td.gradient(cubic, backend, torch.ones(2), out=torch.empty(2, device="meta"))
    # Safe casts (same kind, as PyTorch allows) still work.
    out = torch.zeros(2, dtype=torch.float64)
    assert td.gradient(cubic, backend, torch.ones(2), out=out) is out
    torch.testing.assert_close(out, torch.full((2,), 3.0, dtype=torch.float64))


# --- item 3: complex inputs, PyTorch's conjugate Wirtinger convention -----------------------------

Z = torch.tensor([1 + 1j, 2 - 1j, -0.5 + 0.3j], dtype=torch.complex128)


@ALL
def test_item03_complex_holomorphic_and_not(name: str) -> None:
    backend = BACKENDS[name]
    z = Z
    n = z.numel()
    # Holomorphic: the jacobian is f'(z), square or tall; pushforward f' dz; pullback conj(f') v.
    square = td.jacobian(lambda z: z * z, backend, z)
    _close(name, square, torch.diag(2 * z))
    tall = td.jacobian(lambda z: torch.cat([z * z, torch.sin(z)]), backend, z)
    _close(name, tall, torch.cat([torch.diag(2 * z), torch.diag(torch.cos(z))]))
    dz = torch.tensor([1.0, 1j, 1 - 2j], dtype=torch.complex128)
    (jv,) = td.pushforward(lambda z: z * z, backend, z, (dz,))
    _close(name, jv, 2 * z * dz)
    (vj,) = td.pullback(lambda z: z * z, backend, z, (dz,))
    _close(name, vj, (2 * z).conj() * dz)
    # Non-holomorphic, real-valued: the gradient is dL/dRe z + i dL/dIm z (2z for |z|^2).
    _close(name, td.gradient(lambda z: (z * z.conj()).real.sum(), backend, z), 2 * z)
    _close(name, td.gradient(lambda z: (z * z.conj()).real.sum(), backend, torch.tensor([1 + 1j], dtype=torch.complex128)),
           torch.tensor([2 + 2j], dtype=torch.complex128))
    (hv,) = td.hvp(lambda z: (z * z.conj()).real.sum(), backend, z, (dz,))
    _close(name, hv, 2 * dz)
    # Non-holomorphic, complex-valued: every backend agrees with the reference, and the
    # jacobian's columns are the pushforwards of the real basis.
    def g(z: torch.Tensor) -> torch.Tensor:
        return z * z.conj() ** 2 + torch.sin(z.conj())

    reference = AutoAutograd()
    (jv,) = td.pushforward(g, backend, z, (dz,))
    _close(name, jv, td.pushforward(g, reference, z, (dz,))[0])
    (vj,) = td.pullback(g, backend, z, (dz,))
    _close(name, vj, td.pullback(g, reference, z, (dz,))[0])
    jac = td.jacobian(g, backend, z)
    basis = torch.eye(n, dtype=torch.complex128)
    columns = torch.stack([td.pushforward(g, reference, z, (basis[j],))[0] for j in range(n)], dim=1)
    _close(name, jac, columns)


def test_item03_reference_pushforward_matches_a_finite_difference_for_non_holomorphic_f() -> None:
    # The reference's forward mode is double backward; check it against the plain definition.
    def g(z: torch.Tensor) -> torch.Tensor:
        return z * z.conj() ** 2

    dz = torch.tensor([1.0, 1j, 1 - 2j], dtype=torch.complex128)
    (jv,) = td.pushforward(g, AutoAutograd(), Z, (dz,))
    h = 1e-6
    torch.testing.assert_close(jv, (g(Z + h * dz) - g(Z - h * dz)) / (2 * h), rtol=1e-6, atol=1e-6)


# --- item 4: finite differences step per coordinate -----------------------------------------------


@pytest.mark.parametrize("method", ["central", "forward", "backward"])
def test_item04_finite_difference_step_is_relative_to_each_coordinate(method: str) -> None:
    backend = AutoFiniteDiff(method=method)
    x = torch.tensor([1e6, 0.01], dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x[0] / 1e6) ** 2 + torch.sin(x[1])

    want = torch.tensor([2e-6, math.cos(0.01)], dtype=torch.float64)
    torch.testing.assert_close(td.gradient(f, backend, x), want, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(td.jacobian(lambda x: f(x).reshape(1), backend, x)[0], want, rtol=1e-5, atol=1e-10)


# --- item 5: strict=False still checks the operator family and f ----------------------------------


@pytest.mark.parametrize("name", ["autograd", "func", "compile"])
def test_item05_strict_false_prep_checks_operator_and_function(name: str) -> None:
    backend = BACKENDS[name]
    x = torch.ones(2)
    prep = td.prepare_gradient(cubic, backend, x, strict=False)
    with pytest.raises(PreparationMismatchError, match=r"operator: mismatch: expected 'gradient', received 'hvp'"):
        td.hvp(cubic, backend, x, (torch.ones(2),), prep=prep)
    with pytest.raises(PreparationMismatchError, match=r"f: mismatch"):
        td.gradient(lambda x: x.sum(), backend, x, prep=prep)
    with pytest.raises(PreparationMismatchError, match=r"backend: mismatch"):
        td.gradient(cubic, AutoFiniteDiff(), x, prep=prep)
    # What strict=False skips: the argument signatures (new values, same signature, run as usual).
    torch.testing.assert_close(td.gradient(cubic, backend, torch.full((2,), 2.0), prep=prep), torch.full((2,), 12.0))


# --- item 6: containers and static objects in the strict check ------------------------------------


@dataclasses.dataclass
class Weights:
    a: torch.Tensor
    b: torch.Tensor


@pytest.mark.parametrize("name", ["autograd", "func", "compile"])
def test_item06_dataclass_ordereddict_and_state_dict_arguments(name: str) -> None:
    backend = BACKENDS[name]

    def with_dataclass(x: torch.Tensor, w: Weights) -> torch.Tensor:
        return (x * w.a + w.b).sum()

    x = torch.ones(2)
    prep = td.prepare_gradient(with_dataclass, backend, x, Constant(Weights(torch.ones(2), torch.ones(2))))
    gc.collect()  # the preparation-time object is gone: later calls must still be served
    for scale in (2.0, 3.0):
        w = Weights(torch.full((2,), scale), torch.zeros(2))
        torch.testing.assert_close(td.gradient(with_dataclass, backend, x, Constant(w), prep=prep), torch.full((2,), scale))

    def with_ordered(x: torch.Tensor, d: OrderedDict) -> torch.Tensor:
        return (x * d["a"]).sum()

    prep = td.prepare_gradient(with_ordered, backend, x, Constant(OrderedDict(a=torch.ones(2))))
    got = td.gradient(with_ordered, backend, x, Constant(OrderedDict(a=torch.full((2,), 4.0))), prep=prep)
    torch.testing.assert_close(got, torch.full((2,), 4.0))
    with pytest.raises(PreparationMismatchError, match=r"context 1: mismatch.*OrderedDict.*shape=\(2,\).*shape=\(3,\)"):
        td.gradient(with_ordered, backend, x, Constant(OrderedDict(a=torch.ones(3))), prep=prep)

    model = torch.nn.Linear(3, 2)
    state = model.state_dict()  # an OrderedDict of tensors as x

    def loss(p: OrderedDict) -> torch.Tensor:
        return (p["weight"] ** 2).sum() + p["bias"].sum()

    prep = td.prepare_gradient(loss, backend, state)
    grads = td.gradient(loss, backend, state, prep=prep)
    assert isinstance(grads, OrderedDict) and list(grads) == ["weight", "bias"]
    torch.testing.assert_close(grads["weight"], 2 * state["weight"])
    smaller = OrderedDict(weight=torch.ones(2, 2), bias=torch.ones(2))
    with pytest.raises(PreparationMismatchError, match=r"x: mismatch.*'weight'"):
        td.gradient(loss, backend, smaller, prep=prep)


class Traced(NamedTuple):
    value: torch.Tensor


def test_item06_registered_type_is_traced_and_checked_by_its_translation() -> None:
    class Scale:  # a user type: its tensor is traced once registered with to_device_tensor
        def __init__(self, value: torch.Tensor) -> None:
            self.value = value

    @td.to_device_tensor.register(Scale)
    def _(obj: Scale, device: object) -> Traced:
        return Traced(td.to_device_tensor(obj.value, device))

    f = lambda x, s: (x * s.value).sum()  # noqa: E731
    prep = td.prepare_gradient(f, COMPILED, torch.ones(2), Constant(Scale(torch.ones(2))))
    td.gradient(f, COMPILED, torch.ones(2), Constant(Scale(torch.ones(2))), prep=prep)
    compilations = prep.num_compilations  # after the plain variant's compilation on first use
    got = td.gradient(f, COMPILED, torch.ones(2), Constant(Scale(torch.full((2,), 5.0))), prep=prep)
    torch.testing.assert_close(got, torch.full((2,), 5.0))
    assert prep.num_compilations == compilations
    with pytest.raises(PreparationMismatchError, match=r"Scale\(translated to Traced\(Tensor\(shape=\(2,\).*shape=\(3,\)"):
        td.gradient(f, COMPILED, torch.ones(2), Constant(Scale(torch.ones(3))), prep=prep)


# --- item 7: tensors created under inference_mode -------------------------------------------------


@ALL
def test_item07_inference_tensors_as_x_and_in_constants(name: str) -> None:
    backend = BACKENDS[name]
    with torch.inference_mode():
        x = torch.tensor([1.0, 2.0])
        c = torch.tensor([3.0, 4.0])
    assert x.is_inference() and c.is_inference()
    f = lambda x, c: (c * x**2).sum()  # noqa: E731
    prep = td.prepare_gradient(f, backend, x, Constant(c))
    _close(name, td.gradient(f, backend, x, Constant(c), prep=prep), 2 * c * x)
    _close(name, td.gradient(f, backend, x, Constant(c)), 2 * c * x)
    (hv,) = td.hvp(f, backend, x, (torch.ones(2),), Constant(c))
    _close(name, hv, 2 * c)
    assert x.is_inference() and torch.equal(x, torch.tensor([1.0, 2.0]))  # inputs untouched


# --- item 8: pairs torch.compile cannot compose are refused at preparation ------------------------

COMPILED_AUTOGRAD = AutoCompile(inner=AutoAutograd(), fullgraph=False, compiler="aot_eager")


@pytest.mark.parametrize("operator", ["pushforward", "hvp", "hessian", "second_derivative", "jacobian"])
def test_item08_compiled_autograd_refuses_double_backward_naming_what_works(operator: str) -> None:
    x = torch.ones(2)
    calls = {
        "pushforward": lambda b: td.prepare_pushforward(lambda x: x**2, b, x, (x,)),
        "hvp": lambda b: td.prepare_hvp(cubic, b, x, (x,)),
        "hessian": lambda b: td.prepare_hessian(cubic, b, x),
        "second_derivative": lambda b: td.prepare_second_derivative(lambda t: t**3, b, torch.tensor(1.0)),
        "jacobian": lambda b: td.prepare_jacobian(lambda x: torch.cat([x, x**2]), b, x),  # forward mode: n < m
    }
    with pytest.raises(UnsupportedOperatorError, match=r"double backward.*Backends that can: AutoCompile\(\)"):
        calls[operator](COMPILED_AUTOGRAD)
    calls[operator](COMPILED)  # the named alternative works


def test_item08_compiled_autograd_first_order_still_works() -> None:
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(td.gradient(cubic, COMPILED_AUTOGRAD, x), 3 * x**2)
    (vj,) = td.pullback(lambda x: x**2, COMPILED_AUTOGRAD, x, (torch.ones(2),))
    torch.testing.assert_close(vj, 2 * x)
    # A wide jacobian is built from pullbacks (reverse mode): no double backward.
    torch.testing.assert_close(td.jacobian(lambda x: x.sum().reshape(1), COMPILED_AUTOGRAD, x), torch.ones(1, 2))


@pytest.mark.parametrize("outer", [AutoAutograd(), AutoFunc()], ids=["autograd", "func"])
def test_item08_eager_outer_over_compiled_inner_is_refused(outer: object) -> None:
    backend = SecondOrder(outer, COMPILED)
    with pytest.raises(UnsupportedOperatorError, match=r"cannot differentiate a compiled inner backend.*SecondOrder\(AutoFiniteDiff\(\), AutoCompile\(\)\)"):
        td.prepare_hvp(cubic, backend, torch.ones(2), (torch.ones(2),))
    with pytest.raises(UnsupportedOperatorError):
        td.prepare_second_derivative(lambda t: t**3, backend, torch.tensor(1.0))
    # A pair named as working does work.
    (hv,) = td.hvp(cubic, SecondOrder(COMPILED, AutoFunc()), torch.ones(2), (torch.ones(2),))
    torch.testing.assert_close(hv, torch.full((2,), 6.0))


def test_item08_finite_differences_over_compiled_inner() -> None:
    (hv,) = td.hvp(cubic, SecondOrder(AutoFiniteDiff(), COMPILED), torch.ones(2), (torch.ones(2),))
    torch.testing.assert_close(hv, torch.full((2,), 6.0), rtol=1e-3, atol=1e-3)


def test_item08_check_command_reports_the_refused_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    from torchdi.__main__ import main

    main(["check", "--backends", "compile-autograd,so-autograd-compile", "--operators", "hvp,pushforward"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("hvp", "pushforward"))}
    assert rows["hvp"] == ["unsupported", "unsupported"]
    assert rows["pushforward"][0] == "unsupported"  # double backward; the SecondOrder delegates to its inner


# --- item 9: random operations under vmap ---------------------------------------------------------


def dropout_loss(x: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.dropout(x, 0.5, training=True) ** 2).sum()


@pytest.mark.parametrize("name", ["autograd", "func", "compile"])
def test_item09_random_f_shares_one_evaluation_across_tangents(name: str) -> None:
    # With one dropout mask m (scale s = 2): y = m s x^2, so J t = 2 y / x * t for every tangent,
    # and the loss sum((m s x)^2) has gradient g = 8 m x and H t = g / x * t. Each holds only if
    # the value and all tangents see the same evaluation of f, as AutoAutograd computes.
    backend = BACKENDS[name]
    x = torch.arange(1.0, 9.0)
    tx = (torch.ones(8), torch.arange(8.0), torch.linspace(-1.0, 1.0, 8))
    y, dys = td.value_and_pushforward(lambda x: torch.nn.functional.dropout(x, 0.5) * x, backend, x, tx)
    assert 0 < int((y != 0).sum()) < 8  # some dropped, some kept: the test can tell masks apart
    for t, dy in zip(tx, dys):
        torch.testing.assert_close(dy, 2 * y / x * t)
    g, hvs = td.gradient_and_hvp(dropout_loss, backend, x, tx)
    for t, hv in zip(tx, hvs):
        torch.testing.assert_close(hv, g / x * t)
    if name != "autograd":  # AutoAutograd's hessian is a fallback: the gradient and HVPs evaluate f apart
        _, g, h = td.value_gradient_and_hessian(dropout_loss, backend, x)
        torch.testing.assert_close(h, torch.diag(g / x))


# --- item 10: empty x ------------------------------------------------------------------------------


@ALL
def test_item10_empty_x_gives_empty_results_of_the_right_shape(name: str) -> None:
    backend = BACKENDS[name]
    x = torch.zeros(0)
    assert td.gradient(lambda x: (x**2).sum(), backend, x).shape == (0,)
    assert td.jacobian(lambda x: x * 2, backend, x).shape == (0, 0)
    assert td.jacobian(lambda x: torch.cat([x, torch.ones(2)]), backend, x).shape == (2, 0)
    y, g, h = td.value_gradient_and_hessian(lambda x: (x**2).sum() + 1, backend, x)
    assert y.item() == 1.0 and g.shape == (0,) and h.shape == (0, 0)
    assert td.hvp(lambda x: (x**2).sum(), backend, x, (x,))[0].shape == (0,)
    (jv,) = td.pushforward(lambda x: torch.cat([x, torch.ones(2)]), backend, x, (x,))
    torch.testing.assert_close(jv, torch.zeros(2))  # J dx with an empty dx: zeros of y's shape
    (vj,) = td.pullback(lambda x: x[:0] * 2, backend, torch.ones(3), (torch.zeros(0),))
    torch.testing.assert_close(vj, torch.zeros(3))  # an empty output: the zero map


# --- item 12: compiled second derivative with a tensor Constant -----------------------------------


def test_item12_compiled_second_derivative_with_tensor_constant() -> None:
    a = torch.tensor(2.0)
    f = lambda t, a: torch.sin(t * a)  # noqa: E731
    prep = td.prepare_second_derivative(f, COMPILED, torch.tensor(1.0), Constant(a))
    compilations = prep.num_compilations
    for t, scale in ((1.0, 2.0), (0.3, -1.5)):
        got = td.second_derivative(f, COMPILED, torch.tensor(t), Constant(torch.tensor(scale)), prep=prep)
        torch.testing.assert_close(got, torch.tensor(-(scale**2) * math.sin(t * scale)))
    assert prep.num_compilations == compilations


def test_item12_inductor_second_derivative_with_tensor_constant_does_not_crash() -> None:
    # Nested jvps over a closed-over tensor gave inductor an "efficient zero" tangent that it
    # wrote into: a segfault, hence a subprocess (inductor is the point here, not aot_eager).
    script = (
        "import torch, torchdi as td\n"
        "f = lambda t, a: torch.sin(t * a)\n"
        "prep = td.prepare_second_derivative(f, td.AutoCompile(), torch.tensor(1.0), td.Constant(torch.tensor(2.0)))\n"
        "print(td.second_derivative(f, td.AutoCompile(), torch.tensor(0.5), td.Constant(torch.tensor(3.0)), prep=prep).item())\n"
        # The generic second derivative: a compiled outer jvp over AutoFunc's inner derivative.
        "composed = td.SecondOrder(td.AutoCompile(), td.AutoFunc())\n"
        "print(td.second_derivative(f, composed, torch.tensor(0.5), td.Constant(torch.tensor(3.0))).item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    own, composed = (float(word) for word in done.stdout.split()[-2:])
    assert own == pytest.approx(-9.0 * math.sin(1.5), rel=1e-5)
    assert composed == pytest.approx(-9.0 * math.sin(1.5), rel=1e-5)


# --- item 13: one naming of arguments in every message --------------------------------------------


@pytest.mark.parametrize("name", ["autograd", "compile"])
def test_item13_arguments_are_named_x_tx_ty_and_context_1_to_n(name: str) -> None:
    backend = BACKENDS[name]
    x = torch.ones(2)
    prep = td.prepare_gradient(cubic, backend, x)
    with pytest.raises(PreparationMismatchError) as info:
        td.hvp(cubic, backend, x, (x,), prep=prep)
    message = str(info.value)
    assert "tx: mismatch: not present at preparation" in message and "context" not in message
    with pytest.raises(TypeError, match=r"gradient: context 1 \(argument 4\) must be wrapped.*tuple of tangents"):
        td.gradient(cubic, backend, x, (x,))
    with pytest.raises(TypeError, match=r"pushforward: context 2 \(argument 6\) must be wrapped"):
        td.pushforward(lambda x, c, d: x, backend, x, (x,), Constant(1), 3)
    f2 = lambda x, c, d: (x * c * d).sum()  # noqa: E731
    prep = td.prepare_gradient(f2, backend, x, Constant(x), Constant(x))
    with pytest.raises(PreparationMismatchError, match=r"context 2: mismatch: expected Constant\(Tensor\(shape=\(2,\)"):
        td.gradient(f2, backend, x, Constant(x), Constant(torch.ones(3)), prep=prep)


# --- item 14: traced values are named in errors; Static keeps a value static --------------------


def test_item14_errors_from_translated_contexts_say_so() -> None:
    def uses_numpy(x: torch.Tensor, arr: np.ndarray) -> torch.Tensor:
        return (x * float(arr.astype(np.float32).sum())).sum()

    with pytest.raises(Exception) as info:  # the compiler's own error type, with a note added
        td.gradient(uses_numpy, COMPILED, torch.ones(2), Constant(np.ones(2)))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "context 1 (ndarray) as torch.Tensor" in notes and "torchdi.Static(value)" in notes


@pytest.mark.parametrize("name", ["autograd", "func", "compile"])
def test_item14_static_value_is_baked_in_and_compared_by_value(name: str) -> None:
    backend = BACKENDS[name]

    def loops(x: torch.Tensor, steps: td.Static[float]) -> torch.Tensor:
        assert isinstance(steps.value, float)
        return sum((x * i).sum() for i in range(int(steps.value)))  # type: ignore[return-value]

    x = torch.ones(2)
    prep = td.prepare_gradient(loops, backend, x, Constant(td.Static(3.0)))
    torch.testing.assert_close(td.gradient(loops, backend, x, Constant(td.Static(3.0)), prep=prep), torch.full((2,), 3.0))
    compilations = prep.num_compilations
    assert td.to_device_tensor(td.Static(3.0), "cpu") == td.Static(3.0)
    if name == "compile":  # baked in: a new value is a new preparation, said by the strict check
        with pytest.raises(PreparationMismatchError, match=r"context 1: mismatch.*Static\(value=3.0\).*Static\(value=4.0\)"):
            td.gradient(loops, backend, x, Constant(td.Static(4.0)), prep=prep)
        assert prep.num_compilations == compilations
    else:
        torch.testing.assert_close(td.gradient(loops, backend, x, Constant(td.Static(4.0)), prep=prep), torch.full((2,), 6.0))
    with pytest.raises(TypeError, match=r"Static\(value\) needs a hashable value.*list"):
        td.Static([1.0])
