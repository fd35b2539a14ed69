"""AutoXLA's per-call cost against raw torch-xla, on torch-xla's device (PJRT CPU client here).

    PJRT_DEVICE=CPU .venv-xla/bin/python benchmarks/xla_overhead.py [--rounds 7]
    PJRT_DEVICE=CPU .venv-xla/bin/python -m torchdi bench --suite xla-overhead

For each workload, a prepared ``torchdi.gradient`` on ``AutoXLA()`` with host inputs (copied in,
result copied out) and with inputs already on the device, against the raw calls it stands for:
``torch.compile(grad(f), backend="openxla")`` on device tensors and with host tensors moved in and
the result brought back (``.to(device)``, ``.cpu()``), lazy ``torch.func.grad(f)``
followed by a sync, and the raw host<->device transfers (``x.to(device)`` + ``.cpu()``) that any
host in/out call pays (every tensor argument in, the gradient out). ``jax.jit(grad(f))`` is added when JAX is importable. Times are medians
of interleaved rounds (each round times every column once); device calls are timed as a loop of
calls followed by one wait for the device, divided by the number of calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import torchdi as td


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w1 + b1) @ w2 + b2).sum()


def rosenbrock(x: torch.Tensor) -> torch.Tensor:
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def workloads() -> dict[str, tuple[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(32, 64, generator=g) / 8, torch.randn(64, generator=g), torch.randn(64, 1, generator=g) / 8, torch.randn(1, generator=g))
    return {
        "MLP 32-64-1 w.r.t. input": (mlp, torch.randn(32, generator=g), weights),
        "Rosenbrock 1e6 f32": (rosenbrock, torch.rand(1_000_000, generator=g), ()),
    }


def _per_call(fn: Callable[[], Any], wait: Callable[[], None], min_time: float) -> Callable[[], float]:
    for _ in range(3):
        fn()
    wait()
    start = time.perf_counter()
    fn()
    wait()
    number = max(1, int(min_time / max(time.perf_counter() - start, 1e-7)))

    def measure() -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        wait()
        return (time.perf_counter() - start) / number

    return measure


def _format(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _jax_columns(name: str, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], Any]]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    if name.startswith("MLP"):
        w1, b1, w2, b2 = (jnp.asarray(w.numpy()) for w in weights)

        def f(v: Any) -> Any:
            return (jnp.tanh(v @ w1 + b1) @ w2 + b2).sum()
    else:

        def f(v: Any) -> Any:
            return (100.0 * (v[1:] - v[:-1] ** 2) ** 2 + (1.0 - v[:-1]) ** 2).sum()

    g = jax.jit(jax.grad(f))
    host = x.numpy()
    on_device = jnp.asarray(host)
    return {
        "jax.jit(grad) on device": lambda: g(on_device).block_until_ready(),
        "jax.jit(grad) host in/out": lambda: jax.device_get(g(jax.device_put(host))),
    }


def _columns(
    name: str, f: Callable[..., torch.Tensor], x: torch.Tensor, weights: tuple[torch.Tensor, ...], device: Any
) -> tuple[dict[str, Callable[[], Any]], tuple[Any, Any]]:
    """The timed calls of one workload (checked against eager ``torch.func.grad`` first), and its two preps."""
    import torch_xla
    import torch_xla.utils.dlpack as xla_dlpack

    backend = td.AutoXLA()
    contexts = tuple(td.Constant(w) for w in weights)
    x_dev = x.to(device)
    contexts_dev = tuple(td.Constant(w.to(device)) for w in weights)
    weights_dev = tuple(w.to(device) for w in weights)
    prep_host = td.prepare_gradient(f, backend, x, *contexts)
    prep_dev = td.prepare_gradient(f, backend, x_dev, *contexts_dev)
    raw_grad = torch.func.grad(f)
    compiled = torch.compile(raw_grad, backend="openxla", fullgraph=True, dynamic=False)
    with torch.no_grad():
        want = raw_grad(x, *weights)
        torch.testing.assert_close(td.gradient(f, backend, x, *contexts, prep=prep_host), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(compiled(x_dev, *weights_dev).cpu(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(td.gradient(f, backend, x_dev, *contexts_dev, prep=prep_dev).cpu(), want, atol=1e-4, rtol=1e-4)

    def lazy() -> None:
        result = raw_grad(x_dev, *weights_dev)
        torch_xla._XLAC._xla_sync_multi([result], devices=[], wait=False)

    # What any host in/out call moves: every tensor argument in, the gradient out.
    host_tensors = (x, *weights)

    def transfers() -> None:
        for t in host_tensors:
            t.to(device)
        x_dev.cpu()

    def dlpack_transfers() -> None:
        for t in host_tensors:
            xla_dlpack.from_dlpack(t)  # host -> device, zero-copy on the CPU client
        torch.utils.dlpack.from_dlpack(xla_dlpack.to_dlpack(x_dev))  # device -> host, zero-copy on the CPU client

    columns: dict[str, Callable[[], Any]] = {
        "torchdi AutoXLA, host in/out": lambda: td.gradient(f, backend, x, *contexts, prep=prep_host),
        "torchdi AutoXLA, on device": lambda: td.gradient(f, backend, x_dev, *contexts_dev, prep=prep_dev),
        "raw torch.compile(grad(f), openxla), on device": lambda: compiled(x_dev, *weights_dev),
        # What a user writes without torchdi for host tensors: move in, run, bring the result back.
        "raw openxla, host in/out": lambda: compiled(*(t.to(device) for t in host_tensors)).cpu(),
        "raw lazy grad(f) + sync": lazy,
        "raw transfers: .to(device) in, .cpu() out": transfers,
    }
    try:
        with torch.no_grad():
            dlpack_transfers()
        columns["raw DLPack in + out"] = dlpack_transfers
    except Exception as error:  # not every PJRT client shares host memory
        print(f"{name}: DLPack transfers unavailable ({type(error).__name__}: {str(error).splitlines()[0]})")
    return columns, (prep_host, prep_dev)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    args = parser.parse_args(argv)
    if not td.check_available(td.AutoXLA()):
        print("xla-overhead: AutoXLA is not available here (run in .venv-xla with PJRT_DEVICE=CPU)")
        return 1
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()

    def wait() -> None:
        xm.wait_device_ops()  # everything queued on the device

    rows = []
    for name, (f, x, weights) in workloads().items():
        columns, preps = _columns(name, f, x, weights, device)
        columns.update(_jax_columns(name, x, weights))
        with torch.no_grad():
            timers = {column: _per_call(fn, wait, args.min_time) for column, fn in columns.items()}
            samples: dict[str, list[float]] = {column: [] for column in columns}
            for _ in range(args.rounds):
                for column, measure in timers.items():
                    samples[column].append(measure())
        medians = {column: statistics.median(values) for column, values in samples.items()}
        rows.append((name, medians, preps[0].num_compilations, preps[1].num_compilations, preps[0].runner.path))

    header = list(rows[0][1])
    print(f"AutoXLA per-call cost, prepared gradient, torch-xla {torch_xla.__version__} on {device} "
          f"(median of {args.rounds} interleaved rounds)\n")
    print("| workload | " + " | ".join(header) + " | on device / raw openxla | host in/out / raw openxla host in/out |")
    print("|---|" + "---:|" * (len(header) + 2))
    for name, medians, _, _, _ in rows:
        ratio = medians["torchdi AutoXLA, on device"] / medians["raw torch.compile(grad(f), openxla), on device"]
        host_ratio = medians["torchdi AutoXLA, host in/out"] / medians["raw openxla, host in/out"]
        cells = " | ".join(_format(medians.get(column)) for column in header)
        print(f"| {name} | {cells} | {ratio:.2f}x | {host_ratio:.2f}x |")
    print()
    for name, _, host_compiles, dev_compiles, path in rows:
        print(f"{name}: path {path!r}, num_compilations {host_compiles} (host prep), {dev_compiles} (device prep)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
