"""FSDP2-sharded training with torchdi gradients on ``torch.distributed`` (gloo on CPU).

The model is sharded with FSDP2 (``fully_shard`` on each layer and on the root), so each process
holds only a shard of every parameter (a DTensor). torchdi differentiates it through the
``torchdi.distributed.DataParallel`` backend: each step all-gathers the shards, computes the
gradient of this process's loss, and reduce-scatters it back, averaged over the processes, as
FSDP2 does; on ``AutoCompile`` all of it is one compiled program. With ``--backend autograd``
FSDP2's own hooks run instead, gathering the parameters layer by layer (eager FSDP2's memory,
its prefetching, any mesh or placement ``fully_shard`` takes). The gradients come back as
DTensors sharded like the parameters and ``into_grad`` writes them into ``.grad``. Each process
then also trains the same model with eager FSDP2 (``loss.backward()``) and rank 0 prints the
largest parameter difference.

Run::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_fsdp.py
    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_fsdp.py --backend compile --steps 20
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchdi as td

BACKENDS: dict[str, td.backends.Backend] = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(),
    "compile-aot_eager": td.AutoCompile(compiler="aot_eager"),
}


def make_sharded_model(mesh: object) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_fn(params: dict[str, torch.Tensor], model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    # Not model(inputs) nor torch.func.functional_call: FSDP2's forward hooks would compute with
    # FSDP's own gathered parameters and every gradient would be zero (torchdi refuses that).
    logits = td.distributed.functional_call(model, params, (inputs,))
    return nn.functional.cross_entropy(logits, labels)


def train_torchdi(backend: td.backends.Backend, mesh: object, steps: int, rank: int) -> tuple[nn.Module, float]:
    model = make_sharded_model(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters())  # DTensors: this process's shards
    dp = td.distributed.DataParallel(backend)
    prep = td.prepare_gradient(loss_fn, dp, params, td.Constant(model), td.Constant(local_batch(0, rank)))
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        optimizer.zero_grad()
        loss, _ = td.value_and_gradient(
            loss_fn, dp, params, td.Constant(model), td.Constant(local_batch(step, rank)), prep=prep, out=td.into_grad(params)
        )
        optimizer.step()
    return model, float(loss)  # the loss averaged over the processes


def train_eager_fsdp(mesh: object, steps: int, rank: int) -> nn.Module:
    """The reference: the same sharded model trained with ``loss.backward()``."""
    model = make_sharded_model(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        inputs, labels = local_batch(step, rank)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
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
        mesh = init_device_mesh("cpu", (world,))
        model, loss = train_torchdi(BACKENDS[args.backend], mesh, args.steps, rank)
        reference = train_eager_fsdp(mesh, args.steps, rank)
        with torch.no_grad():
            difference = max(float((p.full_tensor() - q.full_tensor()).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
        placements = {str(p.grad.placements) for p in model.parameters()}
        if rank == 0:
            print(f"backend {args.backend}, {world} processes, {args.steps} Adam steps")
            print(f"gradient placements: {', '.join(sorted(placements))}")
            print(f"last loss (mean over processes): {loss:.4f}")
            print(f"max |param - eager FSDP2|: {difference:.2e}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
