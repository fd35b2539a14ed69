"""Regression tests from the composition bug hunt (DESIGN rule 10 and the second-order refusals).

Each case was found by sweeping backend x operator x outer transform against torch.func /
torch.autograd in float64; each test failed before its fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchdi as td
from torchdi import AutoCompile, AutoFunc, SecondOrder

DT = torch.float64
AOT = AutoCompile(compiler="aot_eager")
W = torch.tensor([0.3, 1.1, -0.4], dtype=DT)


def curve(t: torch.Tensor) -> torch.Tensor:
    """A vector-valued f of a scalar t that broadcasts a tensor it closes over against t."""
    return W * t**3 + torch.sin(W * t)


def curve_of(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * t**3 + torch.sin(w * t)


def curve_d1(t: torch.Tensor) -> torch.Tensor:
    return 3 * W * t**2 + W * torch.cos(W * t)


def curve_d2(t: torch.Tensor) -> torch.Tensor:
    return 6 * W * t - W**2 * torch.sin(W * t)


T = torch.tensor(0.6, dtype=DT)


@pytest.mark.parametrize("backend", [AOT, AutoCompile(inner=SecondOrder(AutoFunc(), AutoFunc()), compiler="aot_eager")], ids=["compile", "compile_so"])
def test_compiled_second_derivative_of_f_broadcasting_a_closed_over_tensor_is_refused_naming_what_works(backend: Any) -> None:
    # dynamo cannot trace a jvp nested in a jvp here (a torch bug): before, an error from inside
    # its fake-tensor pass ("more than one element of the written-to tensor refers to a single
    # memory location") at preparation. (Vmapping the outer jvp traces, but inductor segfaults.)
    with pytest.raises(td.UnsupportedOperatorError, match=r"second_derivative of curve.*torchdi.Constant.*AutoFunc\(\)"):
        td.prepare_second_derivative(curve, backend, T)
    # the way it names: the tensor as a Constant context enters forward mode as an explicit primal
    prep = td.prepare_second_derivative(curve_of, backend, T, td.Constant(W))
    for t in (T, torch.tensor(-1.3, dtype=DT)):
        y, dy, d2y = td.value_derivative_and_second_derivative(curve_of, backend, t, td.Constant(W), prep=prep)
        torch.testing.assert_close(y, curve(t))
        torch.testing.assert_close(dy, curve_d1(t))
        torch.testing.assert_close(d2y, curve_d2(t))
    assert prep.num_compilations == 1
