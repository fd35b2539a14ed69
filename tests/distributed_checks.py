"""Two-process checks for tests/test_distributed.py (gloo over 127.0.0.1), run as a script.

``python tests/distributed_checks.py CHECK [CHECK ...]`` spawns two processes; each check trains
the same model with torchdi and with the eager PyTorch loop it replaces (FSDP2's or DDP's
``loss.backward()``) and rank 0 prints one line per check: ``CHECK <name> <json>``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.func import functional_call

import torchdi as td

STEPS = 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 33), nn.Tanh(), nn.Linear(33, 3))  # 33 rows: an uneven split


def gpt2(blocks: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=blocks, n_head=2, n_embd=16, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


# "gpt2-1": one block, for the compiled checks (tracing two blocks took twice as long: 52 s wall
# against 27, for a graph that repeats the first block); still two FSDP2 units and tied embeddings.
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "gpt2": gpt2, "gpt2-1": lambda: gpt2(blocks=1)}


def batch(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    if kind == "mlp":
        return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
    ids = torch.randint(0, 50, (2, 12), generator=g)
    return ids, ids


def forward(kind: str, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, call: object) -> torch.Tensor:
    if kind == "mlp":
        return nn.functional.cross_entropy(call(inputs), labels)  # type: ignore[operator]
    return call(inputs, labels=labels).loss  # type: ignore[operator]


def shard(model: nn.Module, mesh: object, placement: Callable | None = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    blocks = [m for m in model.modules() if type(m).__name__ == "GPT2Block"]  # GPT-2's lm_head is tied to wte
    for module in blocks or [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(module, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model


def shard_columns(param: torch.Tensor) -> object:
    """Matrices sharded on dim 1 where it splits evenly (FSDP2 requires it), others on dim 0
    (fully_shard's shard_placement_fn): the MLP's parameters get mixed placements."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.dim() > 1 and param.shape[1] % dist.get_world_size() == 0 else Shard(0)


def make_mesh(layout: str) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if layout == "hsdp":  # 2-D: replicated across the processes, sharded within each (of one)
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def largest_gathers(step: Callable[[], object]) -> list[int]:
    """The element counts of the parameter all-gathers ``step`` makes through ``torch.distributed``
    (FSDP2's own gathering calls ``dist.all_gather_single``, ``all_gather_into_tensor`` before torch
    2.13), in order."""
    sizes: list[int] = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def spy(output: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(output.numel())
        return real(output, *args, **kwargs)

    setattr(dist, name, spy)
    try:
        step()
    finally:
        setattr(dist, name, real)
    return sizes


BACKENDS = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(compiler="aot_eager"),
    "inductor": td.AutoCompile(),
}


def max_difference(a: nn.Module, b: nn.Module) -> float:
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    with torch.no_grad():
        return max(float((full(p) - full(q)).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def collectives(step: Callable[[], object]) -> dict[str, int]:
    """The collective calls ``step`` makes, by name, counted by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    counts: dict[str, int] = {}
    for event in profile.events():
        if event.name.startswith("gloo:"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def train_fsdp(kind: str, backend_name: str, wrapped: bool = True, layout: str = "fsdp") -> dict:
    """10 Adam steps: eager FSDP2 (loss.backward()) against torchdi on the same sharded model
    (``layout``: "fsdp" a 1-D mesh, Shard(0); "hsdp" a 2-D mesh; "columns" Shard(1) matrices)."""
    mesh = make_mesh(layout)
    placement = shard_columns if layout == "columns" else None
    make = MODELS[kind]
    reference, model = shard(make(), mesh, placement), shard(make(), mesh, placement)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters())
    backend = td.distributed.DataParallel(BACKENDS[backend_name]) if wrapped else BACKENDS[backend_name]

    def loss_fn(params, model, data):
        return forward(kind, model, *data, lambda *a, **k: td.distributed.functional_call(model, params, a, k))

    rank = dist.get_rank()
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch(kind, 0, rank)))
    placements, first, gathers, value_error = True, None, [], 0.0
    for step in range(STEPS):
        data = batch(kind, step, rank)
        ref_opt.zero_grad()
        ref_loss = forward(kind, reference, *data, reference)
        ref_loss.backward()
        ref_opt.step()
        mean_loss = ref_loss.detach().clone()
        if wrapped:  # DataParallel's value: the mean of the processes' losses
            dist.all_reduce(mean_loss)
            mean_loss /= dist.get_world_size()
        optimizer.zero_grad()
        result: list = []
        run = lambda result=result, data=data: result.append(td.value_and_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data), prep=prep, out=td.into_grad(params)))  # noqa: E731
        if step == 0:
            gathers = largest_gathers(run)
        else:
            counted = collectives(run)
        loss, grads = result[0]
        first = float(loss) if first is None else first
        value_error = max(value_error, abs(float(loss) - float(mean_loss)))
        placements &= all(type(g).__name__ == "DTensor" and g.placements == params[n].placements and g is params[n].grad for n, g in grads.items())
        optimizer.step()
    moved = max_difference(model, shard(make(), mesh, placement))
    world = mesh.size()  # type: ignore[attr-defined]
    units = [m for m in model.modules() if type(m).__name__ in ("FSDPLinear", "FSDPGPT2Block")]
    unit_sizes = [sum(-(-p.shape[0] // world) * world * p[0].numel() for p in unit.parameters()) for unit in units]  # padded as FSDP2 pads
    return {
        "difference": max_difference(model, reference), "value": value_error, "moved": moved, "placements": placements,
        "compilations": prep.num_compilations, "collectives": counted, "gathers": gathers,
        "staged": getattr(getattr(getattr(prep, "runner", None), "last_call", None), "staged_bytes", None),
        "largest_unit": max(unit_sizes, default=0), "total": sum(p.numel() for p in model.parameters()),
    }


def train_ddp(kind: str, backend_name: str) -> dict:
    """10 SGD-momentum steps: DDP(model) with loss.backward() against DataParallel(backend)."""
    make = MODELS[kind]
    reference, model = nn.parallel.DistributedDataParallel(make()), make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = dict(model.named_parameters())
    backend = td.distributed.DataParallel(BACKENDS[backend_name])

    def loss_fn(params, model, data):
        return forward(kind, model, *data, lambda *a, **k: functional_call(model, params, a, k))

    rank, world = dist.get_rank(), dist.get_world_size()
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch(kind, 0, rank)))
    value_error = 0.0
    for step in range(STEPS):
        data = batch(kind, step, rank)
        ref_opt.zero_grad()
        ref_loss = forward(kind, reference, *data, reference)
        ref_loss.backward()
        ref_opt.step()
        mean_loss = ref_loss.detach().clone()
        dist.all_reduce(mean_loss)
        optimizer.zero_grad()
        result: list = []
        counted = collectives(lambda result=result, data=data: result.append(td.value_and_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data), prep=prep, out=td.into_grad(params))))
        loss, _ = result[0]
        value_error = max(value_error, abs(float(loss) - float(mean_loss) / world))
        optimizer.step()
    return {"difference": max_difference(model, reference.module), "value": value_error, "compilations": prep.num_compilations, "collectives": counted}


def expect_error(call, kind: type, *fragments: str) -> dict:
    try:
        call()
    except kind as error:
        missing = [f for f in fragments if f not in str(error)]
        return {"ok": not missing, "missing": missing, "message": str(error)[:300]}
    except Exception as error:
        return {"ok": False, "message": f"{type(error).__name__}: {error}"[:300]}
    return {"ok": False, "message": "no error"}


def errors() -> dict:
    """Bad set-ups get clear errors, never a zero gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard(mlp(), mesh)
    params = dict(model.named_parameters())
    data = td.Constant(batch("mlp", 0, dist.get_rank()))

    def plain_loss(params, model, data):  # the unsupported way: FSDP's hooks run
        return nn.functional.cross_entropy(functional_call(model, params, (data[0],)), data[1])

    def helper_loss(params, model, data):
        return nn.functional.cross_entropy(td.distributed.functional_call(model, params, (data[0],)), data[1])

    out = {}
    for name in ("autograd", "func"):
        out[f"fsdp_plain_functional_call_{name}"] = expect_error(
            lambda name=name: td.gradient(plain_loss, td.distributed.DataParallel(BACKENDS[name]), params, td.Constant(model), data),
            ValueError, "FSDP2-sharded", "torchdi.distributed.functional_call", "DataParallel",
        )
    out["fsdp_plain_functional_call_unwrapped_func"] = expect_error(
        lambda: td.gradient(plain_loss, td.AutoFunc(), params, td.Constant(model), data), ValueError, "zero", "DataParallel"
    )
    out["fsdp_helper_without_dataparallel_func"] = expect_error(
        # detached: with parameters that require grad, AutoFunc's gradient runs on torch.autograd's
        # own graph (rule 10's autograd-native variant), which differentiates DTensors unwrapped
        lambda: td.gradient(helper_loss, td.AutoFunc(), {n: p.detach() for n, p in params.items()}, td.Constant(model), data),
        td.UnsupportedOperatorError, "DataParallel(torchdi.AutoFunc())",
    )
    def copy_loss(params, model, data):  # computes with other tensors than the module's own
        return helper_loss({n: p * 1.0 for n, p in params.items()}, model, data)

    out["fsdp_native_other_tensors"] = expect_error(
        lambda: td.gradient(copy_loss, td.distributed.DataParallel(td.AutoAutograd()), params, td.Constant(model), data),
        ValueError, "FSDP2's own hooks", "DataParallel(AutoFunc())",
    )
    nosync = shard(mlp(), make_mesh("fsdp"))
    nosync.set_requires_gradient_sync(False)
    out["fsdp_native_gradient_sync_off"] = expect_error(
        lambda: td.gradient(helper_loss, td.distributed.DataParallel(td.AutoAutograd()), dict(nosync.named_parameters()), td.Constant(nosync), data),
        ValueError, "set_requires_gradient_sync(False)", "into_grad",
    )
    def penalty_loss(params, model, data):  # a weight penalty on f's x: shards, layer by layer
        return helper_loss(params, model, data) + 1e-3 * sum(p.pow(2).sum() for p in params.values())

    out["fsdp_func_shards_outside_the_module"] = expect_error(
        lambda: td.gradient(penalty_loss, td.distributed.DataParallel(td.AutoFunc()), params, td.Constant(model), data),
        ValueError, "other than through torchdi.distributed.functional_call", "DataParallel(torchdi.AutoCompile())",
    )
    columns = shard(mlp(), make_mesh("fsdp"), shard_columns)
    out["fsdp_shard1_func"] = expect_error(
        lambda: td.gradient(helper_loss, td.distributed.DataParallel(td.AutoFunc()), dict(columns.named_parameters()), td.Constant(columns), data),
        ValueError, "Shard(dim=1)", "DataParallel(torchdi.AutoAutograd())",
    )
    plain = mlp()
    mixed = {**{f"a.{n}": p for n, p in params.items()}, **{f"b.{n}": p for n, p in plain.named_parameters()}}
    out["mixed_placements"] = expect_error(
        lambda: td.gradient(lambda p: sum(t.sum() for t in p.values()), td.distributed.DataParallel(td.AutoFunc()), mixed),
        ValueError, "mixed placements",
    )
    ddp = nn.parallel.DistributedDataParallel(mlp())
    out["ddp_module"] = expect_error(
        lambda: td.gradient(plain_loss, td.distributed.DataParallel(td.AutoFunc()), dict(ddp.named_parameters()), td.Constant(ddp), data),
        ValueError, "DistributedDataParallel-wrapped", "ddp_model.module", "DataParallel",
    )
    out["hessian_refused"] = expect_error(
        lambda: td.hessian(lambda x: (x**3).sum(), td.distributed.DataParallel(td.AutoFunc()), torch.ones(3)),
        td.UnsupportedOperatorError, "gradient",
    )
    return out


CHECKS = {
    "fsdp-mlp-autograd": lambda: train_fsdp("mlp", "autograd"),
    "fsdp-mlp-autograd-unwrapped": lambda: train_fsdp("mlp", "autograd", wrapped=False),
    "fsdp-gpt2-autograd": lambda: train_fsdp("gpt2", "autograd"),
    "hsdp-mlp-autograd": lambda: train_fsdp("mlp", "autograd", layout="hsdp"),
    "columns-mlp-autograd": lambda: train_fsdp("mlp", "autograd", layout="columns"),
    "fsdp-mlp-func": lambda: train_fsdp("mlp", "func"),
    "fsdp-mlp-compile": lambda: train_fsdp("mlp", "compile"),
    "fsdp-gpt2-func": lambda: train_fsdp("gpt2", "func"),
    "fsdp-gpt2-compile": lambda: train_fsdp("gpt2-1", "compile"),
    "fsdp-mlp-inductor": lambda: train_fsdp("mlp", "inductor"),
    "ddp-mlp-func": lambda: train_ddp("mlp", "func"),
    "ddp-mlp-autograd": lambda: train_ddp("mlp", "autograd"),
    "ddp-mlp-compile": lambda: train_ddp("mlp", "compile"),
    "ddp-gpt2-func": lambda: train_ddp("gpt2", "func"),
    "ddp-gpt2-compile": lambda: train_ddp("gpt2-1", "compile"),
    "errors": errors,
}


def worker(rank: int, world: int, port: int, names: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name in names:
            try:
                result = CHECKS[name]()
            except Exception:
                result = {"exception": traceback.format_exc()[-3000:]}
            if rank == 0:
                print(f"CHECK {name} {json.dumps(result)}", flush=True)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(2, free_port(), sys.argv[1:]), nprocs=2)
