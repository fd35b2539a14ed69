"""Issue 23, the sparse items (1, 2, 12, 14, 15, 18) and the no-dependence warning (19).

Each test compares with dense torch.func / torch.autograd results, on every backend the item
concerns; compiled coverage uses ``AutoCompile(compiler="aot_eager")``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torchdi as td
import torchdi.engines.sparse as sparse_engine
from torchdi.sparsity.index_sets import IndexSets
from torchdi.sparsity.tracer import TracerResult
from torchdi.testing.sparse_scenarios import sparse_scenarios

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")

DENSE = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(compiler="aot_eager"),
}
ON_DENSE = pytest.mark.parametrize("name", list(DENSE))


# The tracer's fallback warning as an error: a right pattern must not need the fallback.
NO_FALLBACK = pytest.mark.filterwarnings("error:TracerSparsity")


# --- item 1: writes into slices, traced through a gradient --------------------------------------


def shifted_products(x):
    y = torch.zeros(6, dtype=x.dtype)
    y[1:] = x[:-1] * x[1:]
    return (y**2).sum()


def scaled_slice(x):
    y = x.clone()
    y[2:4] = y[2:4] * 3
    return (y**3).sum()


def scaled_column(x):
    Y = x.reshape(3, 2).clone()
    Y[:, 1] = Y[:, 1] * 2
    return (Y**3).sum()


def zeroed_tail(x):
    y = x.clone()
    y[4:] = 0.0
    return (y**3).sum()


def scaled_column_of_transpose(x):  # the written tensor is not contiguous: strides matter
    Y = x.reshape(3, 2).t() * 1.0
    Y[:, 1] = Y[:, 1] * 2
    return (Y**3 * torch.arange(1.0, 7.0, dtype=x.dtype).reshape(2, 3)).sum()


SLICE_WRITES = [shifted_products, scaled_slice, scaled_column, zeroed_tail, scaled_column_of_transpose]


@NO_FALLBACK
@ON_DENSE
@pytest.mark.parametrize("f", SLICE_WRITES, ids=lambda f: f.__name__)
def test_item01_sparse_hessian_of_slice_writes(name, f):
    x = torch.randn(6, dtype=torch.float64)
    hess = td.hessian(f, td.AutoSparse(DENSE[name]), x)
    torch.testing.assert_close(hess.to_dense(), torch.func.hessian(f)(x))


@NO_FALLBACK
@ON_DENSE
@pytest.mark.parametrize("f", [shifted_products, scaled_column], ids=lambda f: f.__name__)
def test_item01_sparse_jacobian_of_a_function_calling_grad(name, f):
    def g(x):
        return torch.func.grad(f)(x)

    x = torch.randn(6, dtype=torch.float64)
    jac = td.jacobian(g, td.AutoSparse(DENSE[name]), x)
    torch.testing.assert_close(jac.to_dense(), torch.func.jacrev(g)(x))


@pytest.mark.parametrize("hessian", [False, True], ids=["jacobian", "hessian"])
@pytest.mark.parametrize("name", ["autograd", "func"])
def test_item01_a_pattern_missing_nonzeros_is_caught_at_preparation(monkeypatch, name, hessian):
    # Whatever the tracer gets wrong, the numerical check at preparation sees the missing
    # entries: the result falls back to the dense pattern (correct), with a warning.
    def only_diagonal(f, x, contexts, hessian=False):
        n = x.numel()
        m = n if hessian else n - 1  # torch.diff
        return TracerResult(IndexSets.from_pairs(np.arange(m), np.arange(m), m, n))

    monkeypatch.setattr(sparse_engine, "trace_sparsity", only_diagonal)
    x = torch.randn(6, dtype=torch.float64)
    backend = td.AutoSparse(DENSE[name])
    with pytest.warns(UserWarning, match=r"(?s)TracerSparsity: the traced .* misses non-zeros.*dense"):
        if hessian:
            prep = td.prepare_hessian(shifted_products, backend, x)
        else:
            prep = td.prepare_jacobian(torch.diff, backend, x)
    x2 = torch.randn(6, dtype=torch.float64)
    if hessian:
        got, want = td.hessian(shifted_products, backend, x2, prep=prep), torch.func.hessian(shifted_products)(x2)
    else:
        got, want = td.jacobian(torch.diff, backend, x2, prep=prep), torch.func.jacrev(torch.diff)(x2)
    torch.testing.assert_close(got.to_dense(), want)
    assert prep.sparsity_pattern.to_dense().all()


@pytest.mark.parametrize(("forward_cost", "family"), [(0, "pushforward"), (100, "pullback")])
def test_item01_the_check_catches_missing_nonzeros_in_either_direction(monkeypatch, forward_cost, family):
    # The check runs in the cheaper direction; both directions must see what the pattern lacks.
    import torchdi.engines.sparse_check as sparse_check

    def wide_band(f, x, contexts, hessian=False):  # torch.diff's pattern without its superdiagonal
        return TracerResult(IndexSets.from_pairs(np.arange(5), np.arange(5), 5, 6))

    used = []
    probe = sparse_check._probe
    monkeypatch.setattr(sparse_check, "_FORWARD_COST", forward_cost)
    monkeypatch.setattr(sparse_check, "_probe", lambda pattern, backend, fam, *rest: used.append(fam) or probe(pattern, backend, fam, *rest))
    monkeypatch.setattr(sparse_engine, "trace_sparsity", wide_band)
    with pytest.warns(UserWarning, match=r"(?s)TracerSparsity: the traced jacobian pattern misses non-zeros"):
        prep = td.prepare_jacobian(torch.diff, td.AutoSparse(td.AutoFunc()), torch.randn(6, dtype=torch.float64))
    assert used == [family]
    x = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(td.jacobian(torch.diff, td.AutoSparse(td.AutoFunc()), x, prep=prep).to_dense(), torch.func.jacrev(torch.diff)(x))


@NO_FALLBACK
@pytest.mark.parametrize("name", ["func", "finitediff"])
@pytest.mark.parametrize(
    "scenario",
    sparse_scenarios(sizes=(8,)) + sparse_scenarios(sizes=(8,), dtype=torch.float32),
    ids=lambda s: f"{s.name}-{s.x.dtype}".replace("torch.", ""),
)
def test_item01_the_check_is_silent_on_right_patterns(name, scenario):
    # No false alarm, with exact passes or with finite differences' coarser ones.
    dense = td.AutoFiniteDiff() if name == "finitediff" else DENSE[name]
    prepare = td.prepare_jacobian if scenario.op == "jacobian" else td.prepare_hessian
    prep = prepare(scenario.f, td.AutoSparse(dense), scenario.x)
    assert not prep.sparsity_pattern.to_dense().all()


# --- item 2: float and numpy Constants are never read --------------------------------------------


CONSTANT_USES = {
    "torch.tensor": (lambda x, c: x * torch.tensor(c, dtype=x.dtype), 0.0, 3.0),
    "torch.full": (lambda x, c: x * torch.full(x.shape, c, dtype=x.dtype), 0.0, 3.0),
    "numpy": (lambda x, a: x * torch.as_tensor(a, dtype=x.dtype), np.array([0.0, 1.0, 0.0, 2.0]), np.array([1.0, 2.0, 3.0, 4.0])),
    "numpy method": (
        lambda x, a: x * torch.from_numpy(a.astype(np.float64)),
        np.array([0.0, 1.0, 0.0, 2.0]),
        np.array([1.0, 2.0, 3.0, 4.0]),
    ),
}


@pytest.mark.parametrize(
    "name, use",
    # Compiled backends hand numpy Constants to f as tensors: no .astype there (translation note).
    [(name, use) for name in DENSE for use in CONSTANT_USES if not (name == "compile" and use == "numpy method")],
)
def test_item02_tracer_does_not_bake_constant_values(name, use):
    g, at_preparation, later = CONSTANT_USES[use]
    backend = td.AutoSparse(DENSE[name])
    x = torch.rand(4, dtype=torch.float64)
    prep = td.prepare_jacobian(g, backend, x, td.Constant(at_preparation))
    jac = td.jacobian(g, backend, x, td.Constant(later), prep=prep)
    torch.testing.assert_close(jac.to_dense(), torch.func.jacrev(g)(x, later))


@ON_DENSE
def test_item02_module_constant_parameters_are_not_read(name):
    # Frozen parameters: with trainable ones under grad mode the sparse result would be an outer
    # derivative's input too, which AutoSparse refuses at once (rule 10).
    zeroed = torch.nn.Linear(4, 4, dtype=torch.float64).requires_grad_(False)
    trained = torch.nn.Linear(4, 4, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        zeroed.weight.zero_()
    backend = td.AutoSparse(DENSE[name])
    x = torch.rand(4, dtype=torch.float64)

    def g(x, model):
        return model(x)

    prep = td.prepare_jacobian(g, backend, x, td.Constant(zeroed))
    jac = td.jacobian(g, backend, x, td.Constant(trained), prep=prep)
    torch.testing.assert_close(jac.to_dense(), trained.weight.detach())


# --- item 12: gradient with a State passes through AutoSparse --------------------------------------


def _counting_loss(x, state):
    state.add_(1.0)
    return (x**3).sum()


@ON_DENSE
def test_item12_gradient_with_state_passes_through(name):
    x = torch.rand(5, dtype=torch.float64)
    backend = td.AutoSparse(DENSE[name])
    state = torch.zeros(())
    prep = td.prepare_gradient(_counting_loss, backend, x, td.State(state))
    assert state.item() == 0.0  # preparation leaves States alone
    grad = td.gradient(_counting_loss, backend, x, td.State(state), prep=prep)
    torch.testing.assert_close(grad, 3 * x**2)
    assert state.item() == 1.0
    value, grad = td.value_and_gradient(_counting_loss, backend, x, td.State(state))
    torch.testing.assert_close(value, (x**3).sum())
    assert state.item() == 2.0
    with pytest.raises(td.UnsupportedOperatorError, match="State"):
        td.hessian(_counting_loss, backend, x, td.State(state))


# --- item 14: empty x or f(x) ----------------------------------------------------------------------


@ON_DENSE
@pytest.mark.parametrize(
    "case",
    ["empty x", "empty f(x)", "empty x hessian"],
)
def test_item14_empty_problems_give_csr_and_prep_attributes(name, case):
    backend = td.AutoSparse(DENSE[name])
    if case == "empty x":
        f, x, shape = (lambda x: x * 2), torch.zeros(0), (0, 0)
        prep = td.prepare_jacobian(f, backend, x)
        result = td.jacobian(f, backend, x, prep=prep)
    elif case == "empty f(x)":
        f, x, shape = (lambda x: x[:0] * 2), torch.rand(3), (0, 3)
        prep = td.prepare_jacobian(f, backend, x)
        result = td.jacobian(f, backend, x, prep=prep)
    else:
        f, x, shape = (lambda x: x.sum() + 1.0), torch.zeros(0), (0, 0)
        prep = td.prepare_hessian(f, backend, x)
        result = td.hessian(f, backend, x, prep=prep)
    assert result.layout == torch.sparse_csr and tuple(result.shape) == shape
    assert prep.ncolors == 0 and tuple(prep.sparsity_pattern.shape) == shape and prep.sparsity_pattern.values().numel() == 0


# --- item 15: a dense out= for a sparse result ------------------------------------------------------


def test_item15_dense_out_for_a_sparse_jacobian_is_explained():
    backend = td.AutoSparse(td.AutoFunc())
    x = torch.rand(6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"(?s)out= for a sparse result must be the CSR tensor.*previous"):
        td.jacobian(torch.diff, backend, x, out=torch.zeros(5, 6, dtype=torch.float64))
    out = td.jacobian(torch.diff, backend, x)
    assert td.jacobian(torch.diff, backend, x * 2, out=out) is out  # the CSR of a previous result works


# --- item 18: KnownSparsity's shape message ---------------------------------------------------------


def test_item18_known_sparsity_names_each_shape_once():
    backend = td.AutoSparse(td.AutoFunc(), sparsity=td.KnownSparsity(torch.ones(6, 6)))
    with pytest.raises(ValueError, match=r"expected shape \(5, 6\)$"):
        td.jacobian(torch.diff, backend, torch.rand(6))
    two = td.AutoSparse(td.AutoFunc(), sparsity=td.KnownSparsity(torch.ones(3, 3)))
    with pytest.raises(ValueError, match=r"expected shape \(4, 6\) or \(2, 2, 6\)$"):
        td.jacobian(lambda x: x[:4].reshape(2, 2), two, torch.rand(6))


# --- item 19: f does not depend on x -----------------------------------------------------------------

BACKENDS_19 = {**DENSE, "finitediff": td.AutoFiniteDiff(), "sparse": td.AutoSparse(td.AutoFunc())}


def _model_and_batch():
    # Frozen: a compiled backend refuses at once (rule 10) a call whose f reads trainable
    # parameters under grad mode, which is this slip's other symptom.
    model = torch.nn.Linear(3, 1, dtype=torch.float64).requires_grad_(False)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, params, torch.randn(5, 3, dtype=torch.float64)


@pytest.mark.parametrize("name", list(BACKENDS_19))
def test_item19_warns_once_when_f_ignores_x(name):
    backend = BACKENDS_19[name]
    model, params, batch = _model_and_batch()

    def forgot_functional_call(p, b):
        return (model(b) ** 2).mean()

    def right(p, b):
        return (torch.func.functional_call(model, p, (b,)) ** 2).mean()

    if name == "sparse":  # AutoSparse's own operators: a jacobian of a vector
        x = torch.rand(4, dtype=torch.float64)
        with pytest.warns(UserWarning, match="functional_call"):
            prep = td.prepare_jacobian(lambda x: torch.ones(3, dtype=x.dtype), backend, x)
        assert td.jacobian(lambda x: torch.ones(3, dtype=x.dtype), backend, x).values().numel() == 0
        return
    with pytest.warns(UserWarning, match=r"does not depend on x.*functional_call"):
        prep = td.prepare_gradient(forgot_functional_call, backend, params, td.Constant(batch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not at call time, and never for an f that uses x
        td.gradient(forgot_functional_call, backend, params, td.Constant(batch), prep=prep)
        prep = td.prepare_gradient(right, backend, params, td.Constant(batch))
        grad = td.gradient(right, backend, params, td.Constant(batch), prep=prep)
    want = torch.func.grad(right)(params, batch)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if name != "finitediff" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(grad, want, **tolerance)


def test_item19_no_warning_for_a_function_finite_differences_see_through():
    # x reaches f's output through numpy: autograd cannot see it, finite differences can.
    def through_numpy(x):
        return torch.from_numpy(np.sin(x.detach().numpy())).sum()

    x = torch.rand(3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grad = td.gradient(through_numpy, td.AutoFiniteDiff(), x)
    torch.testing.assert_close(grad, torch.cos(x), rtol=1e-5, atol=1e-6)
