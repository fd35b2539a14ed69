"""Cold start: the first result of a fresh process, with empty caches (cold) and on a re-run (warm).

    python benchmarks/cold_start.py [--problems mlp,rosenbrock,brusselator] [--contenders ...] [--markdown FILE]
    python benchmarks/cold_start.py --phases --problems mlp --contenders torchdi-persist,raw

Each measurement is a fresh Python process (one thread) that imports torch, prepares, and
computes one result; it reports the seconds from its start (before ``import torch``) to that
result, the seconds of preparation plus first call alone, whether dynamo was imported by then,
and the time of one call after that (the median of 7 repeats of 50 calls). Each contender gets its own empty
inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) and, for torchdi, its own empty
``TORCHDI_CACHE_DIR``: "cold" is its first process, "warm" its second one on the caches the
first one left. (Without fresh directories every contender after the first would find
inductor's default ``/tmp/torchinductor_$USER`` cache warm.)

Contenders:
- ``torchdi-persist``: ``AutoCompile(cache_dir=<its dir>)`` (Mega-Cache artifacts persisted by
  torchdi), ``AutoSparse(AutoCompile(cache_dir=...))`` on the Brusselator.
- ``torchdi``: ``AutoCompile(cache_dir="")``: inductor's own on-disk caches only.
- ``torchdi-sparse-eager``: ``AutoSparse(AutoFunc())`` with its default persistence (Brusselator
  only: the persisted pattern and colouring, nothing compiled).
- ``raw``: ``torch.compile(torch.func.grad_and_value(f))`` (Brusselator: ``torch.compile(jacfwd(f))``,
  dense).
- ``jax``: ``jax.jit(jax.value_and_grad(f))`` when JAX is importable (it is skipped otherwise).
- ``torchdi-aoti``: ``AutoCompile(compiler="aot_inductor", cache_dir=<its dir>)`` (its
  AOTInductor programs and their seals persisted by torchdi: a warm run loads them without
  importing dynamo; ``AutoSparse`` of it on the Brusselator).

``--phases``: where a torch contender's time goes. Its processes import dynamo and inductor
explicitly before preparing (so "prepare + first call" then leaves those imports out: they are
columns of their own), and report dynamo's own timers (``torch._dynamo.utils.
compilation_time_metrics``): dynamo's bytecode tracing, the compiler call, inductor's load of a
cached program (``PyCodeCache.load_by_key_path``, with the C++ build step ``compile_file`` and
the hash of torch's sources ``inductor_codecache_torch_key`` it needs), building the guards.

Problems: the small MLP ``(W2 @ tanh(W1 @ x)).sum()`` (x of 32), Rosenbrock with n = 1e5
(gradient), the 2-D Brusselator N=32 (sparse jacobian, 2048 x 2048).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

START = time.perf_counter()

PROBLEMS = ("mlp", "rosenbrock", "brusselator")
CONTENDERS = ("torchdi-aoti", "torchdi-persist", "torchdi", "torchdi-sparse-eager", "raw", "jax")


def applies(contender: str, problem: str) -> bool:
    if contender == "torchdi-sparse-eager":
        return problem == "brusselator"
    if contender == "jax":
        return problem != "brusselator"
    return True


# --------------------------------------------------------------------------------------------
# One measurement (the child process)


# dynamo's timers reported by --phases (torch._dynamo.utils.compilation_time_metrics), by column.
PHASES = {
    "tracing": "bytecode_tracing",
    "compiler": "OutputGraph.call_user_compiler",
    "inductor load": "PyCodeCache.load_by_key_path",
    "C++ build": "compile_file",
    "torch hash": "inductor_codecache_torch_key",
    "guards": "build_guards",
}


def child(contender: str, problem: str, cache_dir: str, phases: bool = False) -> dict[str, float | bool | None]:
    if contender == "jax":
        return child_jax(problem)
    import torch

    imports: dict[str, float] = {}
    if phases:  # imported before preparing, and timed (otherwise preparation imports them)
        started = time.perf_counter()
        import torch._dynamo

        imports["import dynamo"] = time.perf_counter() - started
        started = time.perf_counter()
        import torch._inductor.compile_fx

        imports["import inductor"] = time.perf_counter() - started

    import torchdi
    from torchdi.testing.sparse_scenarios import brusselator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if problem == "mlp":
        w1, w2 = torch.randn(64, 32), torch.randn(1, 64)

        def f(x: torch.Tensor) -> torch.Tensor:
            return (w2 @ torch.tanh(w1 @ x)).sum()

        x = torch.randn(32)
    elif problem == "rosenbrock":

        def f(x: torch.Tensor) -> torch.Tensor:
            return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()

        x = torch.rand(100_000)
    else:
        f = brusselator
        x = 1 + 0.1 * torch.rand(32, 32, 2)
    begin = time.perf_counter()
    loaded = None
    if contender == "raw":
        program = torch.compile(torch.func.jacfwd(f) if problem == "brusselator" else torch.func.grad_and_value(f))
        result = program(x)

        def call() -> object:
            return program(x)
    else:
        if contender == "torchdi-aoti":
            compiled = torchdi.AutoCompile(compiler="aot_inductor", cache_dir=cache_dir)
        else:
            compiled = torchdi.AutoCompile(cache_dir=cache_dir if contender == "torchdi-persist" else "")
        if problem == "brusselator":
            backend = torchdi.AutoSparse(torchdi.AutoFunc() if contender == "torchdi-sparse-eager" else compiled)
            prep = torchdi.prepare_jacobian(f, backend, x)
            result = torchdi.jacobian(f, backend, x, prep=prep)

            def call() -> object:
                return torchdi.jacobian(f, backend, x, prep=prep)
        else:
            prep = torchdi.prepare_gradient(f, compiled, x)
            result = torchdi.gradient(f, compiled, x, prep=prep)

            def call() -> object:
                return torchdi.gradient(f, compiled, x, prep=prep)
        loaded = bool(prep.loaded_from_cache)
    del result
    end = time.perf_counter()
    out: dict[str, float | bool | None] = {
        "total": end - START, "first": end - begin, "loaded": loaded, "dynamo": "torch._dynamo" in sys.modules, **imports
    }
    # The steady state after that first result: the median of 7 repeats of 50 calls (a sealed
    # preparation checks its guards in Python, dynamo's own in C++).
    repeats = sorted(timeit.repeat(call, number=50, repeat=7))
    out["per_call_us"] = repeats[len(repeats) // 2] / 50 * 1e6
    if phases:
        try:
            from torch._dynamo.utils import compilation_time_metrics
        except ImportError:  # a torch that moved its timers: no phase columns
            compilation_time_metrics = {}
        for column, key in PHASES.items():
            out[column] = sum(compilation_time_metrics.get(key, ()))
    return out


def child_jax(problem: str) -> dict[str, float | bool | None]:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    if problem == "mlp":
        w1, w2 = jax.random.normal(key, (64, 32)), jax.random.normal(key, (1, 64))

        def f(x):  # type: ignore[no-untyped-def]
            return (w2 @ jnp.tanh(w1 @ x)).sum()

        x = jax.random.normal(key, (32,))
    else:

        def f(x):  # type: ignore[no-untyped-def]
            return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()

        x = jax.random.uniform(key, (100_000,))
    begin = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.value_and_grad(f))(x))
    end = time.perf_counter()
    return {"total": end - START, "first": end - begin, "loaded": None}


# --------------------------------------------------------------------------------------------
# The driver


def measure(contender: str, problem: str, directory: Path, phases: bool = False) -> dict[str, float | bool | None]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor"),
        # torchdi's cache: the persisting contenders' own directory; off for the others.
        "TORCHDI_CACHE_DIR": str(directory / "torchdi") if contender in ("torchdi-aoti", "torchdi-persist", "torchdi-sparse-eager") else "",
        "JAX_COMPILATION_CACHE_DIR": str(directory / "jax"),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", contender, problem, str(directory / "torchdi"), *(["--phases"] if phases else [])],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{contender} / {problem} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[str, str, dict, dict]]) -> str:
    lines = [
        "| problem | contender | cold: prepare + first call | cold: from process start | warm: prepare + first call | warm: from process start | warm loaded from torchdi's cache | warm imported dynamo | warm: per call |",
        "|---|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for problem, contender, cold, warm in rows:
        per_call = warm.get("per_call_us")
        lines.append(
            f"| {problem} | {contender} | {cold['first']:.1f} s | {cold['total']:.1f} s | {warm['first']:.2f} s | {warm['total']:.1f} s "
            f"| {'-' if warm['loaded'] is None else warm['loaded']} | {'-' if warm.get('dynamo') is None else warm['dynamo']} "
            f"| {'-' if per_call is None else f'{per_call:.0f} us'} |"
        )
    return "\n".join(lines)


def phase_table(rows: list[tuple[str, str, dict, dict]]) -> str:
    columns = ["import dynamo", "import inductor", "first", *PHASES]
    lines = [
        "| problem | contender | run | " + " | ".join("prepare + first call" if c == "first" else c for c in columns) + " |",
        "|---|---|---|" + "---:|" * len(columns),
    ]
    for problem, contender, cold, warm in rows:
        for run, measured in (("cold", cold), ("warm", warm)):
            if "import dynamo" not in measured:
                continue  # JAX
            cells = " | ".join(f"{measured.get(c, 0.0):.2f}" for c in columns)
            lines.append(f"| {problem} | {contender} | {run} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--markdown", metavar="FILE")
    parser.add_argument("--phases", action="store_true", help="also time the imports and dynamo's phases (seconds)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, phases=args.phases)))
        return 0
    contenders = [c for c in args.contenders.split(",") if c]
    if "jax" in contenders and importlib.util.find_spec("jax") is None:
        print("note: JAX is not installed here: its rows are skipped", file=sys.stderr)
        contenders.remove("jax")
    rows = []
    for problem in [p for p in args.problems.split(",") if p]:
        for contender in contenders:
            if not applies(contender, problem):
                continue
            with tempfile.TemporaryDirectory(prefix=f"cold-{contender}-") as tmp:
                cold = measure(contender, problem, Path(tmp), args.phases)
                warm = measure(contender, problem, Path(tmp), args.phases)
            print(f"{problem:12s} {contender:22s} cold {cold['first']:6.1f} s ({cold['total']:6.1f} s)  "
                  f"warm {warm['first']:6.2f} s ({warm['total']:6.1f} s)  loaded {warm['loaded']}", file=sys.stderr, flush=True)
            rows.append((problem, contender, cold, warm))
    text = table(rows)
    if args.phases:
        text += "\n\nSeconds by phase (dynamo's timers; imports of dynamo and inductor made before preparing):\n\n" + phase_table(rows)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(
            "`python benchmarks/cold_start.py` (fresh processes, one thread, fresh caches per contender; "
            "first: prepare + first call, process: from process start)\n\n" + text + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
