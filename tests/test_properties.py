"""Property tests over random shapes and values: AutoFunc and AutoFiniteDiff (float64) vs AutoAutograd."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdi
from torchdi import AutoAutograd, AutoFiniteDiff, AutoFunc, Constant

CANDIDATES = {"func": AutoFunc(), "func_chunk2": AutoFunc(chunk_size=2), "fd": AutoFiniteDiff()}
TOL = {"func": {"rtol": 1e-10, "atol": 1e-10}, "func_chunk2": {"rtol": 1e-10, "atol": 1e-10}, "fd": {"rtol": 1e-5, "atol": 1e-6}}
FD_HVP_TOL = {"rtol": 1e-4, "atol": 1e-5}

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)


def sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1


def scalar_f(x: torch.Tensor, c: float) -> torch.Tensor:
    return (torch.sin(x) * x**2).sum() * c + x.sum() ** 2 + (x**4).mean()


def vector_f(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    return torch.stack([torch.tanh(flat).sum(), (flat**2).prod(), torch.cumsum(flat, 0)[-1] * flat[0]])


def matrix_f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * x.sum() + torch.cumsum(x.reshape(-1), 0).reshape(x.shape)


@settings(max_examples=20)
@given(shape=shapes, seed=seeds, c=st.floats(-2.0, 2.0))
def test_gradient_matches_autograd_and_closed_form(shape, seed, c):
    x = sample(shape, seed)
    reference = torchdi.gradient(scalar_f, AutoAutograd(), x, Constant(c))
    closed = (torch.cos(x) * x**2 + 2 * x * torch.sin(x)) * c + 2 * x.sum() + 4 * x**3 / max(x.numel(), 1)
    torch.testing.assert_close(reference, closed, rtol=1e-10, atol=1e-10)
    for name, backend in CANDIDATES.items():
        y, g = torchdi.value_and_gradient(scalar_f, backend, x, Constant(c))
        torch.testing.assert_close(y, scalar_f(x, c), rtol=1e-12, atol=1e-12)
        assert g.shape == x.shape
        torch.testing.assert_close(g, reference, **TOL[name])


@settings(max_examples=20)
@given(shape=shapes, seed=seeds, which=st.sampled_from(["vector", "matrix"]))
def test_jacobian_matches_autograd(shape, seed, which):
    f = vector_f if which == "vector" else matrix_f
    x = sample(shape, seed)
    reference = torchdi.jacobian(f, AutoAutograd(), x)
    y = f(x)
    assert reference.shape == y.shape + x.shape
    torch.testing.assert_close(reference, torch.func.jacrev(f)(x), rtol=1e-10, atol=1e-10)
    for name, backend in CANDIDATES.items():
        jac = torchdi.jacobian(f, backend, x)
        torch.testing.assert_close(jac, reference, **TOL[name])


@settings(max_examples=15)
@given(shape=shapes, seed=seeds, n_tangents=st.integers(1, 3), c=st.floats(-2.0, 2.0))
def test_hvp_matches_autograd(shape, seed, n_tangents, c):
    x = sample(shape, seed)
    tx = tuple(sample(shape, seed + 1 + i) for i in range(n_tangents))
    reference = torchdi.hvp(scalar_f, AutoAutograd(), x, tx, Constant(c))
    hess = torch.func.hessian(lambda v: scalar_f(v, c))(x).reshape(x.numel(), x.numel())
    for t, r in zip(tx, reference):
        torch.testing.assert_close(r, (hess @ t.reshape(-1)).reshape(shape), rtol=1e-10, atol=1e-10)
    for name, backend in CANDIDATES.items():
        got = torchdi.hvp(scalar_f, backend, x, tx, Constant(c))
        assert isinstance(got, tuple) and len(got) == n_tangents
        torch.testing.assert_close(got, reference, **(FD_HVP_TOL if name == "fd" else TOL[name]))


@settings(max_examples=15)
@given(shape=shapes.filter(lambda s: len(s) > 0), seed=seeds)
def test_prep_reuse_over_random_values(shape, seed):
    """One Prep, many values of the same shape: always the reference result (rule 1)."""
    x0 = sample(shape, seed)
    preps = {name: torchdi.prepare_gradient(scalar_f, b, x0, Constant(1.0)) for name, b in CANDIDATES.items()}
    for k in range(2):
        x = sample(shape, seed + 7 + k)
        c = 0.5 - k
        reference = torchdi.gradient(scalar_f, AutoAutograd(), x, Constant(c))
        for name, backend in CANDIDATES.items():
            g = torchdi.gradient(scalar_f, backend, x, Constant(c), prep=preps[name])
            torch.testing.assert_close(g, reference, **TOL[name])
