"""Issue 23, the compiled engines and DifferentiateWith (items 3, 5, 7, 8, 9, 11, 13, 16, 17).

One test per item, each failing before its fix. Compiled coverage uses
``AutoCompile(compiler="aot_eager")``; inductor only where the item is inductor's own layout
handling (marked ``inductor``). AutoXLA's side of item 5 is in ``tests/xla``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torchdi as td
from torchdi import AutoAutograd, AutoCompile, AutoFiniteDiff, AutoFunc, Constant, State, UnsupportedOperatorError

COMPILED = AutoCompile(compiler="aot_eager")


# -- item 3: a non-contiguous State tensor is updated on AutoCompile -------------------------------


def _counting(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    state.add_(x.detach().sum())
    return (x * x).sum()


def _non_contiguous_states() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(the tensor the user holds, the non-contiguous view passed as the State)."""
    base = torch.zeros(2, 3)
    big = torch.zeros(6)
    return {"transposed": (base, base.t()), "strided": (big, big[::2])}


@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("prepared", [False, True], ids=["one-shot", "prepared"])
def test_item3_non_contiguous_state_is_updated(layout: str, prepared: bool) -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    base, view = _non_contiguous_states()[layout]
    expected_base, expected_view = _non_contiguous_states()[layout]
    _counting(x, expected_view)  # eager: one update
    prep = td.prepare_gradient(_counting, COMPILED, x, State(view)) if prepared else None
    assert torch.equal(base, torch.zeros_like(base))  # preparation has no side effect
    grad = td.gradient(_counting, COMPILED, x, State(view), prep=prep)
    torch.testing.assert_close(grad, 2 * x)
    assert torch.equal(base, expected_base)  # updated exactly once, through the user's view
    compilations = None if prep is None else prep.num_compilations
    td.gradient(_counting, COMPILED, x, State(view), prep=prep)
    _counting(x, expected_view)
    assert torch.equal(base, expected_base)
    if prep is not None:
        assert prep.num_compilations == compilations  # copied to the compiled layout, not recompiled


@pytest.mark.inductor
def test_item3_non_contiguous_state_is_updated_inductor() -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    base = torch.zeros(2, 3)
    prep = td.prepare_gradient(_counting, AutoCompile(), x, State(base.t()))
    td.gradient(_counting, AutoCompile(), x, State(base.t()), prep=prep)
    td.value_and_gradient(_counting, AutoCompile(), x, State(base.t()))  # one-shot
    torch.testing.assert_close(base, torch.full((2, 3), 12.0))
