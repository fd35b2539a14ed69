"""``AutoSparse``'s pattern is traced from ``f`` as it reads its globals, closure cells, attributes
and closed-over tensors at preparation; a prepared call after any of them changed gets the
jacobian or hessian plain torch gives (the pattern traced again when what ``f`` reads changed,
``torchdi.reads``), never one recovered with the old pattern's colours (before: silently wrong on
every dense backend, compiled ones included, since dynamo's recompilation kept the colouring).

Compiled coverage uses ``AutoCompile(compiler="aot_eager")``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import torchdi as td
from torchdi import _fence as fence
from torchdi.reads import Reads

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")

BACKENDS: dict[str, Callable[[], Any]] = {
    "func": lambda: td.AutoSparse(td.AutoFunc()),
    "autograd": lambda: td.AutoSparse(td.AutoAutograd()),
    "compile": lambda: td.AutoSparse(td.AutoCompile(compiler="aot_eager")),
}

SHIFT = 1
WEIGHTS = torch.eye(6, dtype=torch.float64)


def rolled(x: torch.Tensor) -> torch.Tensor:
    return x * x.roll(SHIFT)


def through_weights(x: torch.Tensor) -> torch.Tensor:
    return WEIGHTS @ x.sin()


def helper(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def through_helper(x: torch.Tensor) -> torch.Tensor:
    return helper(x) * 2


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, bias=False, dtype=torch.float64).requires_grad_(False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(6))
        self.offset = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * x.roll(self.offset)


def module_this() -> Any:
    return sys.modules[__name__]


def make_closure() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int], None]]:
    shift = 1

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * x.roll(shift)

    def set_shift(value: int) -> None:
        nonlocal shift
        shift = value

    return f, set_shift


def change_global(name: str, value: Any) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda monkeypatch: monkeypatch.setattr(module_this(), name, value)


def setups() -> dict[str, Callable[[pytest.MonkeyPatch], tuple[Any, Callable[[], None]]]]:
    """name -> (monkeypatch -> (f, change)): f, and what changes what it reads after preparation."""

    def global_int(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        return rolled, lambda: mp.setattr(module_this(), "SHIFT", 2)

    def global_tensor_rebound(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        return through_weights, lambda: mp.setattr(module_this(), "WEIGHTS", torch.ones(6, 6, dtype=torch.float64))

    def global_tensor_in_place(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        weights = torch.eye(6, dtype=torch.float64)
        mp.setattr(module_this(), "WEIGHTS", weights)
        return through_weights, lambda: weights.fill_(1.0)

    def helper_redefined(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        return through_helper, lambda: mp.setattr(module_this(), "helper", lambda x: x * x.roll(1))

    def closure_cell(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        f, set_shift = make_closure()
        return f, lambda: set_shift(3)

    def module_attribute(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        layer = Layer()
        return layer, lambda: setattr(layer, "offset", 2)

    def module_parameter_in_place(mp: pytest.MonkeyPatch) -> tuple[Any, Callable[[], None]]:
        layer = Layer()

        def change() -> None:
            with torch.no_grad():  # (a write through .data bumps no version: see torchdi.reads)
                layer.lin.weight.fill_(1.0)

        return layer, change

    return {fn.__name__: fn for fn in (global_int, global_tensor_rebound, global_tensor_in_place, helper_redefined,
                                       closure_cell, module_attribute, module_parameter_in_place)}


@pytest.mark.parametrize("setup", list(setups()))
@pytest.mark.parametrize("name", list(BACKENDS))
def test_jacobian_after_what_f_reads_changed(name: str, setup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = BACKENDS[name]()
    f, change = setups()[setup](monkeypatch)
    x = torch.randn(6, dtype=torch.float64)
    prep = td.prepare_jacobian(f, backend, x)
    compiled = prep.num_compilations
    before = prep.sparsity_pattern.to_dense()
    change()
    x2 = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(td.jacobian(f, backend, x2, prep=prep).to_dense(), torch.autograd.functional.jacobian(f, x2))
    # A pattern not inside the old one is prepared again (and counted); the next call serves it
    # without more.
    assert not torch.equal(prep.sparsity_pattern.to_dense(), before)
    grown = prep.num_compilations
    assert grown >= compiled
    torch.testing.assert_close(td.jacobian(f, backend, x, prep=prep).to_dense(), torch.autograd.functional.jacobian(f, x))
    assert prep.num_compilations == grown


@pytest.mark.parametrize("name", ["func", "compile"])
def test_hessian_after_a_global_changed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * x.roll(SHIFT)).sum()

    backend = BACKENDS[name]()
    x = torch.randn(8, dtype=torch.float64)
    prep = td.prepare_hessian(f, backend, x)
    monkeypatch.setattr(module_this(), "SHIFT", 3)
    torch.testing.assert_close(td.hessian(f, backend, x, prep=prep).to_dense(), torch.autograd.functional.hessian(f, x))


def test_a_pattern_that_shrinks_keeps_the_colouring(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    weights = torch.ones(6, 6, dtype=torch.float64)
    monkeypatch.setattr(module_this(), "WEIGHTS", weights)
    backend = td.AutoSparse(td.AutoFunc())
    x = torch.randn(6, dtype=torch.float64)
    prep = td.prepare_jacobian(through_weights, backend, x)
    colors = prep.colors.clone()
    weights.copy_(torch.eye(6))
    with caplog.at_level(logging.INFO, logger="torchdi"):
        result = td.jacobian(through_weights, backend, x, prep=prep)
    torch.testing.assert_close(result.to_dense(), torch.autograd.functional.jacobian(through_weights, x))
    assert torch.equal(prep.colors, colors)  # the dense colouring still recovers a sub-pattern
    assert "did not grow" in caplog.text


def test_unchanged_reads_do_not_trace_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal values rebound (a float recomputed) are no change: no new trace, no new compilation."""
    backend = BACKENDS["compile"]()
    x = torch.randn(6, dtype=torch.float64)
    prep = td.prepare_jacobian(rolled, backend, x)
    compiled, seconds = prep.num_compilations, prep.detection_seconds
    monkeypatch.setattr(module_this(), "SHIFT", int("1"))
    for _ in range(3):
        td.jacobian(rolled, backend, x, prep=prep)
    assert prep.num_compilations == compiled and prep.detection_seconds == seconds


def test_known_sparsity_is_not_watched() -> None:
    """A KnownSparsity is the user's promise for every call: nothing to trace again."""
    pattern = torch.eye(6, dtype=torch.bool).to_sparse_csr()
    prep = td.prepare_jacobian(torch.sin, td.AutoSparse(td.AutoFunc(), sparsity=td.KnownSparsity(pattern)), torch.randn(6))
    assert prep.runner.reads is None


# -- torchdi.reads on its own ------------------------------------------------------------------

COUNTER = [1, 2]
TABLE = {"a": 1}
ARRAY = np.zeros(3)


class Holder:
    scale = 2.0

    @classmethod
    def make(cls) -> float:
        return cls.scale

    def value(self) -> float:
        return self.scale


def test_reads_sees_each_kind_of_change(monkeypatch: pytest.MonkeyPatch) -> None:
    def reads_list(x: Any) -> Any:
        return COUNTER[0] + x

    def reads_dict(x: Any) -> Any:
        return TABLE["a"] + x

    def reads_array(x: Any) -> Any:
        return ARRAY.sum() + x

    def reads_class(x: Any) -> Any:
        return Holder.make() + x

    cases: list[tuple[Any, Callable[[], None]]] = [
        (reads_list, lambda: COUNTER.__setitem__(0, 5)),
        (reads_list, lambda: COUNTER.append(3)),
        (reads_dict, lambda: TABLE.__setitem__("a", 2)),
        (reads_array, lambda: ARRAY.__setitem__(0, 1.0)),
        (reads_class, lambda: monkeypatch.setattr(Holder, "scale", 3.0)),
        (reads_class, lambda: monkeypatch.setattr(Holder, "make", classmethod(lambda cls: 0.0))),
    ]
    for f, change in cases:
        reads = Reads.of(f)
        assert reads is not None and not reads.changed(), f
        assert not reads.changed()  # a classmethod read twice is the same place (no new binding)
        change()
        assert reads.changed(), f
        monkeypatch.undo()
    COUNTER[:] = [1, 2]
    TABLE["a"] = 1
    ARRAY[:] = 0.0


def test_reads_of_a_bound_method_and_empty_cell() -> None:
    holder = Holder()
    reads = Reads.of(holder.value)
    assert reads is not None and not reads.changed()
    holder.scale = 4.0  # an instance attribute now shadows the class's
    assert reads.changed()

    def outer() -> Callable[[], Any]:
        def inner() -> Any:
            return later  # (a free variable whose cell is still empty)

        watched = Reads.of(inner)
        assert watched is not None and not watched.changed()
        later = 1
        assert watched.changed()
        return inner

    outer()


def test_a_strict_false_variant_is_watched_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strict=False call with another dtype prepares a variant with the same pattern and colours
    (a TracedColoring): it is traced again with its first colouring settings when f's reads change."""
    backend = td.AutoSparse(td.AutoFunc(), coloring=td.GreedyColoring(order="largest_first"))
    prep = td.prepare_jacobian(rolled, backend, torch.randn(6, dtype=torch.float64), strict=False)
    x32 = torch.randn(6, dtype=torch.float32)
    torch.testing.assert_close(td.jacobian(rolled, backend, x32, prep=prep).to_dense(), torch.autograd.functional.jacobian(rolled, x32))
    monkeypatch.setattr(module_this(), "SHIFT", 2)
    torch.testing.assert_close(td.jacobian(rolled, backend, x32, prep=prep).to_dense(), torch.autograd.functional.jacobian(rolled, x32))
    variant = next(iter(prep.variants.values()))
    assert variant.runner.backend.coloring == td.GreedyColoring(order="largest_first")


def test_a_users_known_coloring_is_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KnownColoring the user passes is their promise: not traced again (nor in its variants)."""
    known = td.prepare_jacobian(rolled, td.AutoSparse(td.AutoFunc()), torch.randn(6)).known_coloring
    backend = td.AutoSparse(td.AutoFunc(), coloring=known)
    prep = td.prepare_jacobian(rolled, backend, torch.randn(6, dtype=torch.float64), strict=False)
    td.jacobian(rolled, backend, torch.randn(6, dtype=torch.float32), prep=prep)
    assert prep.runner.reads is None
    assert all(variant.runner.reads is None for variant in prep.variants.values())


def test_reads_without_version_counters_compares_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence's fallback (a torch without ``_version``): tensors are compared by value."""
    monkeypatch.setattr(fence, "VERSION_COUNTER", None)
    weights = torch.eye(6, dtype=torch.float64)
    monkeypatch.setattr(module_this(), "WEIGHTS", weights)
    reads = Reads.of(through_weights)
    assert reads is not None and not reads.changed()
    weights.add_(0.0)  # a write that changes no value: no change
    assert not reads.changed()
    weights[0, 1] = 1.0
    assert reads.changed()


def rolled_by(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * x.roll(k)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_static_context_value_that_changes_the_pattern(name: str, strict: bool) -> None:
    """An int context is static: the tracer reads its value (x.roll(k)); eager backends' strict
    check (and strict=False on all) let it change, so the pattern is traced again for a new k."""
    backend = BACKENDS[name]()
    x = torch.randn(6, dtype=torch.float64)
    prep = td.prepare_jacobian(rolled_by, backend, x, td.Constant(1), strict=strict)
    try:
        result = td.jacobian(rolled_by, backend, x, td.Constant(2), prep=prep).to_dense()
    except td.PreparationMismatchError:  # a compiled backend's strict check compares static values
        assert strict and name == "compile"
        return
    torch.testing.assert_close(result, torch.autograd.functional.jacobian(lambda x_: rolled_by(x_, 2), x))
    torch.testing.assert_close(
        td.jacobian(rolled_by, backend, x, td.Constant(1), prep=prep).to_dense(), torch.autograd.functional.jacobian(lambda x_: rolled_by(x_, 1), x)
    )


def test_reads_of_a_module_sees_a_swapped_submodule_and_a_new_hook() -> None:
    layer = Layer()
    reads = Reads.of(layer)
    assert reads is not None and not reads.changed()
    layer.lin = torch.nn.Linear(6, 6, bias=False, dtype=torch.float64)
    assert reads.changed()
    reads = Reads.of(layer)
    assert reads is not None and not reads.changed()
    handle = layer.register_forward_hook(lambda module, args, out: out * 2)
    assert reads.changed()
    handle.remove()
    assert not reads.changed()
