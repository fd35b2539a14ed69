"""AutoCompile: every operator compiled once, no recompilation when values change (rule 2)."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import numpy as np
import pytest
import torch

import torchdi as td
from torchdi.testing.scenarios import OPERATORS

AOT = td.AutoCompile(compiler="aot_eager")
INDUCTOR = td.AutoCompile()
REFERENCE = td.AutoAutograd()


def _close(a, b, atol=1e-5, rtol=1e-4):
    a_leaves, b_leaves = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(a_leaves) == len(b_leaves)
    for u, v in zip(a_leaves, b_leaves):
        torch.testing.assert_close(u, v, atol=atol, rtol=rtol)


def scalar_loss(x, scale, buf):
    buf.copy_(torch.tanh(x) * scale)
    return (buf**2).sum() + (x**3).sum()


def vector_map(x, scale):
    return torch.sin(x) * scale + x.flip(0) ** 2


def dict_loss(p, scale):
    return (torch.tanh(p["w"] @ p["v"]) * scale).sum() + (p["v"] ** 2).sum()


def cubic(t, scale):
    return torch.stack([t**3 * scale, torch.sin(t)])


def _point(seed, shape=(5,)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _dict_point(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "v": torch.randn(4, generator=g)}


# (operator family, function, x maker, contexts maker(seed), tangents maker(x) or None)
CASES = {
    "gradient": (scalar_loss, _point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(5))), None),
    "gradient-dict": (dict_loss, _dict_point, lambda s: (td.Constant(0.5 * s),), None),
    "pullback": (vector_map, _point, lambda s: (td.Constant(2.0 + s),), lambda x: (torch.ones_like(x), x.clone())),
    "pushforward": (vector_map, _point, lambda s: (td.Constant(2.0 + s),), lambda x: (torch.ones_like(x), x.clone())),
    "pushforward-dict": (dict_loss, _dict_point, lambda s: (td.Constant(0.5 * s),), lambda x: (x,)),
    "jacobian": (vector_map, _point, lambda s: (td.Constant(2.0 + s),), None),
    "hvp": (scalar_loss, _point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(5))), lambda x: (x.clone(), torch.ones_like(x))),
    "hvp-dict": (dict_loss, _dict_point, lambda s: (td.Constant(0.5 * s),), lambda x: (x,)),
    "hessian": (scalar_loss, _point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(5))), None),
    "derivative": (cubic, lambda s: _point(s, ()), lambda s: (td.Constant(1.0 + s),), None),
    "second_derivative": (cubic, lambda s: _point(s, ()), lambda s: (td.Constant(1.0 + s),), None),
}

VARIANTS = {
    "gradient": ("gradient", "value_and_gradient"),
    "pullback": ("pullback", "value_and_pullback"),
    "pushforward": ("pushforward", "value_and_pushforward"),
    "jacobian": ("jacobian", "value_and_jacobian"),
    "hvp": ("hvp", "gradient_and_hvp"),
    "hessian": ("hessian", "value_gradient_and_hessian"),
    "derivative": ("derivative", "value_and_derivative"),
    "second_derivative": ("second_derivative", "value_derivative_and_second_derivative"),
}


def graphs(family):
    """Graphs a preparation compiles: one, serving the plain operator and its value_ variant
    (rule 2: no call compiles anything after prepare_*)."""
    return 1


@pytest.mark.parametrize("plain_first", [True, False])
def test_plain_gradient_and_value_and_gradient_share_the_prepared_program(plain_first):
    x = _point(0)
    contexts = (td.Constant(1.0), td.Cache(torch.empty(5)))
    prep = td.prepare_gradient(scalar_loss, AOT, x, *contexts)
    assert prep.num_compilations == 1
    for seed in (1, 2) if plain_first else (2, 1):
        x = _point(seed)
        if seed == 1:
            grad = td.gradient(scalar_loss, AOT, x, *contexts, prep=prep)
            _close(grad, td.gradient(scalar_loss, REFERENCE, x, *contexts))
        else:
            y, g = td.value_and_gradient(scalar_loss, AOT, x, *contexts, prep=prep)
            _close((y, g), td.value_and_gradient(scalar_loss, REFERENCE, x, *contexts))
        assert prep.num_compilations == 1  # before this release: 2 after the first plain gradient
    assert prep.runner.fast_path


def _call(name, f, backend, x, tangents, contexts, prep):
    op = getattr(td, name)
    if tangents is None:
        return op(f, backend, x, *contexts, prep=prep)
    return op(f, backend, x, tangents, *contexts, prep=prep)


@pytest.mark.parametrize("case", sorted(CASES))
def test_aot_eager_every_operator_prepared_elsewhere(case):
    family = case.split("-")[0]
    f, make_x, make_contexts, make_tangents = CASES[case]
    x0, x1 = make_x(0), make_x(1)
    t0 = None if make_tangents is None else make_tangents(x0)
    t1 = None if make_tangents is None else make_tangents(x1)
    prepare = getattr(td, f"prepare_{family}")
    prep = prepare(f, AOT, x0, *(() if t0 is None else (t0,)), *make_contexts(0))
    assert prep.num_compilations == graphs(family)
    for name in VARIANTS[family]:
        got = _call(name, f, AOT, x1, t1, make_contexts(1), prep)
        want = _call(name, f, REFERENCE, x1, t1, make_contexts(1), None)
        _close(got, want)
    assert prep.num_compilations == graphs(family)


@pytest.mark.parametrize("case", ["gradient", "hvp", "jacobian", "gradient-dict"])
def test_inductor_subset_matches_reference_without_recompiling(case):
    family = case.split("-")[0]
    f, make_x, make_contexts, make_tangents = CASES[case]
    x0 = make_x(0)
    t0 = None if make_tangents is None else make_tangents(x0)
    prep = getattr(td, f"prepare_{family}")(f, INDUCTOR, x0, *(() if t0 is None else (t0,)), *make_contexts(0))
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in range(1, 6):
            x = make_x(seed)
            t = None if make_tangents is None else make_tangents(x)
            got = _call(family, f, INDUCTOR, x, t, make_contexts(seed), prep)
            _close(got, _call(family, f, REFERENCE, x, t, make_contexts(seed), None), atol=1e-4)
    assert prep.num_compilations == graphs(family)


def with_numpy(x, c_float, c_tensor, c_array, buf):
    buf.copy_(x * c_tensor)
    return (buf * c_float).sum() + (x * torch.as_tensor(c_array)).sum() ** 2


def test_hundred_calls_with_new_values_never_recompile():
    x = _point(0)
    contexts = (td.Constant(1.5), td.Constant(torch.ones(5)), td.Constant(np.ones(5, dtype=np.float32)), td.Cache(torch.empty(5)))
    prep = td.prepare_gradient(with_numpy, AOT, x, *contexts)
    hvp_prep = td.prepare_hvp(with_numpy, AOT, x, (x,), *contexts)
    # 0.0 and 1.0 are special-cased by some tracers, equal values may share storage: use them too.
    floats = [0.0, 1.0, 1.0, -2.5, *[0.1 * i for i in range(96)]]
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, c in enumerate(floats):
            x = _point(i + 1)
            ctx = (
                td.Constant(c),
                td.Constant(_point(100 + i)),
                td.Constant(np.full(5, c, dtype=np.float32)),
                td.Cache(torch.empty(5)),
            )
            _close(td.gradient(with_numpy, AOT, x, *ctx, prep=prep), td.gradient(with_numpy, REFERENCE, x, *ctx))
            if i % 10 == 0:
                tangent = (_point(200 + i),)
                _close(td.hvp(with_numpy, AOT, x, tangent, *ctx, prep=hvp_prep), td.hvp(with_numpy, REFERENCE, x, tangent, *ctx))
    assert prep.num_compilations == graphs("gradient")
    assert hvp_prep.num_compilations == 1


def test_raw_torch_compile_does_recompile_on_a_new_float():
    """The baseline torchdi fixes: closing over nothing, a float argument is still specialized."""
    compilations = []

    def counting(graph, example_inputs):
        compilations.append(graph)
        return graph.forward

    def loss(x, c):
        return (x * c).sum()

    raw = torch.compile(torch.func.grad(loss), backend=counting, fullgraph=True)
    x = torch.randn(3)
    # Every raw torch.func.grad in the process shares one code object and so one recompile
    # limit: earlier tests must not have used it up.
    with torch._dynamo.config.patch(recompile_limit=10_000, accumulated_recompile_limit=10_000):
        for c in (0.5, 1.5, 2.5):
            raw(x, c)
    assert len(compilations) >= 2

    prep = td.prepare_gradient(loss, AOT, x, td.Constant(0.5))
    for c in (1.5, 2.5, 3.5):
        td.gradient(loss, AOT, x, td.Constant(c), prep=prep)
    assert prep.num_compilations == graphs("gradient")


def scaled_power(x, power):
    return (x**power).sum()


def test_static_int_is_checked_strictly_and_recompiles_visibly_when_not(caplog):
    x = _point(0)
    strict = td.prepare_gradient(scaled_power, AOT, x, td.Constant(2))
    with pytest.raises(td.PreparationMismatchError, match=r"context 1: mismatch.*static value 2.*static value 3"):
        td.gradient(scaled_power, AOT, x, td.Constant(3), prep=strict)

    loose = td.prepare_gradient(scaled_power, AOT, x, td.Constant(2), strict=False)
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        _, got = td.value_and_gradient(scaled_power, AOT, x, td.Constant(3), prep=loose)
    _close(got, 3 * x**2)  # never a stale result
    assert loose.num_compilations == 2
    assert "recompiled" in caplog.text and "L['contexts'][0] == 2" in caplog.text  # dynamo's words


def test_num_compilations_is_per_preparation():
    x = _point(0)
    first = td.prepare_gradient(scaled_power, AOT, x, td.Constant(2))
    preps = [td.prepare_gradient(lambda x_, p: (x_**p).sum(), AOT, x, td.Constant(2)) for _ in range(10)]
    assert first.num_compilations == 1
    assert [p.num_compilations for p in preps] == [1] * 10  # beyond dynamo's per-code recompile limit


def test_prep_keeps_no_reference_to_user_data():
    x, w = _point(0), _point(1)
    x_ref, w_ref = weakref.ref(x), weakref.ref(w)
    prep = td.prepare_gradient(lambda x_, c, w_: (x_ * c * w_).sum(), AOT, x, td.Constant(2.0), td.Constant(w))
    del x, w
    gc.collect()
    assert x_ref() is None and w_ref() is None
    assert prep.num_compilations == 1


def test_inputs_are_not_modified():
    x, w = _point(0), _point(1)
    x_before, w_before = x.clone(), w.clone()
    def f(x_, w_, b):
        return scalar_loss(x_ * w_, 1.0, b)

    prep = td.prepare_hvp(f, AOT, x, (x,), td.Constant(w), td.Cache(torch.zeros(5)))
    td.gradient_and_hvp(f, AOT, x, (x,), td.Constant(w), td.Cache(torch.zeros(5)), prep=prep)
    assert torch.equal(x, x_before) and torch.equal(w, w_before)


def breaks_graph(x):
    torch._dynamo.graph_break()
    return (x**2).sum()


def test_graph_break_is_reported_at_preparation_with_function_and_reason():
    with pytest.raises(RuntimeError, match=r"(?s)breaks_graph.*[Gg]raph break.*fullgraph=False"):
        td.prepare_gradient(breaks_graph, AOT, _point(0))
    loose = td.AutoCompile(compiler="aot_eager", fullgraph=False)
    prep = td.prepare_gradient(breaks_graph, loose, _point(0))
    _close(td.gradient(breaks_graph, loose, _point(1), prep=prep), 2 * _point(1))


def test_fast_path_reads_captured_tensors_live():
    x = _point(0)
    prep = td.prepare_gradient(scalar_loss, AOT, x, td.Constant(1.0), td.Cache(torch.empty(5)))
    assert prep.runner.fast_path

    captured = torch.randn(5)

    def uses_global(x_):
        return (x_ * captured).sum()

    prep_global = td.prepare_gradient(uses_global, AOT, x)
    captured.mul_(2)  # read live, as torch.compile does
    _close(td.value_and_gradient(uses_global, AOT, x, prep=prep_global)[1], captured)
    assert prep_global.num_compilations == 1


def test_module_constant_is_not_baked_in():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Dropout(0.5))
    model.eval()
    # Parameters that require grad would make the result a function of them too, which a compiled
    # backend refuses to hand to torch.autograd (DESIGN rule 10): this test is about values.
    model.requires_grad_(False)

    def loss(x, m):
        return m(x).sum()

    x = _point(0)
    prep = td.prepare_gradient(loss, AOT, x, td.Constant(model))
    with torch.no_grad():
        model[0].weight.mul_(3)
    _close(td.gradient(loss, AOT, x, td.Constant(model), prep=prep), td.gradient(loss, REFERENCE, x, td.Constant(model)))


def test_non_contiguous_input_still_correct():
    x = _point(0, (4, 4))
    prep = td.prepare_gradient(lambda m: (m.sin() * torch.arange(16.0).reshape(4, 4)).sum(), INDUCTOR, x)
    xt = _point(1, (4, 4)).T  # same shape, other strides
    want = xt.cos() * torch.arange(16.0).reshape(4, 4)
    _close(td.gradient(prep.f, INDUCTOR, xt, prep=prep), want)


def test_reduce_overhead_owns_buffers_and_returns_fresh_results():
    backend = td.AutoCompile(compiler="aot_eager", mode="reduce-overhead")
    x = _point(0)
    prep = td.prepare_gradient(scalar_loss, backend, x, td.Constant(1.0), td.Cache(torch.empty(5)))
    td.gradient(scalar_loss, backend, x, td.Constant(1.0), td.Cache(torch.empty(5)), prep=prep)
    buffers = [id(t) for t in torch.utils._pytree.tree_leaves(prep.runner.buffers)]
    results = []
    for seed in range(1, 4):
        x = _point(seed)
        results.append(td.gradient(scalar_loss, backend, x, td.Constant(1.0), td.Cache(torch.empty(5)), prep=prep))
        _close(results[-1], td.gradient(scalar_loss, REFERENCE, x, td.Constant(1.0), td.Cache(torch.empty(5))))
    assert [id(t) for t in torch.utils._pytree.tree_leaves(prep.runner.buffers)] == buffers
    assert not torch.equal(results[0], results[1])  # earlier results are not overwritten
    assert prep.num_compilations == graphs("gradient")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_reduce_overhead_on_cuda():
    backend = td.AutoCompile(mode="reduce-overhead")
    x = _point(0).cuda()
    prep = td.prepare_gradient(scalar_loss, backend, x, td.Constant(1.0), td.Cache(torch.empty(5, device="cuda")))
    for seed in range(1, 4):
        x = _point(seed).cuda()
        got = td.gradient(scalar_loss, backend, x, td.Constant(1.0), td.Cache(torch.empty(5, device="cuda")), prep=prep)
        _close(got, td.gradient(scalar_loss, REFERENCE, x, td.Constant(1.0), td.Cache(torch.empty(5, device="cuda"))))
    assert prep.num_compilations == graphs("gradient")


def test_compile_backend_validation():
    with pytest.raises(TypeError, match="inner"):
        td.AutoCompile(inner=td.AutoFiniteDiff())
    with pytest.raises(ValueError, match="mode= or options="):
        td.AutoCompile(mode="max-autotune", options={"max_autotune": True})
    assert hash(td.AutoCompile(options={"a": 1})) == hash(td.AutoCompile(options={"a": 1}))
    assert td.check_available(AOT)


def test_the_default_scenarios_are_240():
    from torchdi.testing import default_scenarios

    assert len(default_scenarios()) == 240


@pytest.mark.scenarios
@pytest.mark.parametrize("operator", list(OPERATORS))
def test_aot_eager_passes_every_default_scenario(operator):
    """The default scenarios of torchdi.testing (every operator; scalar, vector, matrix, dict
    inputs; no context, Constant float or tensor, Cache), prepared at one point and run at
    another, with inputs intact and no recompilation; one test per operator. All of float64's;
    float32's compact (one per operator, the inputs and contexts taken in turn): the two dtypes
    run the same code, and the float32 half cost about 50 s of CI's CPU for no path of its own."""
    from torchdi.testing import default_scenarios, test_differentiation

    scenarios = default_scenarios(operators=[operator], dtypes=(torch.float64,)) + default_scenarios(
        operators=[operator], dtypes=(torch.float32,), compact=True
    )
    records = test_differentiation([AOT], scenarios)
    assert len(records) == len(scenarios) > 0


def test_one_shot_calls_compile_only_the_variant_they_need(monkeypatch):
    from torchdi.engines import _compiled as compile_engine

    compiled = []
    original = compile_engine._CountingCompiler.__call__

    def counting(self, graph, example_inputs):
        compiled.append(graph)
        return original(self, graph, example_inputs)

    monkeypatch.setattr(compile_engine._CountingCompiler, "__call__", counting)
    x = _point(0)
    _close(td.gradient(scaled_power, AOT, x, td.Constant(2)), 2 * x)
    assert len(compiled) == 1
    y, g = td.value_and_gradient(scaled_power, AOT, x, td.Constant(2))
    _close((y, g), ((x**2).sum(), 2 * x))
    assert len(compiled) == 2


def test_inductor_layout_optimization_is_off_unless_the_user_turns_it_on(monkeypatch):
    from torchdi.engines._compiled import inductor_options

    monkeypatch.delenv("TORCHINDUCTOR_LAYOUT_OPTIMIZATION", raising=False)
    assert inductor_options(None) == {"layout_optimization": False}
    assert inductor_options({"layout_optimization": True, "cpp_wrapper": True}) == {
        "layout_optimization": True,
        "cpp_wrapper": True,
    }
    monkeypatch.setenv("TORCHINDUCTOR_LAYOUT_OPTIMIZATION", "1")
    assert inductor_options(None) == {}


def test_inductor_compiles_a_convolution_gradient_without_layout_optimization(monkeypatch):
    """What inductor decides for the graph of a convolution's gradient (it would turn layout
    optimization on for any CPU convolution), and the gradient itself against eager autograd."""
    from torch._inductor.graph import GraphLowering

    monkeypatch.delenv("TORCHINDUCTOR_LAYOUT_OPTIMIZATION", raising=False)
    decisions = []
    decide = GraphLowering.decide_layout_opt

    def spy(gm, *, is_inference):
        decisions.append(decide(gm, is_inference=is_inference))
        return decisions[-1]

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(spy))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)
    images = torch.randn(2, 3, 6, 6)

    def loss(weight, bias, images):
        return torch.nn.functional.conv2d(images, weight, bias).relu().sum()

    weight, bias = conv.weight.detach(), conv.bias.detach()
    # A graph found in inductor's or AOTAutograd's cache (an earlier run's) is not lowered again.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        g = td.gradient(loss, INDUCTOR, weight, td.Constant(bias), td.Constant(images))
    expected = torch.autograd.grad(loss(conv.weight, conv.bias, images), conv.weight)[0]
    _close(g, expected)
    assert decisions == [False]


def test_one_tensor_passed_as_two_contexts_compiles_once():
    """GPT-2's input_ids passed as its labels too: preparation must see the aliasing the calls have."""
    backend = td.AutoCompile(compiler="aot_eager")

    def f(x, a, b):
        return (x * a + b).sum()

    c = torch.randn(3)
    prep = td.prepare_gradient(f, backend, torch.randn(3), td.Constant(c), td.Constant(c))
    for _ in range(3):
        d = torch.randn(3)
        got = td.gradient(f, backend, torch.randn(3), td.Constant(d), td.Constant(d), prep=prep)
        torch.testing.assert_close(got, d)
    assert prep.num_compilations == 1


# -- the plain gradient runs a value-free copy of the prepared program ---------------------------

OFFSET = 1.0


def offset_loss(x):
    return ((x - OFFSET) ** 2).sum() + 3.0


@pytest.mark.parametrize("backend", [AOT, pytest.param(INDUCTOR, marks=pytest.mark.inductor)], ids=["aot_eager", "inductor"])
def test_plain_gradient_runs_the_value_free_copy(backend, monkeypatch):
    """One dynamo compilation serves both calls (rule 2); the plain gradient runs the copy whose
    value is a zero (f's final reduction left out), value_and_gradient the program with the value;
    a changed global recompiles once for both and neither is stale (rule 7)."""
    monkeypatch.setitem(globals(), "OFFSET", 1.0)
    x = _point(0)
    prep = td.prepare_gradient(offset_loss, backend, x)
    assert prep.lean_call is not None and prep.num_compilations == 1
    with torch.no_grad():  # as operators call it (the program guards on grad mode)
        value, _ = prep.lean_call(x, None, ())
    assert torch.equal(value, torch.zeros_like(value))  # the copy ran: no value computed
    for seed in range(1, 4):  # both calls, in turn, with new values: nothing compiles
        x = _point(seed)
        want_value, want = td.value_and_gradient(offset_loss, REFERENCE, x)
        _close(td.gradient(offset_loss, backend, x, prep=prep), want)
        got_value, got = td.value_and_gradient(offset_loss, backend, x, prep=prep)
        _close(got_value, want_value)
        _close(got, want)
    assert prep.num_compilations == 1
    out = torch.empty_like(x)
    assert td.gradient(offset_loss, backend, x, prep=prep, out=out) is out
    _close(out, 2 * (x - 1.0))
    monkeypatch.setitem(globals(), "OFFSET", -2.0)  # a global f reads: one recompilation serves both
    _close(td.gradient(offset_loss, backend, x, prep=prep), 2 * (x + 2.0))
    _close(td.value_and_gradient(offset_loss, backend, x, prep=prep)[0], ((x + 2.0) ** 2).sum() + 3.0)
    _close(td.gradient(offset_loss, backend, x, prep=prep), 2 * (x + 2.0))
    assert prep.num_compilations == 2


def test_value_free_mode_is_per_thread():
    """A plain gradient running in one thread (the value-free copy chosen) leaves a
    value_and_gradient call of the same preparation in another thread its value."""
    x = _point(0)
    prep = td.prepare_gradient(offset_loss, AOT, x)
    mode = prep.runner.value_free  # what the plain gradient's call sets while it runs
    mode.on = True
    try:
        results = []
        worker = threading.Thread(target=lambda: results.append(td.value_and_gradient(offset_loss, AOT, x, prep=prep)))
        worker.start()
        worker.join()
    finally:
        mode.on = False
    want_value, want = td.value_and_gradient(offset_loss, REFERENCE, x)
    _close(results[0][0], want_value)
    _close(results[0][1], want)
    assert prep.num_compilations == 1


def test_no_value_free_copy_where_it_cannot_serve():
    """With graph breaks (fullgraph=False), has_aux, or a one-shot call, one program is compiled."""
    x = _point(0)
    assert td.prepare_gradient(offset_loss, td.AutoCompile(compiler="aot_eager", fullgraph=False), x).lean_call is None
    prep = td.prepare_gradient(lambda v: (offset_loss(v), v.sum()), AOT, x, has_aux=True)
    assert prep.lean_call is None and prep.num_compilations == 1
    assert td.prepare_gradient(offset_loss, REFERENCE, x).lean_call is None
