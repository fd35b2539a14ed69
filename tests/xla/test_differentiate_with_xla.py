"""DifferentiateWith with an AutoXLA piece inside eager CPU code, on torch-xla's PJRT CPU client."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch-xla is not installed here: `make test-xla` runs these in .venv-xla")

import torchdi as td


def test_xla_piece_in_eager_code_compiles_once():
    g = td.DifferentiateWith(lambda z, c: torch.tanh(z) * c, td.AutoXLA())
    weights = torch.arange(12.0).reshape(4, 3)
    for c in (1.0, 2.0, 3.0):  # new values of x and of the float context: no new compilation
        x = torch.randn(4, 3, requires_grad=True)
        (g(x, td.Constant(c)) * weights).sum().backward()
        torch.testing.assert_close(x.grad, c * (1 - torch.tanh(x.detach()) ** 2) * weights, atol=1e-5, rtol=1e-5)
        assert x.grad.device.type == "cpu"
    assert g.num_preparations == 1 and g.num_compilations == 1
    x = torch.randn(4, 3)
    grad = torch.func.grad(lambda z: g(z, td.Constant(2.0)).sum())(x)
    torch.testing.assert_close(grad, 2 * (1 - torch.tanh(x) ** 2), atol=1e-5, rtol=1e-5)
