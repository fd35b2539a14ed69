"""``AutoCompile(compiler="aot_inductor")``: dynamo's graphs as AOTInductor programs (issue 26).

Dynamo still traces and guards (rule 7): the changes that recompile raw ``torch.compile`` recompile
here, and each new graph becomes an AOTInductor program again. What AOTInductor must not run (an
input that requires grad under grad mode, in-place writes, random numbers) or cannot (the fence's
internals missing) is compiled by inductor instead, and ``programs`` says which. AOTInductor
compilations take seconds each: the tests share few of them.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import subprocess
import sys
import weakref

import pytest
import torch

import torchdi as td
from torchdi.engines import _aoti_private, _dynamo

pytestmark = pytest.mark.inductor

BACKEND = td.AutoCompile(compiler="aot_inductor")
SCALE = 2.0


def programs(prep):
    """What each graph compiled for ``prep``'s runner became ("aot_inductor", or the fallback's reason)."""
    runner = prep.runner
    runner = getattr(runner, "fused", None) or runner
    return runner._compiler.compiler.programs


def mlp(x, W, c):
    return (SCALE * c * torch.tanh(W @ torch.tanh(W @ x))).sum()


def reference(x, W, c):
    return torch.func.grad_and_value(mlp)(x, W, c)[::-1]


def test_values_and_gradients_stay_right_as_what_f_reads_changes(monkeypatch):
    x, W = torch.randn(16), torch.randn(16, 16) / 4
    prep = td.prepare_gradient(mlp, BACKEND, x, td.Constant(W), td.Constant(0.5))
    # One graph, two programs: the gradient's value-free copy is compiled beside it (_compiled.py).
    assert programs(prep) == ["aot_inductor"] * 2 and prep.num_compilations == 1
    for got, want in zip(td.value_and_gradient(mlp, BACKEND, x, td.Constant(W), td.Constant(0.5), prep=prep), reference(x, W, 0.5)):
        torch.testing.assert_close(got, want)

    # New values of x, of a tensor context (written in place) and of a float context: no recompilation.
    x2 = torch.randn(16)
    W.mul_(1.5)
    for got, want in zip(td.value_and_gradient(mlp, BACKEND, x2, td.Constant(W), td.Constant(0.25), prep=prep), reference(x2, W, 0.25)):
        torch.testing.assert_close(got, want)
    assert prep.num_compilations == 1

    # A global f reads: dynamo's guard fails, the new graph is an AOTInductor program too, never stale.
    monkeypatch.setattr(__import__(__name__), "SCALE", 3.0)
    for got, want in zip(td.value_and_gradient(mlp, BACKEND, x2, td.Constant(W), td.Constant(0.25), prep=prep), reference(x2, W, 0.25)):
        torch.testing.assert_close(got, want)
    assert programs(prep) == ["aot_inductor"] * 4 and prep.num_compilations == 2

    # Another layout of x is copied to the compiled one, not run on the wrong strides.
    wide = torch.randn(16, 2)[:, 0]
    torch.testing.assert_close(td.value_and_gradient(mlp, BACKEND, wide, td.Constant(W), td.Constant(0.25), prep=prep)[1], reference(wide, W, 0.25)[1])
    assert prep.num_compilations == 2


def heat(u):
    return torch.cat([-2 * u[0:1] + u[1:2], u[:-2] - 2 * u[1:-1] + u[2:], u[-2:-1] - 2 * u[-1:]])


def weighted_heat(weights):
    def weighted(u):
        return heat(u) * weights

    return weighted


def test_sparse_jacobian_runs_one_aot_inductor_program_and_frees_it():
    backend = td.AutoSparse(BACKEND)
    x = torch.rand(40)
    weights = torch.rand(40)
    weighted = weighted_heat(weights)
    prep = td.prepare_jacobian(weighted, backend, x)
    assert programs(prep) == ["aot_inductor"] and prep.ncolors == 3
    x2 = torch.rand(40)
    torch.testing.assert_close(td.jacobian(weighted, backend, x2, prep=prep).to_dense(), torch.func.jacfwd(weighted)(x2))
    assert prep.num_compilations == 1
    weights.mul_(2)  # read in place by the program (dynamo made it an input): the new values, no recompilation
    torch.testing.assert_close(td.jacobian(weighted, backend, x2, prep=prep).to_dense(), torch.func.jacfwd(weighted)(x2))
    assert prep.num_compilations == 1

    # Rule 9: a dropped preparation frees its program and never keeps f or what f closes over alive.
    made = prep.runner.fused._compiler.compiler.made
    assert len(made) == 1 and made[0]() is not None
    refs = [weakref.ref(weights), weakref.ref(weighted), *made]
    del prep, weighted, weights
    gc.collect()
    assert all(ref() is None for ref in refs)


def updates_state(x, stats):
    stats.mul_(0.5).add_(x.detach())
    return (x * stats).sum()


def drops_out(x):
    return torch.nn.functional.dropout(x, 0.5).sum() + (x**2).sum()


def test_in_place_writes_and_random_numbers_are_left_to_inductor(caplog):
    x = torch.linspace(-1.0, 1.0, 4)
    stats, eager_stats = torch.ones(4), torch.ones(4)
    with caplog.at_level(logging.INFO, logger="torchdi"):
        prep = td.prepare_gradient(updates_state, BACKEND, x, td.State(stats))
    assert len(programs(prep)) >= 1 and all("writes in place" in p for p in programs(prep))
    assert "leaves a graph to inductor" in caplog.text
    stats.copy_(torch.ones(4))
    got = td.gradient(updates_state, BACKEND, x, td.State(stats), prep=prep)
    want = torch.func.grad(updates_state)(x, eager_stats)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(stats, eager_stats)  # the State update happened, as in eager code

    prep = td.prepare_gradient(drops_out, BACKEND, x)
    assert all("random numbers" in p for p in programs(prep))
    torch.manual_seed(0)
    got = td.gradient(drops_out, BACKEND, x, prep=prep)
    dropped = (got - 2 * x) / 2  # 2x plus 0 or 2 per element (dropout's scale), at random
    assert torch.isclose(dropped, torch.zeros(4)).logical_or(torch.isclose(dropped, torch.ones(4))).all()


def test_without_the_internals_inductor_compiles_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_aoti_private, "_AOTI_API", None)
    monkeypatch.setattr(_aoti_private.fence, "warned", set())
    x = torch.linspace(-1.0, 1.0, 3)
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        prep = td.prepare_gradient(heat_sum, BACKEND, x)
        prep2 = td.prepare_gradient(heat_sum, BACKEND, 2 * x)
    assert caplog.text.count("lacks the internal") == 1 and "aot_inductor" in caplog.text  # one warning, naming it
    assert programs(prep) == programs(prep2) == ["this torch lacks AOTInductor's internals"] * len(programs(prep))
    torch.testing.assert_close(td.gradient(heat_sum, BACKEND, x, prep=prep), torch.func.grad(heat_sum)(x))


def heat_sum(x):
    return (heat(x) ** 2).sum()


def test_unsuitable_graphs_name_why():
    x = torch.ones(3)
    graph = torch.fx.symbolic_trace(lambda t: (t * 2,))
    assert _aoti_private._unsuitable_graph(graph, [x]) is None
    assert "requires grad" in _aoti_private._unsuitable_graph(graph, [x.requires_grad_()])
    assert "not a tensor" in _aoti_private._unsuitable_graph(graph, [3])
    assert "plain strided CPU tensor" in _aoti_private._unsuitable_graph(graph, [torch.ones(3).to_sparse()])

    class Holds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, t):
            return (t * self.w,)

    assert "tensor of its own" in _aoti_private._unsuitable_graph(torch.fx.symbolic_trace(Holds()), [torch.ones(3)])
    with torch.no_grad():
        assert _aoti_private._unsuitable_graph(graph, [torch.ones(3, requires_grad=True)]) is None


PERSISTED = '''
import json, sys
import torch
import torchdi as td

SHIFT = 1

def f(x):
    return torch.sin(x) * x.roll(SHIFT) + SHIFT

backend = td.AutoCompile(compiler="aot_inductor", cache_dir=sys.argv[1])
x = torch.linspace(-1.0, 1.0, 6)
report = []
for shift in (1, 1, 2):
    SHIFT = shift
    prep = td.prepare_jacobian(f, backend, x)
    got = td.jacobian(f, backend, x, prep=prep)
    report.append([prep.loaded_from_cache, torch.equal(got, torch.func.jacrev(f)(x)) or torch.allclose(got, torch.func.jacrev(f)(x))])
print(json.dumps(report))
'''


def test_a_second_process_loads_the_programs_and_a_changed_global_compiles(tmp_path):
    script = tmp_path / "persisted.py"
    script.write_text(PERSISTED)
    cache = tmp_path / "cache"

    def run():
        done = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    # First process: compiled and stored, then loaded by the second preparation (a new dynamo
    # trace of the same graph), then a changed global: another graph, compiled. Always right.
    assert run() == [[False, True], [True, True], [False, True]]
    # Second process: both programs load; the results are right.
    assert run() == [[True, True], [True, True], [True, True]]
    # A corrupt entry is ignored and compiled again, never an error.
    for entry in cache.rglob("*"):
        if entry.is_file():
            entry.write_bytes(entry.read_bytes()[:100])
    assert run() == [[False, True], [True, True], [False, True]]


def user_helper(t):
    return t * 2


def test_only_graphs_of_torch_operations_persist():
    """A graph calling a user's function or custom operator by name could mean other code in
    another process: it is compiled, never loaded."""
    assert _aoti_private._persistable(torch.fx.symbolic_trace(lambda t: (torch.sin(t) + 1,)))
    graph = torch.fx.Graph()
    graph.output((graph.call_function(user_helper, (graph.placeholder("t"),)),))
    assert not _aoti_private._persistable(torch.fx.GraphModule(torch.nn.Module(), graph))

    class Holds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(3))

        def forward(self, t):
            return (t + self.b,)

    assert not _aoti_private._persistable(torch.fx.symbolic_trace(Holds()))


def softmax_weighted(x):
    return (torch.softmax(x, 0) * torch.arange(6.0)).sum()


def test_zero_tangents_are_traced_as_zeros_with_memory(monkeypatch):
    # Forward over reverse makes ZeroTensors (zeros without memory) for tangents known to be zero.
    # AOTInductor must get plain zeros, never a ZeroTensor nor the meta-device internals of torch's
    # ZeroTensor fallback: it read those as memory (out-of-bounds reads, a crashed process).
    # Captured before AOTInductor compiles (seconds): dynamo's graph then runs as it is.
    make_fx, _, runner_type, tracing = _aoti_private._api()
    traced = []

    def capture(aten, inputs, options):
        traced.append(aten)
        raise RuntimeError("captured")

    monkeypatch.setattr(_aoti_private, "_AOTI_API", (make_fx, capture, runner_type, tracing))
    compiler = _aoti_private.AOTInductorCompiler(lambda graph, inputs: graph, None)
    x = torch.linspace(-1.0, 1.0, 6)
    got = torch.compile(torch.func.hessian(softmax_weighted), backend=compiler, fullgraph=True)(x)
    torch.testing.assert_close(got, torch.func.hessian(softmax_weighted)(x))
    assert len(traced) == 1 and "captured" in compiler.programs[0]
    values = [node.meta.get("val") for node in traced[0].graph.nodes]
    assert not any(isinstance(v, torch.Tensor) and (v.device.type == "meta" or v._is_zerotensor()) for v in values)
    assert _aoti_private._unsuitable_aten_graph(traced[0]) is None

    # A graph that still holds a ZeroTensor is left to inductor, naming why.
    zero = make_fx(lambda t: t + torch.ops.aten._efficientzerotensor.default([3]), tracing_mode="fake")(torch.ones(3))
    assert "ZeroTensor" in _aoti_private._unsuitable_aten_graph(zero)


def test_a_program_is_keyed_by_the_processor_that_built_it(monkeypatch):
    # AOTInductor builds machine code for this processor (-march=native): a cache directory shared
    # with another machine must not hand it a program it lacks the instructions of (an illegal
    # instruction kills the process, no try catches it).
    graph = torch.fx.symbolic_trace(lambda t: (torch.sin(t),))
    key = _aoti_private.program_key(graph, [torch.ones(3)], {})
    assert key == _aoti_private.program_key(graph, [torch.ones(3)], {})
    assert torch.backends.cpu.get_cpu_capability() in _aoti_private.processor()
    monkeypatch.setattr(_aoti_private, "processor", lambda: "x86_64\nAVX2\nflags: fpu sse2 avx2")
    assert _aoti_private.program_key(graph, [torch.ones(3)], {}) != key


def halves_state(x, s):
    first, second = s.split(3)  # pieces of the input: aten.split returns a list, no alias annotation
    first.mul_(0.5)
    return x * second


def adds_into_state(x, s):
    torch.add(s[:3], x, out=s[3:])  # the written tensor is an out= argument
    return x * s[:3]


def fills_a_copy(x, s):
    t = s.clone()
    t.split(3)[0].copy_(x)
    return x * t[3:]


def test_writes_into_pieces_of_an_input_are_left_to_inductor():
    # The walk follows the fake storages make_fx records: a write into a piece split or unbind made
    # of an input, or into an out= argument, is a write into the input (a State context's update).
    make_fx = _aoti_private._api()[0]
    x, s = torch.ones(3), torch.ones(6)
    for f in (halves_state, adds_into_state):
        assert "writes in place into an input" in _aoti_private._unsuitable_aten_graph(make_fx(f, tracing_mode="fake")(x, s))
    assert _aoti_private._unsuitable_aten_graph(make_fx(fills_a_copy, tracing_mode="fake")(x, s)) is None


def scaled_by_exp(x, c):
    return (math.exp(c) * torch.sin(x)).sum()


def test_a_graph_make_fx_cannot_retrace_is_compiled_by_inductor(monkeypatch):
    # math.exp of a float context: make_fx fails midway through dynamo's graph of torch.func.grad,
    # which had entered functorch's transform with a plain call. Left behind, that level broke
    # inductor's compilation of the same graph ("Cannot access storage of TensorWrapper").
    make_fx, _, runner_type, tracing = _aoti_private._api()

    def refuse(aten, inputs, options):  # the graphs make_fx retraces go to inductor too (seconds saved)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(_aoti_private, "_AOTI_API", (make_fx, refuse, runner_type, tracing))
    x = torch.linspace(-1.0, 1.0, 4)
    prep = td.prepare_gradient(scaled_by_exp, BACKEND, x, td.Constant(0.5))
    assert programs(prep)[0].startswith("make_fx failed on it")
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0
    for c in (0.5, 1.5):
        torch.testing.assert_close(td.gradient(scaled_by_exp, BACKEND, x, td.Constant(c), prep=prep), math.exp(c) * torch.cos(x))


def test_programs_call_only_aten_and_prims_operators():
    """Collectives (DataParallel's all-reduce) and a user's custom operators run as inductor runs
    them: an AOTInductor program calls aten's and prims' operators only."""
    def graph_calling(target, *extra):
        graph = torch.fx.Graph()
        t = graph.placeholder("t")
        graph.output((graph.call_function(target, (graph.call_function(torch.ops.aten.sin.default, (t,)), *extra)),))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    assert _aoti_private._unsuitable_aten_graph(graph_calling(torch.ops.aten.cos.default)) is None
    assert _aoti_private._unsuitable_aten_graph(graph_calling(torch.ops.prims.cos.default)) is None
    reason = _aoti_private._unsuitable_aten_graph(graph_calling(torch.ops._c10d_functional.all_reduce.default, "sum", "0"))
    assert "outside aten's and prims' operators" in reason
    assert "not an aten operator" in _aoti_private._unsuitable_aten_graph(graph_calling(user_helper))


def _captured_compilations(monkeypatch, options=None):
    """Compile ``mlp``'s gradient with ``AOTInductorCompiler(options)``, capturing what
    AOTInductor is asked to compile (and the CPU wrapper registered then) instead of compiling."""
    make_fx, _, runner_type, tracing = _aoti_private._api()
    captured = []

    def capture(aten, inputs, options):
        entry = _aoti_private._cpu_wrapper_entry()
        captured.append((options, None if entry is None else entry[0].cpp_wrapper_codegen))
        raise RuntimeError("captured")

    monkeypatch.setattr(_aoti_private, "_AOTI_API", (make_fx, capture, runner_type, tracing))
    compiler = _aoti_private.AOTInductorCompiler(lambda graph, inputs: graph, options)
    x, W = torch.randn(4), torch.randn(4, 4)
    # (each call compiles the same code object again, with a new backend: past dynamo's default
    # recompile limit of 8 in a long test process, which compile_function lifts)
    _dynamo.compile_function(_mlp_gradient, compiler, fullgraph=True, dynamic=False)(x, W, 0.5)
    return captured


def _mlp_gradient(x, W, c):
    return torch.func.grad(mlp)(x, W, c)


def test_small_temporaries_live_on_the_stack_whatever_compiled_first(monkeypatch, caplog):
    """The "stack_buffers" fast path: AOTInductor compiles with inductor's
    allow_stack_allocation under inductor's array-ref CPU wrapper, even after inductor registered
    its plain one (torch 2.13 chooses once per process), which is registered again afterwards; a
    user's own setting wins; without the registry's internals the option stays off, with one warning."""
    torch.compile(torch.sin)(torch.randn(3))  # inductor first: its plain CPU wrapper is registered
    entry, plain, array_ref = _aoti_private._cpu_wrapper_entry()
    assert entry.cpp_wrapper_codegen is plain
    ((options, wrapper),) = _captured_compilations(monkeypatch)
    assert options["aot_inductor.allow_stack_allocation"] is True and wrapper is array_ref
    assert entry.cpp_wrapper_codegen is plain  # as it was

    ((options, wrapper),) = _captured_compilations(monkeypatch, {"aot_inductor.allow_stack_allocation": False})
    assert options["aot_inductor.allow_stack_allocation"] is False and wrapper is plain

    monkeypatch.setattr(_aoti_private, "_CPU_WRAPPERS", None)
    monkeypatch.setattr(_aoti_private.fence, "warned", set())
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        ((options, _),) = _captured_compilations(monkeypatch)
        _captured_compilations(monkeypatch)
    assert options["aot_inductor.allow_stack_allocation"] is False
    assert caplog.text.count("lacks the internal") == 1 and "stack_buffers" in caplog.text


def test_programs_with_temporaries_on_the_stack_give_eager_results():
    # The heat equation's sparse jacobian and a hessian whose temporaries exceed the stack's
    # share (inductor keeps those on the heap), against torch.func.
    def heat(u):
        return torch.cat([-2 * u[0:1] + u[1:2], u[:-2] - 2 * u[1:-1] + u[2:], u[-2:-1] - 2 * u[-1:]])

    def rosenbrock(z):
        return (100 * (z[1:] - z[:-1] ** 2) ** 2 + (1 - z[:-1]) ** 2).sum()

    backend = td.AutoSparse(BACKEND)
    for op, f, x in [(td.jacobian, heat, torch.randn(200)), (td.hessian, rosenbrock, torch.randn(20_000, dtype=torch.float64))]:
        prep = (td.prepare_jacobian if op is td.jacobian else td.prepare_hessian)(f, backend, x)
        assert programs(prep) == ["aot_inductor"]
        for point in (x, torch.randn_like(x)):
            got = op(f, backend, point, prep=prep)
            if op is td.jacobian:
                torch.testing.assert_close(got.to_dense(), torch.func.jacfwd(f)(point))
            else:  # a tridiagonal hessian, compared on its three diagonals
                i, j = got.to_sparse_coo().coalesce().indices()
                assert bool(((i - j).abs() <= 1).all())
                v = torch.zeros_like(point).index_fill_(0, torch.arange(0, point.numel(), 3), 1.0)
                torch.testing.assert_close(got @ v, torch.func.jvp(torch.func.grad(f), (point,), (v,))[1])
