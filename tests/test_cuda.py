"""torchdi on a CUDA device: every backend, CUDA graphs (``mode="reduce-overhead"``), ``State``,
sparse jacobians and hessians, ``DifferentiateWith``.

``make test-gpu`` runs these (``-m cuda``) in the environment whose torch is a CUDA build; on a
machine without a device every test here skips, saying so. Results are compared with eager
``torch.autograd`` on the same device, and must stay on the device of ``x``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.func import functional_call

import torchdi as td

# TORCHDI_TEST_DEVICE=cpu runs the same checks on the CPU (how they are checked on a machine
# without a GPU, so that they are known to be right before a GPU runs them).
DEVICE = os.environ.get("TORCHDI_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"
    ),
]
REFERENCE = td.AutoAutograd()
TOL = {"rtol": 1e-4, "atol": 1e-5}

BACKENDS = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile-aot_eager": td.AutoCompile(compiler="aot_eager"),
    "compile-inductor": td.AutoCompile(),
    "finitediff": td.AutoFiniteDiff(),
    "second-order": td.SecondOrder(td.AutoAutograd(), td.AutoFunc()),
}


def loss(x, c):
    return (torch.tanh(x) * c).sum() + (x**2).sum()


def vector(x, c):
    return torch.sin(x) * c + x.roll(1)


def _tolerance(name):
    return {"rtol": 1e-2, "atol": 1e-3} if name == "finitediff" else TOL


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_on_cuda(name):
    backend = BACKENDS[name]
    dtype = torch.float64 if name == "finitediff" else torch.float32
    x = torch.linspace(-1.0, 1.0, 6, device=DEVICE, dtype=dtype)
    c = torch.rand(6, device=DEVICE, dtype=dtype)
    prep = td.prepare_gradient(loss, backend, x, td.Constant(c))
    x2 = torch.randn(6, device=DEVICE, dtype=dtype)
    got = td.gradient(loss, backend, x2, td.Constant(c), prep=prep)
    assert got.device.type == DEVICE
    torch.testing.assert_close(got, td.gradient(loss, REFERENCE, x2, td.Constant(c)), **_tolerance(name))
    jac = td.jacobian(vector, backend, x2, td.Constant(c))
    assert jac.device.type == DEVICE
    torch.testing.assert_close(jac, td.jacobian(vector, REFERENCE, x2, td.Constant(c)), **_tolerance(name))
    if name != "finitediff":
        hess = td.hessian(loss, backend, x2, td.Constant(c))
        torch.testing.assert_close(hess, td.hessian(loss, REFERENCE, x2, td.Constant(c)), **TOL)


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_cuda_graphs_reduce_overhead(compiler):
    backend = td.AutoCompile(compiler=compiler, mode="reduce-overhead")
    x = torch.linspace(-1.0, 1.0, 6, device=DEVICE)
    c = torch.rand(6, device=DEVICE)
    prep = td.prepare_gradient(loss, backend, x, td.Constant(c))
    compilations = prep.num_compilations
    results, wants = [], []
    for _ in range(4):  # replays write into the same memory: earlier results must not change
        x2 = torch.randn(6, device=DEVICE)
        results.append(td.value_and_gradient(loss, backend, x2, td.Constant(c), prep=prep))
        wants.append(td.value_and_gradient(loss, REFERENCE, x2, td.Constant(c)))
    for got, want in zip(results, wants):
        torch.testing.assert_close(got, want, **TOL)
    assert prep.num_compilations == compilations


def test_state_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).to(DEVICE)
    reference = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())

    def f(p, b, batch):
        return functional_call(model, (p, b), (batch,)).square().mean()

    data = [torch.randn(16, 4, device=DEVICE) for _ in range(3)]
    backend = td.AutoCompile(compiler="aot_eager")
    prep = td.prepare_gradient(f, backend, params, td.State(buffers), td.Constant(data[0]))
    for batch in data:
        grads = td.gradient(f, backend, params, td.State(buffers), td.Constant(batch), prep=prep)
        reference.zero_grad()
        reference(batch).square().mean().backward()
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(grads[name], parameter.grad, **TOL)
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, **TOL, msg=name)
        assert got.device.type == DEVICE


@pytest.mark.parametrize("dense", [td.AutoFunc(), td.AutoCompile(compiler="aot_eager")], ids=["func", "compile"])
def test_sparse_on_cuda(dense):
    def tridiagonal(x):
        return x[1:] * x[:-1] - torch.sin(x[1:])

    backend = td.AutoSparse(dense)
    x = torch.linspace(0.1, 1.0, 8, device=DEVICE)
    prep = td.prepare_jacobian(tridiagonal, backend, x)
    x2 = torch.rand(8, device=DEVICE)
    jac = td.jacobian(tridiagonal, backend, x2, prep=prep)
    assert jac.layout == torch.sparse_csr and jac.device.type == DEVICE
    torch.testing.assert_close(jac.to_dense(), td.jacobian(tridiagonal, REFERENCE, x2), **TOL)
    assert prep.ncolors <= 3

    def chain(x):
        return ((x[1:] - x[:-1]) ** 2).sum() + (x**4).sum()

    hess = td.hessian(chain, td.AutoSparse(td.SecondOrder(td.AutoFunc(), td.AutoFunc())), x2)
    assert hess.device.type == DEVICE
    torch.testing.assert_close(hess.to_dense(), td.hessian(chain, REFERENCE, x2), **TOL)


def test_differentiate_with_on_cuda():
    g = td.DifferentiateWith(lambda z: torch.sin(z) * 2.0, td.AutoCompile(compiler="aot_eager"))
    x = torch.linspace(-1.0, 1.0, 5, device=DEVICE, requires_grad=True)
    g(x).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(x.detach()), **TOL)


def test_host_and_device_prep_are_not_mixed():
    """A prep made for a CPU x refuses a CUDA x (rule 1: the device is part of the signature)."""
    if DEVICE == "cpu":
        pytest.skip("needs a device other than the CPU")
    x = torch.ones(3)
    prep = td.prepare_gradient(torch.sum, td.AutoFunc(), x)
    with pytest.raises(td.PreparationMismatchError, match="device"):
        td.gradient(torch.sum, td.AutoFunc(), x.to(DEVICE), prep=prep)
