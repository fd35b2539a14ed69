"""What a prepared ``AutoCompile`` gradient costs next to calling the compiled function directly.

One process, contenders interleaved (each repeat times a block of calls of every contender in
turn, in every order in turn, after one untimed call), medians over repeats:

- ``torchdi``: ``torchdi.gradient(f, AutoCompile(), x, *contexts, prep=prep)``
- ``raw``: ``torch.compile(torch.func.grad(f), fullgraph=True)`` called directly
- ``torchdi vag``: ``torchdi.value_and_gradient`` with the same ``prep`` (one program serves both)
- ``raw gv``: ``torch.compile(torch.func.grad_and_value(f), fullgraph=True)`` called directly
- ``autograd``: eager ``torch.autograd.grad``
- ``jax``: ``jax.jit(jax.grad(f))`` (only when jax is importable)

Scenarios: (a) Rosenbrock with 1e6 float32 entries, (b) a small MLP loss (32 -> 64 -> 1) with
respect to its input, (c) an MLP loss with respect to a dict of parameters.

Run: ``python benchmarks/compile_overhead.py [--repeats N] [--compiler inductor] [--threads 1] [--scenarios abc]
[--device cuda] [--mode reduce-overhead]`` or ``python -m torchdi bench --suite compile-overhead``. On a CUDA
device every timed call ends with ``torch.cuda.synchronize()`` (the time of the work, not of its launch).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import torchdi as td


@dataclass
class Case:
    name: str
    f: Callable[..., torch.Tensor]
    x: Any
    contexts: tuple[Any, ...]  # plain values, wrapped in td.Constant for torchdi
    jax_case: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]] | None = None


def rosenbrock(x: torch.Tensor) -> torch.Tensor:
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def mlp_input_loss(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (w2 @ torch.tanh(w1 @ x + b1)).sum()


def mlp_params_loss(params: dict[str, torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(inputs @ params["w1"].T + params["b1"])
    out = hidden @ params["w2"].T + params["b2"]
    return ((out - targets) ** 2).mean()


def cases(device: str = "cpu") -> list[Case]:
    g = torch.Generator().manual_seed(0)
    w1, b1, w2 = torch.randn(64, 32, generator=g), torch.randn(64, generator=g), torch.randn(1, 64, generator=g)
    params = {
        "w1": torch.randn(64, 32, generator=g) * 0.1,
        "b1": torch.zeros(64),
        "w2": torch.randn(1, 64, generator=g) * 0.1,
        "b2": torch.zeros(1),
    }
    inputs, targets = torch.randn(128, 32, generator=g), torch.randn(128, 1, generator=g)

    def jax_rosenbrock() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax.numpy as jnp

        def f(x: Any) -> Any:
            return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()

        return f, (jnp.asarray(x_rosen.numpy()),)

    def jax_mlp_input() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax.numpy as jnp

        def f(x: Any, w1_: Any, b1_: Any, w2_: Any) -> Any:
            return (w2_ @ jnp.tanh(w1_ @ x + b1_)).sum()

        return f, tuple(jnp.asarray(t.numpy()) for t in (x_mlp, w1, b1, w2))

    def jax_mlp_params() -> tuple[Callable[..., Any], tuple[Any, ...]]:
        import jax.numpy as jnp

        def f(p: Any, inputs_: Any, targets_: Any) -> Any:
            hidden = jnp.tanh(inputs_ @ p["w1"].T + p["b1"])
            return (((hidden @ p["w2"].T + p["b2"]) - targets_) ** 2).mean()

        return f, ({k: jnp.asarray(v.numpy()) for k, v in params.items()}, jnp.asarray(inputs.numpy()), jnp.asarray(targets.numpy()))

    x_rosen = torch.rand(1_000_000, generator=g)
    x_mlp = torch.randn(32, generator=g)
    if device != "cpu":  # the same values on the device; JAX (a CPU contender here) is left out there
        w1, b1, w2, x_rosen, x_mlp, inputs, targets = (t.to(device) for t in (w1, b1, w2, x_rosen, x_mlp, inputs, targets))
        params = {name: t.to(device) for name, t in params.items()}
    on_cpu = device == "cpu"
    return [
        Case("rosenbrock 1e6 (a)", rosenbrock, x_rosen, (), jax_rosenbrock if on_cpu else None),
        Case("mlp 32-64-1 wrt input (b)", mlp_input_loss, x_mlp, (w1, b1, w2), jax_mlp_input if on_cpu else None),
        Case("mlp wrt dict of params (c)", mlp_params_loss, params, (inputs, targets), jax_mlp_params if on_cpu else None),
    ]


def _calls_per_block(fn: Callable[[], Any], target_seconds: float = 0.02) -> int:
    start = time.perf_counter()
    fn()
    elapsed = max(time.perf_counter() - start, 1e-7)
    return max(1, min(2000, int(target_seconds / elapsed)))


def measure(contenders: dict[str, Callable[[], Any]], repeats: int, timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each contender, timed in interleaved blocks (``timer``: wall
    clock by default; ``time.thread_time`` counts only this thread's CPU time, which is all the work
    with one torch thread, and not the time other processes take the core away)."""
    for fn in contenders.values():  # warm-up
        for _ in range(3):
            fn()
    blocks = {name: _calls_per_block(fn) for name, fn in contenders.items()}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    orders = itertools.cycle(itertools.permutations(contenders))
    for _ in range(repeats):
        # Every contender follows every other equally often, and each block starts with an
        # untimed call: a block run right after autograd's allocations starts with cold caches.
        for name in next(orders):
            fn = contenders[name]
            n = blocks[name]
            fn()
            start = timer()
            for _ in range(n):
                fn()
            samples[name].append((timer() - start) / n)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(
    repeats: int = 15,
    compiler: str = "inductor",
    progress: Callable[[str], None] | None = None,
    scenarios: str = "abc",
    timer: Callable[[], float] = time.perf_counter,
    device: str = "cpu",
    mode: str | None = None,
) -> list[dict[str, Any]]:
    """Measure every case (those whose letter is in ``scenarios``) on ``device``, compiled with
    ``mode`` (torchdi and raw alike); returns one row per case with per-call times and ratios."""
    backend = td.AutoCompile(compiler=compiler, mode=mode)
    rows = []
    for case in cases(device):
        if case.name[-2] not in scenarios:
            continue
        if progress:
            progress(f"compile_overhead: {case.name}: preparing")
        wrapped = tuple(td.Constant(c) for c in case.contexts)
        prep = td.prepare_gradient(case.f, backend, case.x, *wrapped)
        raw = torch.compile(torch.func.grad(case.f), backend=compiler, fullgraph=True, mode=mode)
        raw_gv = torch.compile(torch.func.grad_and_value(case.f), backend=compiler, fullgraph=True, mode=mode)
        reference = td.gradient(case.f, td.AutoAutograd(), case.x, *wrapped)
        ours = td.gradient(case.f, backend, case.x, *wrapped, prep=prep)
        # A raw CUDA-graph program (mode="reduce-overhead") overwrites its outputs at the next
        # replay of its graph tree: its results are copied before anything else runs.
        theirs = torch.utils._pytree.tree_map(torch.clone, raw(case.x, *case.contexts))
        our_value, ours_too = td.value_and_gradient(case.f, backend, case.x, *wrapped, prep=prep)
        their_gradient, their_value = torch.utils._pytree.tree_map(torch.clone, raw_gv(case.x, *case.contexts))
        leaves = torch.utils._pytree.tree_leaves
        correct = all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-4) and torch.allclose(c, b, rtol=1e-4, atol=1e-4)
            for a, b, c in zip(leaves((ours, ours_too, our_value)), leaves((reference, reference, their_value)), leaves((theirs, their_gradient, their_value)))
        )

        def autograd_call(case: Case = case) -> Any:
            leaves, spec = torch.utils._pytree.tree_flatten(case.x)
            tracked = [leaf.detach().requires_grad_() for leaf in leaves]
            loss = case.f(torch.utils._pytree.tree_unflatten(tracked, spec), *case.contexts)
            return torch.autograd.grad(loss, tracked)

        contenders: dict[str, Callable[[], Any]] = {
            "torchdi": lambda case=case, prep=prep, wrapped=wrapped: td.gradient(case.f, backend, case.x, *wrapped, prep=prep),
            "raw": lambda case=case, raw=raw: raw(case.x, *case.contexts),
            "torchdi vag": lambda case=case, prep=prep, wrapped=wrapped: td.value_and_gradient(case.f, backend, case.x, *wrapped, prep=prep),
            "raw gv": lambda case=case, raw_gv=raw_gv: raw_gv(case.x, *case.contexts),
            "autograd": autograd_call,
        }
        jax_fn = _jax_contender(case)
        if jax_fn is not None:
            contenders["jax"] = jax_fn
        if device.startswith("cuda"):
            contenders = {name: _synchronized(fn) for name, fn in contenders.items()}
        if progress:
            progress(f"compile_overhead: {case.name}: timing {', '.join(contenders)}")
        times = measure(contenders, repeats, timer)
        row: dict[str, Any] = {"scenario": case.name, "correct": correct, "compilations": prep.num_compilations}
        row.update({f"{name} (us)": seconds * 1e6 for name, seconds in times.items()})
        row["torchdi / raw"] = times["torchdi"] / times["raw"]
        row["vag / raw gv"] = times["torchdi vag"] / times["raw gv"]
        row["autograd / torchdi"] = times["autograd"] / times["torchdi"]
        if "jax" in times:
            row["jax / torchdi"] = times["jax"] / times["torchdi"]
        rows.append(row)
    return rows


def _synchronized(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        result = fn()
        torch.cuda.synchronize()
        return result

    return call


def _jax_contender(case: Case) -> Callable[[], Any] | None:
    if case.jax_case is None:
        return None
    try:
        import jax
    except ImportError:
        return None
    f, args = case.jax_case()
    compiled = jax.jit(jax.grad(f))

    def call() -> Any:
        return jax.block_until_ready(compiled(*args))

    return call


def format_rows(rows: list[dict[str, Any]]) -> str:
    columns = [
        "scenario", "torchdi (us)", "raw (us)", "torchdi vag (us)", "raw gv (us)", "autograd (us)", "jax (us)",
        "torchdi / raw", "vag / raw gv", "autograd / torchdi", "jax / torchdi", "compilations", "correct",
    ]
    columns = [c for c in columns if any(c in row for row in rows)]

    def cell(row: dict[str, Any], column: str) -> str:
        value = row.get(column, "n/a")
        if isinstance(value, bool):
            return "ok" if value else "FAIL"
        if isinstance(value, float):
            return f"{value:.2f}" if "/" in column else f"{value:.1f}"
        return str(value)

    table = [columns] + [[cell(row, c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(line, widths)) + " |" for line in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compiler", default="inductor")
    # One thread by default, as update_readme.py: on a shared 2-core machine two threads stall
    # whenever the other core is busy, and the medians swing far more than the ratios measured.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown (the docs include it)")
    parser.add_argument("--scenarios", default="abc", help="the scenarios to run, by letter (default abc)")
    parser.add_argument(
        "--timer", choices=("wall", "cpu"), default="wall",
        help="wall: perf_counter (default); cpu: this thread's CPU time (a shared machine: one thread only)",
    )
    parser.add_argument("--device", default="cpu", help="where the tensors live (default cpu; e.g. cuda)")
    parser.add_argument("--mode", default=None, help="torch.compile mode for torchdi and raw alike (e.g. reduce-overhead)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and args.timer == "cpu":
        parser.error("--timer cpu counts no device time: use the wall timer with --device cuda")
    torch.set_num_threads(args.threads)
    rows = run(args.repeats, args.compiler, progress=lambda m: print(m, file=sys.stderr, flush=True), scenarios=args.scenarios,
               timer=time.thread_time if args.timer == "cpu" else time.perf_counter, device=args.device, mode=args.mode)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    setting = (
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, compiler={args.compiler}"
        + (f", mode={args.mode}" if args.mode else "")
        + f"; medians of {args.repeats} interleaved repeats"
        + ("; thread CPU time" if args.timer == "cpu" else "")
    )
    print(setting)
    print(format_rows(rows))
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(f"### `benchmarks/compile_overhead.py`\n\n{setting}.\n\n{format_rows(rows)}\n")
    return 0 if all(row["correct"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
