"""Training steps per second: torchdi against the loops a PyTorch user already writes.

For each workload, every contender trains its own copy of the model from the same seed on the
same synthetic batches:

- ``eager``: ``loss = loss_fn(model(x)); loss.backward(); optimizer.step()``
- ``torch.compile``: the same loop with ``model = torch.compile(model)`` (inductor)
- ``torch.compile(model+loss)``: the same loop with the whole loss, ``loss_fn(model(x))``, compiled:
  what torchdi compiles, as the function ``f`` holds the loss
- ``torchdi <backend>``: ``td.value_and_gradient(..., prep=prep, out=td.into_grad(params))``
  then ``optimizer.step()``, module buffers passed as ``td.State`` where the model has any

Reported: first-step seconds (preparation or compilation included), then steps/s as the median
of interleaved repeats (each repeat times a block of steps of every contender in turn, in a
rotating order), and the ratio to ``torch.compile``, all from the same run. A contender that
fails says why in its row. Workloads whose package is missing are skipped, saying so.

Each first step is timed in a Python process of its own, with an empty inductor cache (a fresh
``TORCHINDUCTOR_CACHE_DIR``) and after inductor's one-time start-up: within one process a
contender would reuse the kernels and traces another one compiled before it. Then it is timed
again in a second fresh process on the cache the first one filled: the first step of a script
run again, where inductor's and AOTAutograd's on-disk caches skip the compilation and what is
left is dynamo's tracing. ``--warm-cache`` keeps your cache; ``--first-step-in-process`` times it
in the benchmark's process (faster, biased towards later contenders, no re-run column).

Run: ``python benchmarks/training.py [--repeats N] [--steps K] [--threads T] [--markdown FILE]``
or ``python -m torchdi bench --suite training``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import torchdi as td

Step = Callable[[], float]


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]  # the same model from the same seed on every call
    batches: list[Any]  # (inputs, targets) cycled through
    loss_of_output: Callable[[Any, Any], torch.Tensor]  # loss from model(inputs) and targets
    optimizer: Callable[[Any], torch.optim.Optimizer]
    call: Callable[[Any, Any], Any] = field(default=lambda model, inputs: model(inputs))


def mlp_dropout() -> Workload:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))

    return Workload("mlp-dropout", make, batches, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01))


def cnn_batchnorm() -> Workload:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )

    return Workload("cnn-batchnorm", make, batches, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def resnet18_small() -> Workload:
    torchvision = importlib.import_module("torchvision")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10)

    return Workload("resnet18-32px", make, batches, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def gpt2_tiny() -> Workload:
    transformers = importlib.import_module("transformers")
    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    batches = [(ids, ids) for ids in (torch.randint(0, 512, (4, 64), generator=g) for _ in range(4))]

    def make() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        return transformers.GPT2LMHeadModel(config)

    return Workload(
        "gpt2-tiny",
        make,
        batches,
        lambda loss, _: loss,
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        call=lambda model, ids: model(ids, labels=ids).loss,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp-dropout": mlp_dropout,
    "cnn-batchnorm": cnn_batchnorm,
    "resnet18-32px": resnet18_small,
    "gpt2-tiny": gpt2_tiny,
}


def plain_loop(work: Workload, compiled: str | None) -> Step:
    """The ``loss.backward()`` loop; ``compiled``: ``None``, ``"model"`` or ``"model+loss"``."""
    model = work.make_model().train()
    optimizer = work.optimizer(model.parameters())
    counter = iter(range(10**9))
    runner = torch.compile(model) if compiled == "model" else model

    def loss_of(inputs: Any, targets: Any) -> torch.Tensor:
        return work.loss_of_output(work.call(runner, inputs), targets)

    loss_fn = torch.compile(loss_of) if compiled == "model+loss" else loss_of

    def step() -> float:
        inputs, targets = work.batches[next(counter) % len(work.batches)]
        optimizer.zero_grad()
        loss = loss_fn(inputs, targets)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def torchdi_loop(work: Workload, backend: td.backends.Backend) -> Step:
    model = work.make_model().train()
    optimizer = work.optimizer(model.parameters())
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())

    def loss_fn(p: dict[str, torch.Tensor], state: dict[str, torch.Tensor], m: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return work.loss_of_output(work.call(_Functional(m, p, state), inputs), targets)

    counter = iter(range(10**9))
    prep: list[td.Prep] = []

    def step() -> float:
        batch = work.batches[next(counter) % len(work.batches)]
        contexts = (td.State(buffers), td.Constant(model), td.Constant(batch))
        if not prep:
            prep.append(td.prepare_gradient(loss_fn, backend, params, *contexts))
        optimizer.zero_grad()
        loss, _ = td.value_and_gradient(loss_fn, backend, params, *contexts, prep=prep[0], out=td.into_grad(params))
        optimizer.step()
        return float(loss)

    return step


class _Functional:
    """``model`` called with ``params`` and ``buffers`` through ``functional_call``."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        self.model, self.params, self.buffers = model, params, buffers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.model, (self.params, self.buffers), args, kwargs)


CONTENDERS: dict[str, Callable[[Workload], Step]] = {
    "eager": lambda w: plain_loop(w, compiled=None),
    "torch.compile": lambda w: plain_loop(w, compiled="model"),
    "torch.compile(model+loss)": lambda w: plain_loop(w, compiled="model+loss"),
    "torchdi AutoAutograd": lambda w: torchdi_loop(w, td.AutoAutograd()),
    "torchdi AutoFunc": lambda w: torchdi_loop(w, td.AutoFunc()),
    "torchdi AutoCompile": lambda w: torchdi_loop(w, td.AutoCompile()),
}


def warm_up_inductor() -> None:
    """Inductor's one-time start-up (imports, its C++ toolchain check and headers), paid here,
    not by whichever contender happens to compile first."""
    torch.compile(lambda t: (t * 2).sum())(torch.ones(4, requires_grad=True)).backward()


def first_step_seconds(work: Workload, contender: str) -> float:
    """Seconds of ``contender``'s first step on ``work``, in this process."""
    loop = CONTENDERS[contender](work)
    start = time.perf_counter()
    loop()
    return time.perf_counter() - start


def first_steps_in_fresh_processes(workload: str, contender: str, threads: int, warm_cache: bool) -> tuple[float | None, float | None]:
    """``first_step_seconds`` in a new Python process (its own inductor cache unless
    ``warm_cache``), then in another one on the cache the first filled (a re-run of the script)."""
    # The child keeps the cache directory chosen here (--warm-cache): a fresh one, or yours.
    command = [sys.executable, os.path.abspath(__file__), "--first-step", workload, contender, "--threads", str(threads), "--warm-cache"]
    env = dict(os.environ)
    if not warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchdi-training-inductor-")

    def timed() -> float | None:
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        lines = done.stdout.strip().splitlines()
        return json.loads(lines[-1])["first_step_s"] if done.returncode == 0 and lines else None

    first = timed()
    return first, None if first is None else timed()


FirstSteps = Callable[[str], tuple[float | None, float | None]]


def run_workload(
    work: Workload, repeats: int, steps: int, log: Callable[[str], None], first_steps: FirstSteps | None = None
) -> list[dict[str, Any]]:
    """Rows of ``work``'s table. ``first_steps(contender)`` times a first step and its re-run
    elsewhere (fresh processes); without it, the first step of this process's loop is timed."""
    rows: dict[str, dict[str, Any]] = {}
    loops: dict[str, Step] = {}
    for name, make in CONTENDERS.items():
        row: dict[str, Any] = {
            "workload": work.name, "contender": name, "first_step_s": None, "rerun_first_step_s": None, "steps_per_s": None, "note": ""
        }
        rows[name] = row
        try:
            loop = make(work)
            start = time.perf_counter()
            loop()
            if first_steps is None:
                row["first_step_s"] = time.perf_counter() - start
            else:
                row["first_step_s"], row["rerun_first_step_s"] = first_steps(name)
            loops[name] = loop
        except Exception as error:  # reported in the table, as a user would meet it
            row["note"] = f"fails: {type(error).__name__}: {' '.join(str(error).split())[:160]}"
        log(f"{work.name}: {name} first step {row['first_step_s'] or float('nan'):.1f} s, "
            f"re-run {row['rerun_first_step_s'] or float('nan'):.1f} s {row['note']}")
    samples: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(steps):
                loops[name]()
            samples[name].append(steps / (time.perf_counter() - start))
    for name, values in samples.items():
        rows[name]["steps_per_s"] = statistics.median(values)
    baseline = rows["torch.compile"]["steps_per_s"]
    for row in rows.values():
        row["vs_compile"] = None if baseline is None or row["steps_per_s"] is None else row["steps_per_s"] / baseline
    return list(rows.values())


def format_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | contender | first step (s) | first step, re-run (s) | steps/s | vs torch.compile | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    def num(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "—" if value is None else format(value, fmt)

    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['contender']} | {num(row, 'first_step_s', '.1f')} | {num(row, 'rerun_first_step_s', '.1f')} | "
            f"{num(row, 'steps_per_s', '.1f')} | "
            f"{num(row, 'vs_compile', '.2f')}{'x' if row.get('vs_compile') is not None else ''} | {row['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's on-disk cache (default: a fresh one, so first steps compile from scratch)")
    parser.add_argument("--first-step-in-process", action="store_true",
                        help="time first steps in this process (faster; later contenders reuse earlier ones' kernels)")
    parser.add_argument("--first-step", nargs=2, metavar=("WORKLOAD", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.warm_cache:
        # A graph compiled by an earlier run would load from inductor's cache in a second and make
        # first-step times meaningless: every run starts cold.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchdi-training-inductor-")
    warm_up_inductor()
    if args.first_step:  # the child process of first_step_in_fresh_process
        workload, contender = args.first_step
        print(json.dumps({"first_step_s": first_step_seconds(WORKLOADS[workload](), contender)}))
        return 0
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name in args.workloads.split(","):
        try:
            work = WORKLOADS[name]()
        except Exception as error:  # a missing or mismatched package
            skipped.append(f"{name}: skipped, its package does not load here ({type(error).__name__}: {' '.join(str(error).split())[:120]})")
            print(skipped[-1], file=sys.stderr, flush=True)
            continue
        fresh = None if args.first_step_in_process else (
            lambda contender, name=name: first_steps_in_fresh_processes(name, contender, args.threads, args.warm_cache)
        )
        rows += run_workload(work, args.repeats, args.steps, lambda m: print(m, file=sys.stderr, flush=True), fresh)
    where = "in this process" if args.first_step_in_process else "in a fresh process each"
    header = (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); steps/s: medians of {args.repeats} interleaved "
        f"repeats of {args.steps} steps; first step includes preparation / compilation, timed {where}"
        f"{' with a warm inductor cache' if args.warm_cache else ', from an empty inductor cache'}"
        f"{'' if args.first_step_in_process else '; re-run: again in a new process on the cache the first one filled'}"
    )
    table = "\n".join([header, "", format_markdown(rows), *(["", *skipped] if skipped else [])])
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
