"""Issue 23 item 5: one float policy for every compiled backend (rule 8) — AutoXLA.

Python-float contexts reach ``f`` as Python floats in double precision (as eager and
``AutoCompile``), with eager's result dtypes, and a new value does not recompile.
"""

from __future__ import annotations

import pytest
import torch

import torchdi as td

XLA = td.AutoXLA()


def _damped(x: torch.Tensor, beta: float) -> torch.Tensor:
    return (x * (1 - beta)).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_item5_float_arithmetic_in_double_precision(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    prep = td.prepare_gradient(_damped, XLA, x, td.Constant(0.9))
    compilations = prep.num_compilations
    for beta in (1 - 1e-7, 0.9, 1 - 3e-9):
        value, grad = td.value_and_gradient(_damped, XLA, x, td.Constant(beta), prep=prep)
        expected_value, expected_grad = td.value_and_gradient(_damped, td.AutoAutograd(), x, td.Constant(beta))
        assert grad.dtype == expected_grad.dtype == dtype and value.dtype == expected_value.dtype
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(value, expected_value, rtol=1e-6, atol=0)
    assert prep.num_compilations == compilations


def test_item5_scalar_x_keeps_its_dtype() -> None:
    """A 0-d float32 x times a float context stays float32 (eager's wrapped-number rule)."""
    def wave(t: torch.Tensor, c: float) -> torch.Tensor:
        return torch.sin(t * c)

    t = torch.tensor(0.5)
    prep = td.prepare_derivative(wave, XLA, t, td.Constant(2.0))
    for c in (2.0, 1 - 1e-7):
        got = td.derivative(wave, XLA, t, td.Constant(c), prep=prep)
        want = td.derivative(wave, td.AutoAutograd(), t, td.Constant(c))
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)


def test_item11_float_made_into_a_tensor_does_not_recompile_xla() -> None:
    def f(x: torch.Tensor, c: float) -> torch.Tensor:
        return (x * torch.tensor(c) + torch.full_like(x, 1 - c)).sum()

    x = torch.tensor([1.0, -2.0, 0.5])
    prep = td.prepare_gradient(f, XLA, x, td.Constant(0.5))
    compilations = prep.num_compilations
    for c in (1 - 1e-7, 2.5, -3.25):
        value, grad = td.value_and_gradient(f, XLA, x, td.Constant(c), prep=prep)
        torch.testing.assert_close(value, f(x, c))
        torch.testing.assert_close(grad, torch.full_like(x, c))
    assert prep.num_compilations == compilations
