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
