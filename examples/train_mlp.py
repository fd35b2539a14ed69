"""Train a small classifier with torchdi gradients, the same way on every backend.

The data is synthetic (made here from a fixed seed): points in 20 dimensions labelled by a
random "teacher" network. Each backend trains the same model from the same seed with
``torch.optim.SGD``; torchdi writes the gradients straight into the parameters' ``.grad``
tensors (``out=``), where ``optimizer.step()`` reads them.

Run::

    python examples/train_mlp.py                       # every available backend
    python examples/train_mlp.py --steps 300 --backend compile

It prints, per backend, the final loss, the largest parameter difference from the eager
``torch.autograd`` run, and steps per second (preparation excluded).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import torchdi as td

BACKENDS: dict[str, td.backends.Backend] = {
    "autograd": td.AutoAutograd(),
    "func": td.AutoFunc(),
    "compile": td.AutoCompile(),
    "xla": td.AutoXLA(),
}


def make_data(seed: int, samples: int = 1024, features: int = 20, classes: int = 3) -> TensorDataset:
    """Points labelled by a random teacher network: learnable, but not linearly separable."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=g)
    teacher = torch.randn(features, 32, generator=g)
    readout = torch.randn(32, classes, generator=g)
    labels = (torch.tanh(inputs @ teacher) @ readout).argmax(dim=1)
    return TensorDataset(inputs, labels)


def make_model(seed: int, features: int = 20, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, classes))


def loss_fn(params: dict[str, torch.Tensor], model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model`` run with ``params`` (differentiated) on ``batch`` (constant)."""
    inputs, labels = batch
    return nn.functional.cross_entropy(functional_call(model, params, (inputs,)), labels)


def batches(dataset: TensorDataset, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled batches forever; drop_last keeps every batch the prepared shape."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    for epoch in itertools.count():
        del epoch
        yield from loader


def train(backend: td.backends.Backend, steps: int, seed: int = 0, batch_size: int = 64, lr: float = 0.1) -> tuple[nn.Module, float, float]:
    """Train for ``steps`` steps; returns the model, the last loss and steps per second."""
    dataset = make_data(seed)
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = torch.zeros_like(p)  # torchdi writes into these: no new tensors per step
    grads = {name: p.grad for name, p in params.items()}

    stream = batches(dataset, batch_size, seed)
    first = next(stream)
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(first))
    loss = torch.tensor(float("nan"))
    start = time.perf_counter()
    for batch in itertools.chain([first], itertools.islice(stream, steps - 1)):
        loss, _ = td.value_and_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=grads)
        optimizer.step()
    elapsed = time.perf_counter() - start
    return model, float(loss), steps / elapsed


def max_parameter_difference(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", action="append", choices=sorted(BACKENDS), help="repeatable; default: all available")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Availability first: torch-xla's device must exist before the process's first backward pass.
    available = {name: td.check_available(b) for name, b in BACKENDS.items()}
    names = args.backend or [name for name, ok in available.items() if ok]
    reference, _, _ = train(td.AutoAutograd(), args.steps, args.seed)
    print(f"{'backend':<10} {'final loss':>10} {'max |param - eager|':>20} {'steps/s':>9}")
    for name in names:
        if not available[name]:
            print(f"{name:<10} unavailable here", file=sys.stderr)
            continue
        model, loss, rate = train(BACKENDS[name], args.steps, args.seed)
        print(f"{name:<10} {loss:>10.4f} {max_parameter_difference(model, reference):>20.2e} {rate:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
