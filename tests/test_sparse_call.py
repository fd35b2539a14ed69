"""The prepared AutoSparse call (issue 26): each result owns its index tensors, and the one
compiled program still follows every change dynamo guards on (rule 7).

Each test compares with dense ``torch.autograd`` results; compiled coverage uses
``AutoCompile(compiler="aot_eager")``, and one test compiles with inductor for the options the
sparse program adds.
"""

from __future__ import annotations

import logging

import pytest
import torch

import torchdi as td
from torchdi.engines.sparse import _fused_backend
from torchdi.sparsity import _private
from torchdi.testing.sparse_scenarios import chained_rosenbrock, diff_square

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")

DENSE = {
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(compiler="aot_eager"),
}
ON_DENSE = pytest.mark.parametrize("name", list(DENSE))


def dense_jacobian(f, x):
    return torch.autograd.functional.jacobian(f, x).reshape(-1, x.numel())


def dense_hessian(f, x):
    return torch.autograd.functional.hessian(f, x)


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def other_pattern_like(matrix):
    """A CSR matrix of the same shape and number of entries on another pattern (rows reversed)."""
    rows = torch.repeat_interleave(torch.arange(matrix.shape[0]), matrix.crow_indices().diff())
    mask = torch.zeros(matrix.shape, dtype=torch.bool)
    mask[rows, matrix.col_indices()] = True
    return torch.full(matrix.shape, 7.0, dtype=matrix.dtype).where(mask.flip(0), 0.0).to_sparse_csr()


# ----------------------------------------------------------------------------------------------
# Each result's index tensors are its own


@ON_DENSE
@pytest.mark.parametrize("hessian", [False, True], ids=["jacobian", "hessian"])
def test_in_place_methods_of_a_result_do_not_reach_later_results(name, hessian):
    # A CSR tensor's zero_() empties col_indices and zeroes crow_indices in place, and copy_
    # copies another pattern into them: on index tensors shared by every result of a preparation
    # (as they were), the next call returned a broken or silently wrong matrix.
    backend = td.AutoSparse(DENSE[name])
    f = chained_rosenbrock if hessian else diff_square
    x = torch.rand(12, dtype=torch.float64) + 0.5
    operator = td.hessian if hessian else td.jacobian
    want = (dense_hessian if hessian else dense_jacobian)(f, x)
    prep = (td.prepare_hessian if hessian else td.prepare_jacobian)(f, backend, x)
    first = operator(f, backend, x, prep=prep)
    second = operator(f, backend, x, prep=prep)
    for a, b in ((first.crow_indices(), second.crow_indices()), (first.col_indices(), second.col_indices())):
        assert not same_storage(a, b)
    first.zero_()
    assert first.values().numel() == 0
    assert torch.equal(second.to_dense(), want)  # an earlier result is untouched too
    assert torch.equal(operator(f, backend, x, prep=prep).to_dense(), want)
    third = operator(f, backend, x, prep=prep)
    other = other_pattern_like(third)
    assert not torch.equal(other.col_indices(), third.col_indices())
    third.copy_(other)
    assert torch.equal(third.col_indices(), other.col_indices())
    fourth = operator(f, backend, x, prep=prep)
    fourth.col_indices()[0] = fourth.shape[1] - 1  # a write straight into a result's indices
    fourth.crow_indices()[1:] = 0
    later = operator(f, backend, x, prep=prep)
    assert torch.equal(later.to_dense(), want)
    assert torch.equal(prep.sparsity_pattern.to_dense(), want != 0)


@ON_DENSE
def test_out_reuse_fills_values_and_keeps_later_results_apart(name):
    backend = td.AutoSparse(DENSE[name])
    x = torch.rand(10, dtype=torch.float64)
    prep = td.prepare_jacobian(diff_square, backend, x)
    out = td.jacobian(diff_square, backend, x, prep=prep)
    values = out.values()
    for shift in (0.25, -0.5):
        returned = td.jacobian(diff_square, backend, x + shift, prep=prep, out=out)
        assert returned is out and out.values().data_ptr() == values.data_ptr()
        assert torch.allclose(out.to_dense(), dense_jacobian(diff_square, x + shift))
    plain = td.jacobian(diff_square, backend, x, prep=prep)
    assert not same_storage(plain.col_indices(), out.col_indices())
    out.zero_()  # the out= buffer is the user's: emptying it leaves the preparation whole
    assert torch.allclose(td.jacobian(diff_square, backend, x, prep=prep).to_dense(), dense_jacobian(diff_square, x))


# ----------------------------------------------------------------------------------------------
# The one compiled program follows what dynamo guards on


SCALE = 2.0


def scaled_by_global(x):
    return SCALE * x[1:] * x[:-1]


def rosenbrock_scaled_by_global(x):
    return SCALE * chained_rosenbrock(x)


def test_changed_global_recompiles_and_is_followed():
    global SCALE
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    x = torch.rand(9, dtype=torch.float64)
    prep = td.prepare_jacobian(scaled_by_global, backend, x)
    hprep = td.prepare_hessian(rosenbrock_scaled_by_global, backend, x)
    before, hbefore = prep.num_compilations, hprep.num_compilations
    try:
        SCALE = -3.0
        got = td.jacobian(scaled_by_global, backend, x, prep=prep)
        assert torch.allclose(got.to_dense(), dense_jacobian(scaled_by_global, x))
        assert prep.num_compilations == before + 1  # raw torch.compile recompiles here too
        value, grad, hess = td.value_gradient_and_hessian(rosenbrock_scaled_by_global, backend, x, prep=hprep)
        assert torch.allclose(hess.to_dense(), dense_hessian(rosenbrock_scaled_by_global, x))
        assert torch.allclose(value, rosenbrock_scaled_by_global(x))
        assert torch.allclose(grad, torch.func.grad(rosenbrock_scaled_by_global)(x))
        assert hprep.num_compilations > hbefore
    finally:
        SCALE = 2.0
    again = td.jacobian(scaled_by_global, backend, x + 1, prep=prep)
    assert torch.allclose(again.to_dense(), dense_jacobian(scaled_by_global, x + 1))


def test_changed_closure_cell_and_closed_over_tensor_are_followed():
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    factor = 1.5
    weights = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)

    def f(x):
        return factor * weights[1:] * x[1:] * x[:-1]

    x = torch.rand(8, dtype=torch.float64)
    prep = td.prepare_jacobian(f, backend, x)
    before = prep.num_compilations
    weights.mul_(-2.0)  # a tensor's values: an input of the program, no recompilation
    assert torch.allclose(td.jacobian(f, backend, x, prep=prep).to_dense(), dense_jacobian(f, x))
    assert prep.num_compilations == before
    factor = -0.25  # the cell's float: dynamo guards on it and recompiles
    assert torch.allclose(td.jacobian(f, backend, x, prep=prep).to_dense(), dense_jacobian(f, x))
    assert prep.num_compilations == before + 1
    for shift in (0.5, -1.0):  # other points, the same program
        assert torch.allclose(td.jacobian(f, backend, x + shift, prep=prep).to_dense(), dense_jacobian(f, x + shift))
    assert prep.num_compilations == before + 1


def test_value_and_jacobian_and_inputs_untouched_on_the_compiled_path():
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    x = torch.rand(7, dtype=torch.float64)
    prep = td.prepare_jacobian(diff_square, backend, x)
    z = torch.rand(7, dtype=torch.float64)
    kept = z.clone()
    y, jac = td.value_and_jacobian(diff_square, backend, z, prep=prep)
    assert torch.equal(z, kept)
    assert torch.allclose(y, diff_square(z)) and torch.allclose(jac.to_dense(), dense_jacobian(diff_square, z))
    assert jac.crow_indices().dtype == jac.col_indices().dtype == torch.int64


@pytest.mark.parametrize("hessian", [False, True], ids=["jacobian", "hessian"])
def test_the_one_program_is_refused_under_vmap_and_outer_autograd(hessian):
    # A CSR result cannot carry a vmap batch or an autograd graph: a clear refusal, never a
    # detached or unbatched matrix from the prepared program.
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    f = chained_rosenbrock if hessian else diff_square
    operator = td.hessian if hessian else td.jacobian
    x = torch.rand(3, 6, dtype=torch.float64)
    prep = (td.prepare_hessian if hessian else td.prepare_jacobian)(f, backend, x[0])
    with pytest.raises(td.UnsupportedOperatorError):
        torch.func.vmap(lambda z: operator(f, backend, z, prep=prep).to_dense())(x)
    with pytest.raises(td.UnsupportedOperatorError):
        operator(f, backend, x[0].clone().requires_grad_(), prep=prep)
    assert torch.allclose(operator(f, backend, x[1], prep=prep).to_dense(), (dense_hessian if hessian else dense_jacobian)(f, x[1]))


@pytest.mark.parametrize("hessian", [False, True], ids=["jacobian", "hessian"])
def test_layout_dtype_and_shape_of_x_on_the_compiled_path(hessian):
    # The plain prepared call goes straight from the operator to the one program's guards: another
    # memory layout is copied to the compiled one, another dtype or shape is refused by the strict
    # check (strict=False: prepared again for another dtype with the same pattern and colouring, one
    # more compilation; another shape refused, the pattern is per shape), never a stale matrix.
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    f = chained_rosenbrock if hessian else diff_square
    operator = td.hessian if hessian else td.jacobian
    dense = dense_hessian if hessian else dense_jacobian
    prepare = td.prepare_hessian if hessian else td.prepare_jacobian
    x = torch.rand(12, dtype=torch.float64) + 0.5
    prep = prepare(f, backend, x)
    before = prep.num_compilations
    strided = (torch.rand(24, dtype=torch.float64) + 0.5)[::2]
    assert torch.allclose(operator(f, backend, strided, prep=prep).to_dense(), dense(f, strided))
    assert prep.num_compilations == before
    for other in (x.float(), torch.rand(13, dtype=torch.float64) + 0.5):
        with pytest.raises(td.PreparationMismatchError, match="x: mismatch"):
            operator(f, backend, other, prep=prep)
    assert torch.allclose(operator(f, backend, x, prep=prep).to_dense(), dense(f, x))
    loose = prepare(f, backend, x, strict=False)
    single = x.float() - 0.25
    got = operator(f, backend, single, prep=loose)
    assert got.dtype == torch.float32  # (the float64 seeds of the preparation made a float64 hessian)
    torch.testing.assert_close(got.to_dense(), dense(f, single))
    assert loose.num_compilations == before + 1
    with pytest.raises(td.PreparationMismatchError, match=r"x: mismatch: expected Tensor\(shape=\(12,\).*received Tensor\(shape=\(13,\)"):
        operator(f, backend, torch.rand(13, dtype=torch.float64), prep=loose)


def test_the_transformed_code_calls_no_profiler_markers_and_runs_under_the_profiler():
    # record_runtime_overhead is off while torchdi compiles: dynamo's transformed bytecode then
    # calls no "pregraph bytecode" markers (two calls per call, read by torch.profiler alone).
    backend = td.AutoSparse(td.AutoCompile(compiler="aot_eager"))
    x = torch.rand(9, dtype=torch.float64)
    prep = td.prepare_jacobian(diff_square, backend, x)
    cache = prep.runner.fused._cache
    assert cache.fast and cache.entries
    names = {name for _, transformed in cache.entries for name in transformed.__code__.co_names}
    assert not {name for name in names if name.startswith("record_pregraph")}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        got = td.jacobian(diff_square, backend, x + 0.5, prep=prep)
    assert torch.allclose(got.to_dense(), dense_jacobian(diff_square, x + 0.5))
    assert prep.num_compilations == 1


# ----------------------------------------------------------------------------------------------
# The inductor options of the sparse program


def test_fused_backend_adds_scalar_loop_tails_under_the_users_options(monkeypatch):
    knob = "cpp.enable_loop_tail_vec"
    assert _fused_backend(td.AutoCompile()).options == {knob: False}
    user = td.AutoCompile(options={knob: True, "cpp_wrapper": False})
    assert _fused_backend(user).options == {knob: True, "cpp_wrapper": False}  # the user's own value wins
    for untouched in (td.AutoCompile(compiler="aot_eager"), td.AutoCompile(mode="max-autotune-no-cudagraphs")):
        assert _fused_backend(untouched) is untouched  # another compiler, or a mode (which takes no options)
    monkeypatch.setattr(_private, "_LOOP_TAIL_KNOB", None)  # a torch without the knob
    monkeypatch.setattr(_private.fence, "warned", set())
    plain = td.AutoCompile()
    assert _fused_backend(plain) is plain
    assert "loop_tail_vec" in _private.fence.warned


def test_inductor_sparse_program_equals_dense(caplog):
    backend = td.AutoSparse(td.AutoCompile())
    x = 1 + 0.1 * torch.rand(3, 3, 2, dtype=torch.float64)  # a last dimension of 2: every loop a tail

    def reaction(u):
        return torch.stack([u[..., 0] * u[..., 1].roll(1, 0), u[..., 1] - u[..., 0].roll(-1, 1) ** 2], dim=-1)

    with caplog.at_level(logging.WARNING, logger="torchdi"):
        prep = td.prepare_jacobian(reaction, backend, x)
    assert not [r for r in caplog.records if "loop_tail_vec" in r.getMessage()]
    assert prep.num_compilations == 1
    for shift in (0.0, 0.3):
        got = td.jacobian(reaction, backend, x + shift, prep=prep)
        torch.testing.assert_close(got.to_dense(), dense_jacobian(reaction, x + shift))
    assert prep.num_compilations == 1
