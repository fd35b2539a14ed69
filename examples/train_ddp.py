"""Data-parallel training with torchdi gradients on ``torch.distributed`` (gloo on CPU).

Each process differentiates the plain model (not a ``DistributedDataParallel`` wrapper, whose
gradient hooks only ``loss.backward()`` fires) on its shard of every global batch, then
averages the gradients over the processes with ``torchdi.distributed.all_reduce_``: one flat
bucket, one collective call per step. Rank 0 then trains the same model in a single process on
the full batches with ``loss.backward()`` and prints the largest parameter difference.

Run::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_ddp.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_ddp.py --backend compile --steps 20

It prints the collective calls per step (counted by the profiler), the final loss and the
difference from the single-process run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import torchdi as td

BACKENDS: dict[str, td.backends.Backend] = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(),
    "compile-aot_eager": td.AutoCompile(compiler="aot_eager"),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def global_batch(step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)


def loss_fn(params: dict[str, torch.Tensor], model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(functional_call(model, params, (inputs,)), labels)


def train_data_parallel(backend: td.backends.Backend, steps: int, rank: int, world: int) -> tuple[nn.Module, float, int]:
    """Train on this rank's shard of each global batch; returns the model, the last local loss
    and the collective calls made by the last step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = dict(model.named_parameters())

    def shard(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = global_batch(step)
        return inputs.chunk(world)[rank], labels.chunk(world)[rank]

    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(shard(0)))
    loss, collectives = float("nan"), 0
    for step in range(steps):
        # The last step runs under the profiler, which counts its collective calls.
        profiling = step == steps - 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiling else contextlib.nullcontext() as profile:
            optimizer.zero_grad()
            value, grads = td.value_and_gradient(
                loss_fn, backend, params, td.Constant(model), td.Constant(shard(step)), prep=prep, out=td.into_grad(params)
            )
            td.distributed.all_reduce_(grads)  # the mean over processes: the full batch's gradient
            optimizer.step()
        if profile is not None:
            collectives = sum(1 for event in profile.events() if event.name.startswith("gloo:all_reduce"))
        loss = float(value)
    return model, loss, collectives


def train_single_process(steps: int) -> nn.Module:
    """The reference: one process, full batches, ``loss.backward()``."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(dict(model.named_parameters()), model, global_batch(step)).backward()
        optimizer.step()
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="func")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")  # rank and world size from python -m torch.distributed.run
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model, loss, collectives = train_data_parallel(BACKENDS[args.backend], args.steps, rank, world)
        if rank == 0:
            reference = train_single_process(args.steps)
            with torch.no_grad():
                difference = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
            print(f"backend {args.backend}, {world} processes, {args.steps} steps")
            print(f"collective calls per step: {collectives}")
            print(f"last local loss: {loss:.4f}")
            print(f"max |param - single-process full batch|: {difference:.2e}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
