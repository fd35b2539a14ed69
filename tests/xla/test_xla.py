"""AutoXLA on torch-xla's PJRT CPU client: every operator against AutoAutograd on the CPU,
no recompilation when values change (rule 2), and real device-buffer reuse."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch-xla is not installed here: `make test-xla` runs these in .venv-xla")
import torch_xla.debug.metrics as metrics  # noqa: E402

import torchdi as td  # noqa: E402

XLA = td.AutoXLA()
REFERENCE = td.AutoAutograd()


def counter(name):
    return int(metrics.counter_value(name) or 0)


def live_xla_tensors():
    return counter("CreateXlaTensor") - counter("DestroyXlaTensor")


def close(a, b, atol=1e-5, rtol=1e-4):
    a_leaves, b_leaves = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(a_leaves) == len(b_leaves)
    for u, v in zip(a_leaves, b_leaves):
        assert u.device.type == "cpu"
        torch.testing.assert_close(u, v, atol=atol, rtol=rtol)


def point(seed, shape=(6,)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def dict_point(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "v": torch.randn(4, generator=g)}


def scalar_loss(x, scale, buf):
    buf.copy_(torch.tanh(x) * scale)
    return (buf**2).sum() + (x**3).sum()


def vector_map(x, scale):
    return torch.sin(x) * scale + x.flip(0) ** 2


def dict_loss(p, scale):
    return (torch.tanh(p["w"] @ p["v"]) * scale).sum() + (p["v"] ** 2).sum()


def cubic(t, scale):
    return torch.stack([t**3 * scale, torch.sin(t)])


CASES = {
    "gradient": (("gradient", "value_and_gradient"), scalar_loss, point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(6))), None),
    "gradient-dict": (("gradient", "value_and_gradient"), dict_loss, dict_point, lambda s: (td.Constant(0.5 * s),), None),
    "pullback": (("pullback", "value_and_pullback"), vector_map, point, lambda s: (td.Constant(2.0 + s),), lambda x: (torch.ones_like(x), x * 2)),
    "pushforward": (("pushforward", "value_and_pushforward"), vector_map, point, lambda s: (td.Constant(2.0 + s),), lambda x: (torch.ones_like(x), x * 2)),
    "pushforward-dict": (("pushforward", "value_and_pushforward"), dict_loss, dict_point, lambda s: (td.Constant(0.5 * s),), lambda x: (x,)),
    "jacobian": (("jacobian", "value_and_jacobian"), vector_map, point, lambda s: (td.Constant(2.0 + s),), None),
    "hvp": (("hvp", "gradient_and_hvp"), scalar_loss, point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(6))), lambda x: (x * 2, torch.ones_like(x))),
    "hvp-dict": (("hvp", "gradient_and_hvp"), dict_loss, dict_point, lambda s: (td.Constant(0.5 * s),), lambda x: (x,)),
    "hessian": (("hessian", "value_gradient_and_hessian"), scalar_loss, point, lambda s: (td.Constant(1.0 + s), td.Cache(torch.empty(6))), None),
    "derivative": (("derivative", "value_and_derivative"), cubic, lambda s: point(s, ()), lambda s: (td.Constant(1.0 + s),), None),
    "second_derivative": (("second_derivative", "value_derivative_and_second_derivative"), cubic, lambda s: point(s, ()), lambda s: (td.Constant(1.0 + s),), None),
}


def call(name, f, backend, x, tangents, contexts, prep=None):
    op = getattr(td, name)
    if tangents is None:
        return op(f, backend, x, *contexts, prep=prep)
    return op(f, backend, x, tangents, *contexts, prep=prep)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_operator_matches_autograd_prepared_elsewhere(case):
    names, f, make_x, make_contexts, make_tangents = CASES[case]
    x0 = make_x(0)
    t0 = None if make_tangents is None else make_tangents(x0)
    prep = getattr(td, f"prepare_{case.split('-')[0]}")(f, XLA, x0, *(() if t0 is None else (t0,)), *make_contexts(0))
    assert prep.num_compilations >= 1
    assert prep.runner.path == "traced (openxla)", repr(prep)  # traced once, no lazy fallback
    for name in names:  # the plain gradient compiles its variant without the value on first use
        call(name, f, XLA, x0, t0, make_contexts(0), prep)
    compiled = prep.num_compilations
    for seed in (1, 2):
        x = make_x(seed)
        t = None if make_tangents is None else make_tangents(x)
        for name in names:
            close(call(name, f, XLA, x, t, make_contexts(seed), prep), call(name, f, REFERENCE, x, t, make_contexts(seed)))
    assert prep.num_compilations == compiled


def with_contexts(x, c, w, buf):
    buf.copy_(x * w)
    return (torch.sin(buf) * c).sum() + (x * c).sum()


# 0.0 and 1.0 are compiled in as constants by torch-xla, and equal scalars share device data.
SCALARS = [0.0, 1.0, 1.0, 0.0, 0.0, 2.5, 2.5, 1.0, -3.0, 0.7, 0.7, 0.0, 1.0, 0.3, 0.3, 5.0, 1.0, 0.0, 0.25, 0.25]


@pytest.mark.parametrize("reuse_buffers", [True, False])
def test_twenty_calls_with_new_values_add_no_compilation(reuse_buffers):
    backend = td.AutoXLA(reuse_buffers=reuse_buffers)
    contexts = (td.Constant(0.5), td.Constant(point(50)), td.Cache(torch.empty(6)))
    prep = td.prepare_gradient(with_contexts, backend, point(0), *contexts)
    compiled, uncached = prep.num_compilations, counter("UncachedCompile")
    for i, c in enumerate(SCALARS):
        x = torch.zeros(6) if i % 4 == 0 else (torch.ones(6) if i % 4 == 1 else point(i + 1))
        w = torch.full((6,), c) if i % 3 == 0 else point(100 + i)
        ctx = (td.Constant(c), td.Constant(w), td.Cache(torch.empty(6)))
        close(td.value_and_gradient(with_contexts, backend, x, *ctx, prep=prep), td.value_and_gradient(with_contexts, REFERENCE, x, *ctx))
    assert prep.num_compilations == compiled
    assert counter("UncachedCompile") == uncached


def test_device_buffers_are_reused_and_results_fresh():
    contexts = (td.Constant(0.5), td.Constant(point(50)), td.Cache(torch.empty(6)))
    prep = td.prepare_gradient(with_contexts, XLA, point(0), *contexts)
    compiled = prep.num_compilations
    for i in range(3):  # the plain gradient runs the prepared program: nothing compiles (rule 2)
        td.gradient(with_contexts, XLA, point(i), *contexts, prep=prep)
    assert prep.num_compilations == compiled
    buffers = [b for b in prep.runner.buffers if b is not None]
    assert len(buffers) == 4  # x, the float (as a shape-(1,) buffer), the tensor constant, the cache template
    ids = [id(b) for b in buffers]
    gc.collect()
    live = live_xla_tensors()
    previous = None
    for i in range(10):
        x = point(10 + i)
        got = td.gradient(with_contexts, XLA, x, td.Constant(0.1 * i), td.Constant(point(60 + i)), td.Cache(torch.empty(6)), prep=prep)
        close(got, td.gradient(with_contexts, REFERENCE, x, td.Constant(0.1 * i), td.Constant(point(60 + i)), td.Cache(torch.empty(6))))
        if previous is not None:
            assert not torch.equal(got, previous)  # never stale
        previous = got
    gc.collect()
    assert [id(b) for b in prep.runner.buffers if b is not None] == ids
    assert live_xla_tensors() <= live


def test_inputs_already_on_the_device_stay_there():
    device = torch_xla.device()
    x = point(0).to(device)
    prep = td.prepare_gradient(with_contexts, XLA, x, td.Constant(0.5), td.Constant(point(1)), td.Cache(torch.empty(6)))
    got = td.gradient(with_contexts, XLA, x, td.Constant(0.5), td.Constant(point(1)), td.Cache(torch.empty(6)), prep=prep)
    assert got.device.type == "xla"
    want = td.gradient(with_contexts, REFERENCE, point(0), td.Constant(0.5), td.Constant(point(1)), td.Cache(torch.empty(6)))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


def power(x, p):
    return (x**p).sum()


def test_static_int_is_compared_strictly_and_recompiles_when_not():
    strict = td.prepare_gradient(power, XLA, point(0), td.Constant(2))
    with pytest.raises(td.PreparationMismatchError, match="static value 2"):
        td.gradient(power, XLA, point(0), td.Constant(3), prep=strict)
    loose = td.prepare_gradient(power, XLA, point(0), td.Constant(2), strict=False)
    before = loose.num_compilations
    close(td.gradient(power, XLA, point(1), td.Constant(3), prep=loose), 3 * point(1) ** 2)
    assert loose.num_compilations == before + 1


def test_prep_keeps_no_reference_to_user_data_and_inputs_are_intact():
    x, w = point(0), point(1)
    x_copy, w_copy = x.clone(), w.clone()
    refs = weakref.ref(x), weakref.ref(w)
    prep = td.prepare_gradient(with_contexts, XLA, x, td.Constant(0.5), td.Constant(w), td.Cache(torch.empty(6)))
    td.gradient(with_contexts, XLA, x, td.Constant(0.5), td.Constant(w), td.Cache(torch.empty(6)), prep=prep)
    assert torch.equal(x, x_copy) and torch.equal(w, w_copy)
    del x, w
    gc.collect()
    assert all(r() is None for r in refs)


def test_available_here():
    assert td.check_available(XLA)
    assert td.check_available(td.AutoXLA(device=str(torch_xla.device())))


def test_every_default_scenario_operator():
    """Every operator of torchdi.testing's default scenarios on XLA, in float64 with a Constant
    (one scenario per operator: each preparation compiles through dynamo and XLA, which costs
    seconds on a 2-core box; the float32 and Cache variants are above): prepared at one point
    and run at another, inputs intact, no recompilation, no reference kept."""
    from torchdi.testing import default_scenarios, test_differentiation

    chosen = {}
    for scenario in default_scenarios():
        if "float64" in scenario.name and "Constant" in scenario.name:
            chosen.setdefault(scenario.op, scenario)
    assert len(chosen) == 16
    assert len(test_differentiation([XLA], list(chosen.values()))) == 16


def test_training_on_xla_matches_eager_autograd():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[2] / "examples" / "train_mlp.py"
    spec = importlib.util.spec_from_file_location("train_mlp", path)
    train_mlp = importlib.util.module_from_spec(spec)
    sys.modules["train_mlp"] = train_mlp
    spec.loader.exec_module(train_mlp)
    reference, ref_loss, _ = train_mlp.train(REFERENCE, 8)
    model, loss, _ = train_mlp.train(XLA, 8)
    assert train_mlp.max_parameter_difference(model, reference) < 1e-5
    assert abs(loss - ref_loss) < 1e-5


def test_backward_before_the_device_exists_gives_a_clear_error(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import torch, torchdi as td\n"
        "x = torch.randn(3, requires_grad=True)\n"
        "(x ** 2).sum().backward()\n"
        "assert not td.check_available(td.AutoXLA())\n"
        "try:\n"
        "    td.gradient(lambda x: (x ** 2).sum(), td.AutoXLA(), torch.ones(3))\n"
        "except td.BackendUnavailableError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert "before the XLA device existed" in done.stdout
    assert "check_available" in done.stdout


def _rule_2_vector(x):
    return x[1:] * x[:-1] + x[1:].sin()


def _rule_2_scalar(x):
    return (_rule_2_vector(x) ** 2).sum()


RULE_2_CASES = {
    "pushforward": (_rule_2_vector, lambda s: point(s), lambda x: (torch.ones_like(x),)),
    "pullback": (_rule_2_vector, lambda s: point(s), lambda x: (torch.ones(5),)),
    "derivative": (lambda x: x.sin() * x, lambda s: point(s, ()), None),
    "gradient": (_rule_2_scalar, lambda s: point(s), None),
    "jacobian": (_rule_2_vector, lambda s: point(s), None),
    "second_derivative": (lambda x: x.sin() * x, lambda s: point(s, ()), None),
    "hvp": (_rule_2_scalar, lambda s: point(s), lambda x: (torch.ones_like(x),)),
    "hessian": (_rule_2_scalar, lambda s: point(s), None),
}


@pytest.mark.parametrize("family", sorted(RULE_2_CASES))
def test_rule_2_plain_and_value_variants_compile_nothing_after_preparation(family):
    from torchdi.families import FAMILIES

    row = FAMILIES[family]
    f, make_x, make_tangents = RULE_2_CASES[family]
    x0 = make_x(0)
    head0 = (x0,) if make_tangents is None else (x0, make_tangents(x0))
    prep = getattr(td, f"prepare_{family}")(f, XLA, *head0)
    compiled = prep.num_compilations
    for seed, name in enumerate((row.operator, row.value_operator), start=1):
        x = make_x(seed)
        head = (x,) if make_tangents is None else (x, make_tangents(x))
        close(getattr(td, name)(f, XLA, *head, prep=prep), getattr(td, name)(f, REFERENCE, *head))
        assert prep.num_compilations == compiled, name
