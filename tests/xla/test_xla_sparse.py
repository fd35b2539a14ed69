"""AutoSparse over AutoXLA on torch-xla's PJRT CPU client: compressed passes compiled once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_xla", reason="AutoXLA needs torch-xla (the .venv-xla environment)")

import torchdi as td
from torchdi.testing.sparse_scenarios import brusselator, chained_rosenbrock

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


def test_sparse_jacobian_and_hessian_on_xla_compile_once():
    backend = td.AutoSparse(td.AutoXLA())
    x = 1 + 0.1 * torch.rand(4, 4, 2)
    prep = td.prepare_jacobian(brusselator, backend, x)
    assert prep.ncolors == 8
    for shift in (0.0, 0.1, 0.2):
        jac = td.jacobian(brusselator, backend, x + shift, prep=prep)
        expected = torch.autograd.functional.jacobian(brusselator, x + shift).reshape(32, 32)
        assert jac.layout == torch.sparse_csr and jac.device.type == "cpu"
        assert torch.allclose(jac.to_dense(), expected, atol=1e-4)
    assert prep.num_compilations == 1
    z = torch.rand(20)
    hprep = td.prepare_hessian(chained_rosenbrock, backend, z)
    for shift in (0.0, 0.1):
        hess = td.hessian(chained_rosenbrock, backend, z + shift, prep=hprep)
        expected = torch.autograd.functional.hessian(chained_rosenbrock, z + shift)
        assert torch.allclose(hess.to_dense(), expected, atol=1e-3, rtol=1e-4)
    assert (hprep.ncolors, hprep.num_compilations) == (3, 2)
