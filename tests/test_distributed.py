"""Training across processes: DataParallel (replicated and FSDP2-sharded x) against DDP's and FSDP2's
own loops on two gloo processes; refusals of the set-ups that would give wrong gradients;
all_reduce_ in flat buckets."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import torchdi as td

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_ddp.py"
CHECKS = pathlib.Path(__file__).parent / "distributed_checks.py"
# One pair of processes runs every two-process check (starting them is most of the time).
TWO_PROCESS_CHECKS = (
    "fsdp-mlp-autograd", "fsdp-mlp-autograd-unwrapped", "fsdp-mlp-func", "fsdp-mlp-compile", "fsdp-gpt2-func",
    "fsdp-gpt2-autograd", "hsdp-mlp-autograd", "columns-mlp-autograd",
    "ddp-mlp-autograd", "ddp-mlp-func", "ddp-mlp-compile", "ddp-gpt2-func", "errors",
    # compiled GPT-2 (one block) on aot_eager, and the FSDP2 MLP on inductor: in the same pair of
    # processes as the rest (a pair of its own each cost two more start-ups of torch and transformers)
    "fsdp-gpt2-compile", "ddp-gpt2-compile", "fsdp-mlp-inductor",
)
COMPILED = ("-compile", "-inductor")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available")


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def loss_fn(params, model, inputs):
    return functional_call(model, params, (inputs,)).pow(2).mean()


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc()], ids=str)
def test_ddp_wrapped_module_inside_f_is_refused(single_process_group, backend):
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"(?s)DistributedDataParallel-wrapped Linear.*ddp_model.module.*all_reduce_"):
        td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(torch.randn(4, 3)))
    # the remedy: the wrapped module itself
    plain = {n: p.detach() for n, p in model.module.named_parameters()}
    td.gradient(loss_fn, backend, plain, td.Constant(model.module), td.Constant(torch.randn(4, 3)))


def test_all_reduce_packs_tensors_into_flat_buckets(single_process_group, monkeypatch):
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: (calls.append(tensor.numel()), real(tensor, *a, **k))[1])
    grads = {"w": torch.ones(3, 4), "b": torch.full((4,), 2.0), "steps": torch.ones(2, dtype=torch.float64), "none": None}
    out = td.distributed.all_reduce_(grads)
    assert out is grads
    assert sorted(calls) == [2, 16]  # one bucket per dtype, not one call per tensor
    torch.testing.assert_close(grads["b"], torch.full((4,), 2.0))  # the mean over one process
    monkeypatch.setattr(td.distributed, "_BUCKET_BYTES", 40)
    calls.clear()
    td.distributed.all_reduce_({"w": torch.ones(3, 4), "b": torch.ones(4), "c": torch.ones(4)}, op="sum")
    assert calls == [12, 8]  # 48 bytes alone, then 16 + 16 bytes together
    with pytest.raises(ValueError, match="op must be"):
        td.distributed.all_reduce_(grads, op="max")


def test_all_reduce_outside_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        td.distributed.all_reduce_({"w": torch.ones(2)})


def test_two_process_gloo_training_matches_single_process_full_batch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE.parents[1]), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "3"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collective calls per step: 1\n" in done.stdout  # one flat bucket per step, counted by the profiler
    difference = float(done.stdout.split("max |param - single-process full batch|:")[1].split()[0])
    assert difference < 1e-5


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc()], ids=str)
def test_all_reduce_takes_expanded_gradients_of_a_linear_term(single_process_group, backend):
    """d sum(x) is a stride-0 view of one number: reduced in place all the same (issue 23 item 10)."""
    x = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = td.gradient(lambda p: p["w"].sum() + (p["b"] ** 2).sum(), backend, x)
    assert 0 in grads["w"].stride()  # the case that crashed: an expanded tensor
    w_grad = grads["w"]
    out = td.distributed.all_reduce_(grads)
    assert out is grads and grads["w"] is w_grad  # the same tensor objects, now with their own memory
    torch.testing.assert_close(grads["w"], torch.ones(3, 4))
    torch.testing.assert_close(grads["b"], 2 * x["b"])
    lone = td.gradient(lambda t: t.sum(), backend, torch.randn(5))
    td.distributed.all_reduce_(lone, op="sum")
    torch.testing.assert_close(lone, torch.ones(5))
    lone.add_(1.0)  # writable: its elements no longer share one memory location
    torch.testing.assert_close(lone, torch.full((5,), 2.0))


def test_overlap_check_is_exact_on_common_layouts():
    from torchdi.translate import overlaps_itself

    assert not overlaps_itself(torch.ones(3, 4)) and not overlaps_itself(torch.ones(3, 4).t()) and not overlaps_itself(torch.ones(6)[::2])
    assert overlaps_itself(torch.ones(1).expand(3)) and overlaps_itself(torch.ones(3, 1).expand(3, 4))
    assert overlaps_itself(torch.ones(10).as_strided((3, 3), (2, 1)))
    assert not overlaps_itself(torch.ones(1, 1).expand(1, 1))


@functools.cache
def two_process_results() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHECKS.parents[1]), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(CHECKS), *TWO_PROCESS_CHECKS], env=env, capture_output=True, text=True, timeout=600)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, payload = line.split(" ", 2)
            results[name] = json.loads(payload)
    assert set(results) == set(TWO_PROCESS_CHECKS), done.stdout[-3000:] + done.stderr[-3000:]
    return results


def two_process(name: str) -> dict:
    result = two_process_results()[name]
    assert "exception" not in result, result.get("exception")
    return result


@pytest.mark.parametrize("check", [c for c in TWO_PROCESS_CHECKS if c.split("-")[0] in ("fsdp", "hsdp", "columns")])
def test_fsdp2_training_equals_the_eager_fsdp2_loop(check):
    """10 Adam steps on an FSDP2-sharded MLP (uneven split) or tiny GPT-2, on a 1-D mesh (or, on
    AutoAutograd, HSDP's 2-D mesh and Shard(1) matrices): the parameters equal eager FSDP2's
    loss.backward() loop; every gradient is a DTensor with its parameter's placements, written
    by into_grad into .grad; the parameters moved."""
    result = two_process(check)
    assert result["difference"] <= 1e-5
    assert result["value"] <= 1e-6  # the mean of the processes' losses (unwrapped: this process's)
    assert result["moved"] > 1e-2  # not a zero gradient: the parameters moved as eager FSDP2's did
    assert result["placements"]
    assert result["compilations"] == (1 if check.endswith(COMPILED) else 0)  # one program, no recompilation
    if not check.endswith(COMPILED):
        # FSDP2's own hooks (AutoAutograd), or the same schedule as differentiable operations
        # (AutoFunc, and DTensors unwrapped on AutoAutograd): the parameters gathered unit by
        # unit, in forward and again in backward, never the whole model at once (HSDP's mesh
        # here shards over one process: nothing to gather)
        gathers = result["gathers"]
        assert gathers == [] if check.startswith("hsdp") else len(gathers) >= 4
        assert max(gathers, default=0) <= result["largest_unit"] < result["total"]
    if check in ("fsdp-mlp-func", "fsdp-mlp-autograd-unwrapped"):
        # each Linear (the root holds none) gathered before its forward and again before its
        # backward, exactly as eager FSDP2 gathers them (padded: 33 rows over 2 ranks)
        assert result["gathers"] == [374, 136, 136, 374]
    if check == "fsdp-gpt2-func":
        assert result["gathers"] == [1088, 3280, 3280, 3280, 3280]  # the root once, each block twice
    if check == "fsdp-mlp-func":
        # per step: two all-gathers per unit, one reduce-scatter per gradient (gloo runs it as an
        # all-reduce), one all-reduce of the value
        assert result["collectives"] == {"gloo:all_gather": 4, "gloo:all_reduce": 5}
        # each gradient reduce-scattered from its own memory, copied only to pad its rows to a
        # multiple of 2 processes: both Linears here (33 rows -> 34, 3 rows -> 4), no flat bucket
        assert result["staged"] == (34 * 10 + 34 + 4 * 33 + 4) * 4
    elif check in ("fsdp-mlp-compile", "fsdp-mlp-inductor"):
        # unit by unit inside the compiled program (schedule_units; on inductor its post-grad
        # pass, and the values equal to rounding: inductor fuses): each Linear all-gathered once
        # before its forward (the first one's backward needs no weight: the input takes no
        # gradient; the last one's follows its forward at once), its gradients reduce-scattered
        # once (gloo runs it as an all-reduce), one all-reduce of the value, per step
        assert result["collectives"] == {"gloo:all_gather": 2, "gloo:all_reduce": 3}


@pytest.mark.parametrize("check", [c for c in TWO_PROCESS_CHECKS if c.startswith("ddp-")])
def test_data_parallel_equals_ddp(check):
    """10 SGD-momentum steps: DataParallel(backend) equals DistributedDataParallel's
    loss.backward() loop; the value is the mean of the processes' losses."""
    result = two_process(check)
    assert result["difference"] <= 1e-5
    assert result["value"] <= 1e-6
    assert result["compilations"] == (1 if check.endswith(COMPILED) else 0)
    assert result["collectives"] == {"gloo:all_reduce": 1}  # one flat bucket, the value inside it


@pytest.mark.parametrize(
    "case",
    [
        "fsdp_plain_functional_call_autograd",
        "fsdp_plain_functional_call_func",
        "fsdp_plain_functional_call_unwrapped_func",
        "fsdp_helper_without_dataparallel_func",
        "fsdp_native_other_tensors",
        "fsdp_native_gradient_sync_off",
        "fsdp_shard1_func",
        "fsdp_func_shards_outside_the_module",
        "mixed_placements",
        "ddp_module",
        "hessian_refused",
    ],
)
def test_bad_distributed_setups_get_clear_errors(case):
    """FSDP2's hooks inside f (the zero-gradient trap), DTensors under torch.func without
    DataParallel, mixed placements, a DDP module under DataParallel, a non-gradient operator."""
    result = two_process("errors")[case]
    assert result["ok"], result


def test_data_parallel_outside_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        td.gradient(lambda x: (x**2).sum(), td.distributed.DataParallel(td.AutoFunc()), torch.ones(3))


def test_data_parallel_is_a_hashable_validated_backend():
    backend = td.distributed.DataParallel(td.AutoCompile())
    assert backend == td.distributed.DataParallel(td.AutoCompile()) and hash(backend) == hash(td.distributed.DataParallel(td.AutoCompile()))
    assert td.check_available(backend)
    with pytest.raises(TypeError, match="backend must be"):
        td.distributed.DataParallel(td.AutoSparse(td.AutoFunc()))
    with pytest.raises(ValueError, match="op must be"):
        td.distributed.DataParallel(td.AutoFunc(), op="max")


def test_functional_call_is_torch_func_functional_call_without_fsdp():
    model = nn.Linear(3, 2)
    params = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    inputs = torch.randn(4, 3)
    torch.testing.assert_close(td.distributed.functional_call(model, params, (inputs,)), functional_call(model, params, (inputs,)))
    buffers: dict = {}
    torch.testing.assert_close(td.distributed.functional_call(model, (params, buffers), (inputs,)), functional_call(model, (params, buffers), (inputs,)))


def test_single_process_data_parallel_is_the_plain_gradient(single_process_group):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    params = dict(model.named_parameters())
    data = torch.randn(5, 3)
    want = td.gradient(loss_fn, td.AutoFunc(), params, td.Constant(model), td.Constant(data))
    for backend in (td.AutoAutograd(), td.AutoFunc()):
        got = td.gradient(loss_fn, td.distributed.DataParallel(backend), params, td.Constant(model), td.Constant(data))
        for name in want:
            torch.testing.assert_close(got[name], want[name])


@pytest.mark.slow
def test_fsdp_example_matches_eager_fsdp2():
    example = EXAMPLE.parent / "train_fsdp.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(example.parents[1]), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example), "--steps", "3"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gradient placements: (Shard(dim=0),)\n" in done.stdout
    assert float(done.stdout.split("max |param - eager FSDP2|:")[1].split()[0]) < 1e-5


def test_data_parallel_updates_state_buffers_once(single_process_group):
    """Module buffers as a State under DataParallel: updated once per call, as by the wrapped backend."""
    def bn_loss(params, buffers, model, inputs):
        return functional_call(model, (params, buffers), (inputs,)).pow(2).mean()

    results = []
    for backend in (td.AutoFunc(), td.distributed.DataParallel(td.AutoFunc())):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        grads = td.gradient(bn_loss, backend, params, td.State(buffers), td.Constant(model), td.Constant(torch.randn(8, 3, generator=torch.Generator().manual_seed(1))))
        results.append((grads, {n: b.clone() for n, b in buffers.items()}))
    (want_g, want_b), (got_g, got_b) = results
    assert int(got_b["1.num_batches_tracked"]) == 1
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name])
    for name in want_b:
        torch.testing.assert_close(got_b[name], want_b[name])


def _gathered_program(group_name: str):
    """Three FSDP2-like units as AOTAutograd flattens DataParallel(AutoCompile()): every unit's
    shard all-gathered first, the gradient of f on the full weights (forward and backward), the
    gradients reduce-scattered last."""
    c10d = torch.ops._c10d_functional

    def program(s1, s2, s3, x):
        w1, w2, w3 = (c10d.wait_tensor(c10d.all_gather_into_tensor(s, 1, group_name)) for s in (s1, s2, s3))

        def f(w1, w2, w3):
            return torch.tanh(torch.tanh(torch.tanh(x @ w1) @ w2) @ w3).sum()

        grads = torch.func.grad(f, argnums=(0, 1, 2))(w1, w2, w3)
        # (scaled by 1/world, as the mean is taken)
        return tuple(c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", 1, group_name)) * 0.5 for g in grads)

    return program


def _live_peak(graph: torch.fx.Graph, which) -> int:
    """The most tensors made by nodes ``which`` accepts that are alive at once, running ``graph``
    in its order (a value dies after its last use)."""
    nodes = list(graph.nodes)
    last = {node: max((nodes.index(user) for user in node.users), default=nodes.index(node)) for node in nodes}
    return max(sum(1 for node in nodes[: i + 1] if which(node) and last[node] >= i) for i in range(len(nodes)))


def test_schedule_units_gathers_and_reduces_one_unit_at_a_time(single_process_group):
    """AOTAutograd's graph of a DataParallel(AutoCompile()) step, rescheduled: each unit's weight
    gathered just before its forward and again before its backward when another unit ran in
    between, each gradient reduce-scattered as soon as it exists; the results unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchdi._distributed_private import schedule_units

    c10d = torch.ops._c10d_functional
    program = _gathered_program(dist.group.WORLD.group_name)
    inputs = [torch.randn(8, 8, dtype=torch.float64) for _ in range(3)] + [torch.randn(4, 8, dtype=torch.float64)]
    traced = make_fx(program)(*inputs)
    expected = traced(*inputs)

    def gathered(node):  # a full weight
        return node.target is c10d.wait_tensor.default and node.args[0].target is c10d.all_gather_into_tensor.default

    def full_gradient(node):  # what a reduce-scatter reduces
        return any(user.target is c10d.reduce_scatter_tensor.default for user in node.users)

    def reduced(node):  # a reduced gradient before its scaling
        return node.target is c10d.wait_tensor.default and node.args[0].target is c10d.reduce_scatter_tensor.default

    assert _live_peak(traced.graph, gathered) == 3 and _live_peak(traced.graph, full_gradient) == 3
    assert _live_peak(traced.graph, reduced) == 1  # (scaled at once, as traced)
    assert schedule_units(traced.graph)
    traced.recompile()
    order = [node.target for node in traced.graph.nodes]
    # w1 (its backward needs no weight: x takes no gradient), w2, w3 (forward, then its backward
    # at once), w2 again for its backward
    assert order.count(c10d.all_gather_into_tensor.default) == 4
    assert order.count(c10d.reduce_scatter_tensor.default) == 3
    assert _live_peak(traced.graph, gathered) == 1 and _live_peak(traced.graph, full_gradient) == 1
    # the scaling moves with its reduction (left at the end, inductor fuses every unit's scaling
    # into one kernel there, which holds all reduced gradients and their scaled copies at once)
    assert _live_peak(traced.graph, reduced) == 1
    assert all(node.args[0].target is c10d.wait_tensor.default for node in traced.graph.nodes if node.target is torch.ops.aten.mul.Tensor)
    assert [n.target for n in traced.graph.nodes].index(torch.ops.aten.mul.Tensor) < order.index(c10d.reduce_scatter_tensor.default, order.index(c10d.reduce_scatter_tensor.default) + 1)
    for got, want in zip(traced(*inputs), expected):
        assert torch.equal(got, want)
    assert not schedule_units(traced.graph)  # (scheduled already: nothing more to move)


def test_graphless_grad_and_value_equals_torch_func_and_builds_no_graph_of_its_backward():
    """DataParallel(AutoFunc())'s unit-by-unit gradient at the top level: torch.func.grad_and_value
    without create_graph. The same gradient and value; the gradients flowing through the backward
    carry no graph (torch.func's do, and that graph holds each layer's activation and output
    gradient until the backward ends)."""
    from torchdi._distributed_private import graphless_grad_and_value

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(t):
            return t.view_as(t)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            seen.append(g.requires_grad)
            return g

    def f(w, x):
        return torch.tanh(Spy.apply(x @ w)).pow(2).sum()

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    want_g, want_y = torch.func.grad_and_value(f)(w, x)
    transform = graphless_grad_and_value(lambda w_, x_: (f(w_, x_), None))
    assert transform is not None
    got_g, (got_y, aux) = transform(w, x)
    assert torch.equal(got_g, want_g) and torch.equal(got_y, want_y) and aux is None
    assert not got_g.requires_grad and got_g.grad_fn is None
    assert seen == [True, False]  # torch.func's backward builds its graph; this one does not


def test_schedule_units_leaves_a_graph_that_writes_into_a_shard_as_traced(single_process_group):
    """A copy of a gather reads its shard again later: where the graph writes into that shard, the
    pass changes nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchdi._distributed_private import schedule_units

    program = _gathered_program(dist.group.WORLD.group_name)

    def writes(s1, s2, s3, x):
        grads = program(s1, s2, s3, x)
        s1.add_(1.0)
        return grads

    inputs = [torch.randn(8, 8, dtype=torch.float64) for _ in range(3)] + [torch.randn(4, 8, dtype=torch.float64)]
    traced = make_fx(writes)(*[t.clone() for t in inputs])
    before = [node.format_node() for node in traced.graph.nodes]
    assert not schedule_units(traced.graph)
    assert [node.format_node() for node in traced.graph.nodes] == before
