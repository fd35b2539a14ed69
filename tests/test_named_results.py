"""The value_ variants return their family's NamedTuple (``torchdi.families``) on every backend:
fields by name, and unpacking as the plain tuple it always was."""

from __future__ import annotations

import pytest
import torch

import torchdi as td
from torchdi.families import FAMILIES

X = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
T = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)


def vector(x):
    return torch.sin(x) * x[0]


def scalar(x):
    return (torch.sin(x) * x).sum()


def scalar_in(x):
    return torch.sin(x) * torch.exp(x)


# family -> (value_ operator call, the reference fields by torch.func)
CALLS = {
    "pushforward": (lambda b: td.value_and_pushforward(vector, b, X, (T,)), lambda: (vector(X), (torch.func.jvp(vector, (X,), (T,))[1],))),
    "pullback": (lambda b: td.value_and_pullback(vector, b, X, (T,)), lambda: (vector(X), (torch.func.vjp(vector, X)[1](T)[0],))),
    "derivative": (
        lambda b: td.value_and_derivative(scalar_in, b, torch.tensor(0.4, dtype=torch.float64)),
        lambda: (scalar_in(torch.tensor(0.4, dtype=torch.float64)), torch.func.jacfwd(scalar_in)(torch.tensor(0.4, dtype=torch.float64))),
    ),
    "gradient": (lambda b: td.value_and_gradient(scalar, b, X), lambda: (scalar(X), torch.func.grad(scalar)(X))),
    "jacobian": (lambda b: td.value_and_jacobian(vector, b, X), lambda: (vector(X), torch.func.jacrev(vector)(X))),
    "second_derivative": (
        lambda b: td.value_derivative_and_second_derivative(scalar_in, b, torch.tensor(0.4, dtype=torch.float64)),
        lambda: (
            scalar_in(torch.tensor(0.4, dtype=torch.float64)),
            torch.func.jacfwd(scalar_in)(torch.tensor(0.4, dtype=torch.float64)),
            torch.func.jacfwd(torch.func.jacfwd(scalar_in))(torch.tensor(0.4, dtype=torch.float64)),
        ),
    ),
    "hvp": (
        lambda b: td.gradient_and_hvp(scalar, b, X, (T,)),
        lambda: (torch.func.grad(scalar)(X), (torch.func.hessian(scalar)(X) @ T,)),
    ),
    "hessian": (
        lambda b: td.value_gradient_and_hessian(scalar, b, X),
        lambda: (scalar(X), torch.func.grad(scalar)(X), torch.func.hessian(scalar)(X)),
    ),
}

BACKENDS = [td.AutoFunc(), td.AutoAutograd(), td.SecondOrder(td.AutoAutograd(), td.AutoFunc())]


def test_every_family_is_checked():
    assert set(CALLS) == set(FAMILIES)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_value_variants_return_the_family_namedtuple(name, backend):
    call, reference = CALLS[name]
    result = call(backend)
    kind = FAMILIES[name].result
    assert type(result) is kind
    want = reference()
    for field, expected in zip(kind._fields, want):
        torch.testing.assert_close(getattr(result, field), expected)
    unpacked = tuple(result)  # a tuple still: unpacking and indexing as before
    assert len(unpacked) == len(want) and unpacked[-1] is result[-1]


@pytest.mark.parametrize("name", ["gradient", "hessian", "pushforward"])
def test_compiled_and_sparse_backends_return_the_namedtuple(name):
    call, reference = CALLS[name]
    backends = [td.AutoCompile(compiler="aot_eager"), td.AutoFiniteDiff()]
    if name == "hessian":
        backends.append(td.AutoSparse(td.AutoFunc()))
    for backend in backends:
        result = call(backend)
        kind = FAMILIES[name].result
        assert type(result) is kind
        for field, expected in zip(kind._fields, reference()):
            got = getattr(result, field)
            got = got.to_dense() if isinstance(got, torch.Tensor) and got.layout == torch.sparse_csr else got
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_prepared_calls_and_has_aux_keep_the_namedtuple():
    prep = td.prepare_gradient(scalar, td.AutoFunc(), X)
    result = td.value_and_gradient(scalar, td.AutoFunc(), X, prep=prep)
    assert isinstance(result, FAMILIES["gradient"].result)
    torch.testing.assert_close(result.gradient, torch.func.grad(scalar)(X))

    def with_aux(x):
        return scalar(x), x.norm()

    (value, aux), gradient = result = td.value_and_gradient(with_aux, td.AutoAutograd(), X, has_aux=True)
    assert result.value == (value, aux) and result.gradient is gradient
    torch.testing.assert_close(aux, X.norm())
