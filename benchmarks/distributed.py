"""Training across two processes: torchdi's DataParallel against FSDP2's and DDP's own loops.

Two gloo processes over 127.0.0.1 (CPU, one thread each) train a tiny GPT-2 (transformers'
``GPT2LMHeadModel`` from a small ``GPT2Config``, random init, no download), each on its own
batches. Contenders, each on its own copy of the model from the same seed:

- ``FSDP2 eager``: ``fully_shard`` on each block and the root, ``loss.backward()``, Adam.
- ``FSDP2 + torch.compile(model)``: the same with the sharded model compiled.
- ``torchdi FSDP2``: the same sharded model, ``params = dict(model.named_parameters())`` (DTensors),
  ``td.value_and_gradient(loss_fn, DataParallel(AutoCompile()), ..., out=td.into_grad(params))``:
  all-gather, gradient and reduce-scatter in one compiled program, unit by unit.
- ``torchdi FSDP2 eager``: the same on ``DataParallel(AutoAutograd())``: FSDP2's own hooks
  gather and reduce unit by unit (as ``FSDP2 eager``).
- ``torch.compile(DDP(model))``: a replicated model, DDP's bucketed all-reduce in backward hooks.
- ``torchdi data parallel``: the replicated model, ``DataParallel(AutoCompile())``: the
  bucketed all-reduce inside the compiled program.

Reported by rank 0: first-step seconds (compilation included) and steps/s as the median of
interleaved repeats (each repeat times a block of steps of every contender in turn, the
processes in step through a barrier), with the ratio to the contender's PyTorch counterpart,
all from the same run.

``--memory`` measures instead, per process, the peak memory of three steps and of the preparation,
and steps/s, of FSDP2 eager against torchdi on ``DataParallel(AutoAutograd())`` (FSDP2's own
hooks, unit by unit), ``DataParallel(AutoFunc())`` (unit by unit, as differentiable operations)
and ``DataParallel(AutoCompile(compiler="aot_eager"))`` and ``DataParallel(AutoCompile())``
(inductor) (unit by unit, in one compiled program), on a model whose parameters dominate (an MLP of eight 1024x1024 layers, 8.4M
parameters, each layer and the root ``fully_shard``-ed): each contender runs in its own pair of
fresh processes and reports the largest resident set size (``/proc/self/statm``, sampled every
0.5 ms by a thread) during three steps, above the resident size before the first of them (model,
optimizer states and preparation done; ``AutoCompile``'s compilation, at its first call, too);
the same for the preparation; then steps/s over ten more steps. The processes run with
``MALLOC_MMAP_THRESHOLD_=65536``, so that every block of 64 KiB or more is returned to the
system when freed and the resident size follows the live tensors (glibc's default raises the
threshold as blocks are freed, and then keeps them: the peak would measure the allocator rather
than the tensors). Still approximate (a sampled peak, Python's own memory), but the same for all.
What CPU and gloo cannot show: gloo's collectives block the process, so the overlap of
communication with computation that FSDP2's prefetching buys on a GPU interconnect does not
exist here; steps/s compares computation and the number of collectives, not overlap.

Run: ``python benchmarks/distributed.py [--repeats N] [--steps K] [--compiler inductor|aot_eager] [--markdown FILE]``
or ``python benchmarks/distributed.py --memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.func import functional_call

import torchdi as td

Step = Callable[[int], float]


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batches(rank: int, count: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(count)]


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward_loop(model: nn.Module, compiled: str | None, data: list[torch.Tensor], compiler: str) -> Step:
    run = torch.compile(model, backend=compiler) if compiled else model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(i: int) -> float:
        ids = data[i % len(data)]
        optimizer.zero_grad()
        loss = run(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def torchdi_loop(model: nn.Module, sharded: bool, data: list[torch.Tensor], compiler: str | None) -> Step:
    """``compiler=None``: DataParallel(AutoAutograd()) (on FSDP2, FSDP2's own hooks, unit by unit);
    ``"func"``: DataParallel(AutoFunc()) (on FSDP2, unit by unit as differentiable operations)."""
    params = dict(model.named_parameters())
    optimizer = torch.optim.Adam(params.values(), lr=1e-3)
    call = td.distributed.functional_call if sharded else functional_call
    inner = td.AutoAutograd() if compiler is None else td.AutoFunc() if compiler == "func" else td.AutoCompile(compiler=compiler)
    backend = td.distributed.DataParallel(inner)

    def loss_fn(p: dict[str, torch.Tensor], m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return call(m, p, (ids,), {"labels": ids}).loss

    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data[0]))

    def step(i: int) -> float:
        ids = data[i % len(data)]
        optimizer.zero_grad()
        loss, _ = td.value_and_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(ids), prep=prep, out=td.into_grad(params))
        optimizer.step()
        return float(loss)

    return step


CONTENDERS: dict[str, tuple[str | None, Callable[[list[torch.Tensor], str], Step]]] = {
    "FSDP2 eager": (None, lambda d, c: backward_loop(shard(gpt2()), None, d, c)),
    "FSDP2 + torch.compile(model)": (None, lambda d, c: backward_loop(shard(gpt2()), "model", d, c)),
    "torchdi FSDP2": ("FSDP2 + torch.compile(model)", lambda d, c: torchdi_loop(shard(gpt2()), True, d, c)),
    "torchdi FSDP2 eager": ("FSDP2 eager", lambda d, c: torchdi_loop(shard(gpt2()), True, d, None)),
    "torchdi FSDP2 AutoFunc": ("FSDP2 eager", lambda d, c: torchdi_loop(shard(gpt2()), True, d, "func")),
    "torch.compile(DDP(model))": (None, lambda d, c: backward_loop(nn.parallel.DistributedDataParallel(gpt2()), "model", d, c)),
    "torchdi data parallel": ("torch.compile(DDP(model))", lambda d, c: torchdi_loop(gpt2(), False, d, c)),
}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = batches(rank)
        steps: dict[str, Step] = {}
        first: dict[str, float] = {}
        for name in args.contenders:
            dist.barrier()
            start = time.perf_counter()
            steps[name] = CONTENDERS[name][1](data, args.compiler)
            steps[name](0)
            first[name] = time.perf_counter() - start
        rates: dict[str, list[float]] = {name: [] for name in steps}
        names = list(steps)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:  # rotating order
                steps[name](1)
                dist.barrier()
                start = time.perf_counter()
                for i in range(args.steps):
                    steps[name](i)
                dist.barrier()
                rates[name].append(args.steps / (time.perf_counter() - start))
        if rank == 0:
            rows = []
            for name in names:
                base = CONTENDERS[name][0]
                median = statistics.median(rates[name])
                ratio = median / statistics.median(rates[base]) if base in rates else None
                rows.append({"contender": name, "first_step_s": first[name], "steps_per_s": median, "vs": base, "ratio": ratio})
            out.put(rows)
    finally:
        dist.destroy_process_group()


def big_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.Tanh()]
    return nn.Sequential(*layers)


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The largest resident set size while the block runs, above the size at its start
    (``/proc/self/statm`` sampled every 0.5 ms by a thread)."""

    def __enter__(self) -> PeakResident:
        self.base = resident_bytes()
        self.peak = self.base
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def above(self) -> int:
        return self.peak - self.base


def memory_worker(rank: int, world: int, port: int, contender: str, out: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = big_mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        params = dict(model.named_parameters())
        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)) for _ in range(3)]
        backend = td.distributed.DataParallel(MEMORY_BACKENDS[contender]) if contender in MEMORY_BACKENDS else None

        def loss_fn(p: dict[str, torch.Tensor], m: nn.Module, batch: Any) -> torch.Tensor:
            return (td.distributed.functional_call(m, p, (batch[0],)) - batch[1]).pow(2).mean()

        prep, preparation = None, None
        if backend is not None:
            with PeakResident() as measured:
                prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data[0]))
            preparation = measured.above
        for p in model.parameters():  # Adam's states exist before the measurement, for all
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()

        def step(batch: Any) -> None:
            optimizer.zero_grad()
            if prep is None:
                (model(batch[0]) - batch[1]).pow(2).mean().backward()
            else:
                td.gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params))
            optimizer.step()

        step(data[0])  # (AutoCompile compiles at its first call: not in the measurement)
        with PeakResident() as measured:
            for batch in data:
                step(batch)
        dist.barrier()
        start = time.perf_counter()
        for i in range(MEMORY_TIMED_STEPS):
            step(data[i % len(data)])
        dist.barrier()
        rate = MEMORY_TIMED_STEPS / (time.perf_counter() - start)
        if rank == 0:
            out.put((measured.above, preparation, rate, sum(p.numel() for p in params.values())))
    finally:
        dist.destroy_process_group()


MEMORY_TIMED_STEPS = 10
MEMORY_BACKENDS: dict[str, Any] = {
    "torchdi DataParallel(AutoAutograd())": td.AutoAutograd(),
    "torchdi DataParallel(AutoFunc())": td.AutoFunc(),
    "torchdi DataParallel(AutoCompile(aot_eager))": td.AutoCompile(compiler="aot_eager"),
    "torchdi DataParallel(AutoCompile())": td.AutoCompile(),
}
MEMORY_NOTES = {
    "torchdi DataParallel(AutoAutograd())": "FSDP2's own hooks, unit by unit",
    "torchdi DataParallel(AutoFunc())": "unit by unit, as differentiable operations",
    "torchdi DataParallel(AutoCompile(aot_eager))": "unit by unit, one compiled program",
    "torchdi DataParallel(AutoCompile())": "inductor, unit by unit, one compiled program",
}


def measure_memory(markdown: str | None = None) -> int:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned processes (see above)
    rows = {}
    for contender in ("FSDP2 eager", *MEMORY_BACKENDS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(memory_worker, args=(2, port, contender, out), nprocs=2, start_method="spawn")
        rows[contender] = out.get()
    eager, _, eager_rate, numel = rows["FSDP2 eager"]
    lines = [
        f"MLP 8x1024x1024 ({numel / 1e6:.1f}M parameters, each layer and the root fully_shard-ed), batch 64, 2 gloo "
        f"processes, 1 thread each, torch {torch.__version__}: peak resident set of 3 Adam steps above their start; of "
        f"the preparation above its start; steps/s of {MEMORY_TIMED_STEPS} more steps",
        "",
        "| contender | peak of a step | vs FSDP2 eager | peak of the preparation | steps/s | vs FSDP2 eager |",
        "|---|---:|---:|---:|---:|---:|",
        f"| FSDP2 eager (`loss.backward()`) | {eager / 2**20:.0f} MiB | | | {eager_rate:.1f} | |",
    ]
    for contender in MEMORY_BACKENDS:
        ours, preparation, rate, _ = rows[contender]
        lines.append(
            f"| {contender} ({MEMORY_NOTES[contender]}) | {ours / 2**20:.0f} MiB | {ours / max(eager, 1):.2f}x | "
            f"{preparation / 2**20:.0f} MiB | {rate:.1f} | {rate / eager_rate:.2f}x |"
        )
    print("\n".join(lines))
    if markdown:
        with open(markdown, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


def format_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| contender | first step (s) | steps/s | ratio |", "|---|---:|---:|---|"]
    for row in rows:
        ratio = f"{row['ratio']:.2f}x {row['vs']}" if row["ratio"] is not None else ""
        lines.append(f"| {row['contender']} | {row['first_step_s']:.1f} | {row['steps_per_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend of every compiled contender")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated: {', '.join(CONTENDERS)}")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--memory", action="store_true", help="measure per-process peak memory instead (see above)")
    args = parser.parse_args(argv)
    if args.memory:
        return measure_memory(args.markdown)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders: {sorted(unknown)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    mp.start_processes(worker, args=(2, port, args, out), nprocs=2, start_method="spawn")
    rows = out.get()
    table = format_markdown(rows)
    print(f"2 gloo processes, {args.threads} thread(s) each, compiler {args.compiler}, torch {torch.__version__}")
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
