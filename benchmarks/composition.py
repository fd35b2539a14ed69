"""Operators under outer transforms (DESIGN rule 10) vs the hand-written torch code they replace.

    .venv/bin/python benchmarks/composition.py [--rounds 11] [--markdown FILE] [--no-compile]

Workloads (one torch thread; medians of interleaved rounds, ratios within the same run):

- ``per-sample gradients``: a small CNN, batch 64: ``vmap`` over a prepared
  ``td.gradient(AutoFunc())`` vs ``vmap(grad(loss))`` over ``functional_call``.
- ``PINN step``: the parameter gradient of the mean squared Laplacian of an MLP ``u(x)`` at 1024
  points (the Laplacian from ``td.hvp`` along the coordinate directions): ``td.gradient`` of it
  with ``AutoFunc`` outside and inside vs the hand-written ``torch.func`` step, and with
  ``AutoCompile()`` as the outer backend (the inner eager operator traced into one program).
- ``gradient penalty``: ``((||grad_x D(x)|| - 1)^2).mean().backward()`` with the input gradient
  from ``td.gradient`` vs ``torch.autograd.grad(create_graph=True)``.
- ``MAML step``: one inner SGD step from ``td.gradient`` and the meta-gradient through it vs
  ``torch.autograd.grad(create_graph=True)``.

The gradient-penalty and MAML workloads on ``AutoFunc`` also time raw ``torch.func.grad`` in the
same step, for scale: under ``torch.autograd`` alone ``AutoFunc``'s gradient is computed by
``torch.autograd.grad(create_graph=True)`` (see ``torchdi.operators._transparent``), which the
outer backward differentiates faster than ``torch.func``'s wrapped graph.

Every torchdi result is checked against its reference before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call, grad, jvp, vmap

import torchdi as td


def _per_call(fn: Callable[[], Any], min_time: float = 0.05) -> Callable[[], float]:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    number = max(1, int(min_time / max(time.perf_counter() - start, 1e-7)))

    def measure() -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number

    return measure


def _check(got: Any, want: Any, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def per_sample() -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 13 * 13, 10)
    )
    params = {k: v.detach() for k, v in model.named_parameters()}
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def loss(p: dict[str, torch.Tensor], image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(functional_call(model, p, (image.unsqueeze(0),)), label.unsqueeze(0))

    raw = vmap(grad(loss), in_dims=(None, 0, 0))
    backend = td.AutoFunc()
    prep = td.prepare_gradient(loss, backend, params, td.Constant(images[0]), td.Constant(labels[0]))
    batched = vmap(lambda image, label: td.gradient(loss, backend, params, td.Constant(image), td.Constant(label), prep=prep))
    _check(batched(images, labels), raw(params, images, labels), "per-sample gradients")
    return {
        "torch.func vmap(grad)": lambda: raw(params, images, labels),
        "vmap(td.gradient, AutoFunc)": lambda: batched(images, labels),
    }


def pinn(compile_: bool) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    points = torch.rand(1024, 2)
    directions = tuple(torch.eye(2)[i].expand_as(points) for i in range(2))
    stacked = torch.stack(directions)

    def u(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x,)).sum()  # points are independent: the HVP is per point

    def loss(p: dict[str, torch.Tensor], inner: td.AutoFunc = td.AutoFunc()) -> torch.Tensor:  # noqa: B008
        hv = td.hvp(u, inner, points, directions, td.Constant(p))
        return ((hv[0][:, 0] + hv[1][:, 1] + 1.0) ** 2).mean()

    def loss_raw(p: dict[str, torch.Tensor]) -> torch.Tensor:
        hv = vmap(lambda t: jvp(lambda x: grad(u)(x, p), (points,), (t,))[1])(stacked)
        return ((hv[0][:, 0] + hv[1][:, 1] + 1.0) ** 2).mean()

    raw = grad(loss_raw)
    outer = td.AutoFunc()
    prep = td.prepare_gradient(loss, outer, params)
    want = raw(params)
    impls = {
        "hand-written torch.func": lambda: raw(params),
        "td AutoFunc over AutoFunc": lambda: td.gradient(loss, outer, params, prep=prep),
    }
    _check(impls["td AutoFunc over AutoFunc"](), want, "PINN AutoFunc")
    if compile_:
        compiled = td.AutoCompile()
        prep_c = td.prepare_gradient(loss, compiled, params)
        impls["td AutoCompile over AutoFunc"] = lambda: td.gradient(loss, compiled, params, prep=prep_c)
        _check(impls["td AutoCompile over AutoFunc"](), want, "PINN AutoCompile", rtol=1e-3, atol=1e-4)
    return impls


def penalty(backend: Any) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    samples = torch.randn(64, 16)

    def critic_sum(x: torch.Tensor) -> torch.Tensor:
        return critic(x).sum()

    prep = td.prepare_gradient(critic_sum, backend, samples)

    def step(use_torchdi: bool) -> list[torch.Tensor]:
        critic.zero_grad()
        x = samples.clone().requires_grad_()
        if use_torchdi:
            g = td.gradient(critic_sum, backend, x, prep=prep)
        else:
            (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        ((g.norm(dim=1) - 1) ** 2).mean().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in critic.parameters()]

    def step_func() -> list[torch.Tensor]:  # raw torch.func.grad under the outer torch.autograd
        critic.zero_grad()
        g = grad(critic_sum)(samples.clone().requires_grad_())
        ((g.norm(dim=1) - 1) ** 2).mean().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in critic.parameters()]

    _check(step(True), step(False), "gradient penalty")
    impls = {"torch.autograd.grad(create_graph=True)": lambda: step(False), f"td.gradient {type(backend).__name__}": lambda: step(True)}
    if isinstance(backend, td.AutoFunc):
        impls["raw torch.func.grad (for scale)"] = step_func
    return impls


def maml(backend: Any) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    support, query = (torch.randn(32, 8), torch.randn(32, 1)), (torch.randn(32, 8), torch.randn(32, 1))

    def task_loss(p: dict[str, torch.Tensor], data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = data
        return ((functional_call(model, p, (inputs,)) - targets) ** 2).mean()

    prep = td.prepare_gradient(task_loss, backend, params, td.Constant(support))

    def step(use_torchdi: bool) -> tuple[torch.Tensor, ...]:
        if use_torchdi:
            g = td.gradient(task_loss, backend, params, td.Constant(support), prep=prep)
        else:
            g = dict(zip(params, torch.autograd.grad(task_loss(params, support), list(params.values()), create_graph=True)))
        adapted = {k: params[k] - 0.1 * g[k] for k in params}
        return torch.autograd.grad(task_loss(adapted, query), list(params.values()))

    def step_func() -> tuple[torch.Tensor, ...]:  # raw torch.func.grad under the outer torch.autograd
        g = grad(task_loss)(params, support)
        adapted = {k: params[k] - 0.1 * g[k] for k in params}
        return torch.autograd.grad(task_loss(adapted, query), list(params.values()))

    _check(step(True), step(False), "MAML")
    impls = {"torch.autograd.grad(create_graph=True)": lambda: step(False), f"td.gradient {type(backend).__name__}": lambda: step(True)}
    if isinstance(backend, td.AutoFunc):
        impls["raw torch.func.grad (for scale)"] = step_func
    return impls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", "--repeats", type=int, default=11, help="interleaved rounds (--repeats: the name update_readme.py passes)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    parser.add_argument("--no-compile", action="store_true", help="skip the AutoCompile PINN step (its compilation takes minutes)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", metavar="TEXT", help="run only the workloads whose name contains TEXT")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = {
        "per-sample gradients (CNN, batch 64)": per_sample,
        "PINN step (Laplacian at 1024 points)": lambda: pinn(not args.no_compile),
        "gradient penalty (AutoAutograd)": lambda: penalty(td.AutoAutograd()),
        "gradient penalty (AutoFunc)": lambda: penalty(td.AutoFunc()),
        "MAML step (AutoAutograd)": lambda: maml(td.AutoAutograd()),
        "MAML step (AutoFunc)": lambda: maml(td.AutoFunc()),
    }
    if args.only:
        workloads = {name: make for name, make in workloads.items() if args.only in name}
    rows = []
    print(f"{'workload':<40} {'implementation':<40} {'median':>12} {'ratio':>7}")
    for workload, make in workloads.items():
        impls = make()
        measures = {name: _per_call(fn) for name, fn in impls.items()}
        samples: dict[str, list[float]] = {name: [] for name in impls}
        names = list(measures)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                samples[name].append(measures[name]())
        reference = statistics.median(samples[names[0]])
        for name in names:
            median = statistics.median(samples[name])
            rows.append((workload, name, median * 1e3, median / reference))
            print(f"{workload:<40} {name:<40} {median * 1e3:>9.2f} ms {median / reference:>6.2f}x", flush=True)
    if args.markdown:
        lines = [
            "### `benchmarks/composition.py`",
            "",
            f"torch {torch.__version__}, torch threads: {torch.get_num_threads()}; medians of {args.rounds} interleaved "
            "rounds; ratio to the first row of each workload (the hand-written torch code), same run.",
            "",
            "| workload | implementation | median per step | ratio |",
            "|---|---|---:|---:|",
            *[f"| {w} | {n} | {ms:.2f} ms | {ratio:.2f}x |" for w, n, ms, ratio in rows],
        ]
        with open(args.markdown, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
