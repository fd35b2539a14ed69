"""Data-parallel training: a DDP wrapper inside f is refused; all_reduce_ in flat buckets."""

from __future__ import annotations

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
    from torchdi.distributed import _overlaps

    assert not _overlaps(torch.ones(3, 4)) and not _overlaps(torch.ones(3, 4).t()) and not _overlaps(torch.ones(6)[::2])
    assert _overlaps(torch.ones(1).expand(3)) and _overlaps(torch.ones(3, 1).expand(3, 4))
    assert _overlaps(torch.ones(10).as_strided((3, 3), (2, 1)))
    assert not _overlaps(torch.ones(1, 1).expand(1, 1))
