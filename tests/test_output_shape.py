"""A prepared call where something ``f`` reads besides ``x`` changed the shape of ``f(x)``: a
context's value (``x[:k]`` with ``Constant(k)``), a global, a closure cell.

Rule 1's check compares ``x``, the tangents and the contexts' layouts and cannot see this, so the
runners that hold ``f(x)``'s shape (a jacobian's basis and size, a pullback's cotangents, an
``AutoSparse`` pattern) must tell: every call gets either what plain torch gives for the new
shape, or a ``PreparationMismatchError`` that says ``f(x)`` changed shape. Before, ``AutoSparse``
returned a jacobian of the old size (silently wrong) and the others failed deep inside torch
("Mismatch in shape", "shape '[5, 3]' is invalid", "index out of range").

Compiled coverage uses ``AutoCompile(compiler="aot_eager")``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchdi as td

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state"),
    pytest.mark.filterwarnings("ignore:.*recompiled.*"),
]


def aot() -> td.AutoCompile:
    return td.AutoCompile(compiler="aot_eager")


BACKENDS: dict[str, Any] = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "fd": td.AutoFiniteDiff(),
    "mixed": td.MixedMode(td.AutoFunc(), td.AutoAutograd()),
    "sparse_func": td.AutoSparse(td.AutoFunc()),
    "sparse_autograd": td.AutoSparse(td.AutoAutograd()),
    "sparse_mixed": td.AutoSparse(td.MixedMode(td.AutoFunc(), td.AutoAutograd())),
    "compile": aot(),
    "sparse_compile": td.AutoSparse(aot()),
}

SHAPE_MESSAGE = "f(x) returned shape"


def dense(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.to_dense() if matrix.layout != torch.strided else matrix


def prefix(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sin(x[:k]) * 2


def reference(op: str, g: Any, x: torch.Tensor, ty: torch.Tensor | None = None) -> torch.Tensor:
    if op == "jacobian":
        return torch.autograd.functional.jacobian(g, x)
    assert ty is not None
    return torch.autograd.functional.vjp(g, x, ty)[1]


def call(op: str, backend: Any, f: Any, x: torch.Tensor, contexts: tuple[Any, ...], prep: Any, ty: torch.Tensor | None = None) -> torch.Tensor:
    if op == "jacobian":
        return dense(td.jacobian(f, backend, x, *contexts, prep=prep))
    return td.pullback(f, backend, x, (ty,), *contexts, prep=prep)[0]


def prepare(op: str, backend: Any, f: Any, x: torch.Tensor, contexts: tuple[Any, ...], strict: bool, ty: torch.Tensor | None = None) -> Any:
    if op == "jacobian":
        return td.prepare_jacobian(f, backend, x, *contexts, strict=strict)
    return td.prepare_pullback(f, backend, x, (ty,), *contexts, strict=strict)


def right_or_refused(run: Any, expected: torch.Tensor) -> str:
    """``"right"`` when ``run()`` equals ``expected``; ``"refused"`` on the clear error; else fails."""
    try:
        result = run()
    except td.PreparationMismatchError as error:
        assert SHAPE_MESSAGE in str(error) or "mismatch" in str(error), str(error)
        return "refused"
    assert result.shape == expected.shape, f"a result of shape {tuple(result.shape)} where {tuple(expected.shape)} is right"
    torch.testing.assert_close(result, expected, atol=1e-3, rtol=1e-3)
    return "right"


@pytest.mark.parametrize("new_k", [3, 5], ids=["shrinks", "grows"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_jacobian_context_value_changes_output_shape(name: str, strict: bool, new_k: int) -> None:
    backend = BACKENDS[name]
    x = torch.randn(6, dtype=torch.float64)
    prep = prepare("jacobian", backend, prefix, x, (td.Constant(4),), strict)
    outcome = right_or_refused(
        lambda: call("jacobian", backend, prefix, x, (td.Constant(new_k),), prep),
        reference("jacobian", lambda x_: prefix(x_, new_k), x),
    )
    if isinstance(backend, td.AutoSparse) or name in ("autograd", "fd", "mixed"):
        assert outcome == "refused"  # these hold the old shape: the clear error, never the old size
    # The preparation still serves its own shape afterwards.
    torch.testing.assert_close(call("jacobian", backend, prefix, x, (td.Constant(4),), prep), reference("jacobian", lambda x_: prefix(x_, 4), x), atol=1e-3, rtol=1e-3)


LENGTH = 4


def through_global(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x[:LENGTH])


@pytest.mark.parametrize("op", ["jacobian", "pullback"])
@pytest.mark.parametrize("name", ["autograd", "func", "fd", "sparse_func", "compile", "sparse_compile"])
def test_global_changes_output_shape(name: str, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = BACKENDS[name]
    if op == "pullback" and isinstance(backend, td.AutoSparse):
        pytest.skip("AutoSparse serves jacobians and hessians; its pullback is the dense backend's")
    x = torch.randn(6, dtype=torch.float64)
    ty = torch.randn(4, dtype=torch.float64)
    prep = prepare(op, backend, through_global, x, (), strict=True, ty=ty)
    monkeypatch.setattr(__import__(__name__), "LENGTH", 3)
    expected = reference(op, through_global, x, ty[:3]) if op == "pullback" else reference(op, through_global, x)
    outcome = right_or_refused(lambda: call(op, backend, through_global, x, (), prep, ty), expected)
    # A pullback's cotangent has the old shape: no backend can serve it.
    assert outcome == "refused" if op == "pullback" or name not in ("func", "compile") else outcome == "right"


def test_same_size_new_shape_is_refused_not_reshaped() -> None:
    """A new shape of as many elements: the batched jacobian would reshape to the old one silently."""
    shape = [(4,)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return x[:4].exp().reshape(shape[0])

    x = torch.randn(5)
    for backend in (td.AutoAutograd(), td.AutoFiniteDiff(), td.AutoSparse(td.AutoFunc())):
        prep = td.prepare_jacobian(f, backend, x)
        shape[0] = (2, 2)
        with pytest.raises(td.PreparationMismatchError, match=r"f\(x\) returned shape \(2, 2\).*had shape \(4,\)"):
            td.jacobian(f, backend, x, prep=prep)
        shape[0] = (4,)


def test_state_is_not_updated_twice_to_diagnose() -> None:
    """The failing path evaluates f once more to tell why, except when f updates a State."""

    def f(x: torch.Tensor, k: int, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x[:k] * 3

    x, counter = torch.randn(5), torch.zeros(())
    prep = td.prepare_gradient(f, td.AutoAutograd(), x, td.Constant(1), td.State(counter))
    before = counter.item()
    with pytest.raises(ValueError, match="one-element") as raised:  # the runner's own error
        td.gradient(f, td.AutoAutograd(), x, td.Constant(2), td.State(counter), prep=prep)
    assert not isinstance(raised.value, td.PreparationMismatchError)
    assert counter.item() == before + 1  # the failed call's own evaluation, no second one


@pytest.mark.parametrize("op", ["gradient", "hvp", "hessian"])
@pytest.mark.parametrize("name", ["autograd", "func", "fd", "compile", "sparse_func"])
def test_scalar_output_becomes_a_vector(name: str, op: str) -> None:
    """A gradient over torch.autograd differentiated y.sum() when a context made f(x) a vector."""
    if isinstance(BACKENDS[name], td.AutoSparse) and op != "hessian":
        pytest.skip("AutoSparse's gradient and hvp are the dense backend's")
    backend = BACKENDS[name]

    def f(x: torch.Tensor, k: int) -> torch.Tensor:
        return (x[:k] ** 2) * 3

    x = torch.randn(5, dtype=torch.float64)
    tangents = ((torch.ones(5, dtype=torch.float64),),) if op == "hvp" else ()
    prep = getattr(td, f"prepare_{op}")(f, backend, x, *tangents, td.Constant(1))
    with pytest.raises(td.PreparationMismatchError, match=r"mismatch|f\(x\) returned shape \(2,\)"):
        getattr(td, op)(f, backend, x, *tangents, td.Constant(2), prep=prep)


def test_error_chains_the_runners_error() -> None:
    x = torch.randn(6)
    prep = td.prepare_jacobian(prefix, td.AutoAutograd(), x, td.Constant(4))
    with pytest.raises(td.PreparationMismatchError) as raised:
        td.jacobian(prefix, td.AutoAutograd(), x, td.Constant(5), prep=prep)
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's own error stays visible
    assert "(5,)" in str(raised.value) and "(4,)" in str(raised.value)
