"""Mix backends in one model with ``torchdi.DifferentiateWith``.

1. A black box inside a model: an activation computed by scipy (``scipy.special.log_expit``; a
   numpy loop when scipy is missing), which no AD system can see through, differentiated by
   finite differences while ``loss.backward()`` trains the rest of the model with eager autograd.
   The same model with torch's own ``logsigmoid`` is trained alongside for comparison.
2. A hot piece compiled with ``AutoCompile`` inside an eager model: the gradients match eager
   ones, and the piece is compiled once for the whole loop.
3. ``torch.func`` through the black box: per-sample gradients with ``vmap(grad(...))``.

Run::

    python examples/differentiate_with.py [--steps 50]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import torchdi as td

try:
    import scipy.special

    def log_expit(z: torch.Tensor) -> torch.Tensor:
        """scipy's log(sigmoid(z)): a numpy routine, opaque to torch."""
        return torch.from_numpy(scipy.special.log_expit(z.detach().cpu().numpy())).to(z)

except ImportError:  # the numpy loop stands in for scipy

    def log_expit(z: torch.Tensor) -> torch.Tensor:
        values = z.detach().cpu().numpy()
        out = np.empty_like(values)
        for i, v in np.ndenumerate(values):
            out[i] = -np.logaddexp(0.0, -v)
        return torch.from_numpy(out).to(z)


class Net(nn.Module):
    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 16, dtype=torch.float64)
        self.readout = nn.Linear(16, 1, dtype=torch.float64)
        self.activation = activation

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.readout(self.activation(self.hidden(z)))


def train(model: nn.Module, steps: int) -> float:
    torch.manual_seed(1)
    inputs = torch.randn(64, 8, dtype=torch.float64)
    targets = torch.sin(inputs.sum(1, keepdim=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
    return loss.item()


def black_box(steps: int) -> None:
    activation = td.DifferentiateWith(log_expit, td.AutoFiniteDiff())
    torch.manual_seed(0)
    model = Net(activation)
    torch.manual_seed(0)
    reference = Net(nn.LogSigmoid())
    loss, reference_loss = train(model, steps), train(reference, steps)
    gap = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    print(f"black box (finite differences): loss {loss:.6f}, torch logsigmoid: {reference_loss:.6f}, "
          f"largest parameter difference {gap:.1e}, preparations {activation.num_preparations}")


def compiled_piece(steps: int) -> None:
    def piece(h: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(h) * scale + h.pow(2).mean(-1, keepdim=True)

    compiled = td.DifferentiateWith(piece, td.AutoCompile(compiler="aot_eager"))
    torch.manual_seed(0)
    model = Net(lambda h: compiled(h, td.Constant(0.5)))
    torch.manual_seed(0)
    reference = Net(lambda h: piece(h, 0.5))
    loss, reference_loss = train(model, steps), train(reference, steps)
    gap = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    print(f"compiled piece (AutoCompile): loss {loss:.6f}, eager: {reference_loss:.6f}, "
          f"largest parameter difference {gap:.1e}, compilations {compiled.num_compilations}")


def per_sample_gradients() -> None:
    activation = td.DifferentiateWith(log_expit, td.AutoFiniteDiff())
    batch = torch.randn(5, 3, dtype=torch.float64)
    grads = torch.func.vmap(torch.func.grad(lambda z: activation(z).sum()))(batch)
    expected = torch.sigmoid(-batch)  # d/dz log(sigmoid(z))
    print(f"per-sample gradients through the black box: largest error {float((grads - expected).abs().max()):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    black_box(args.steps)
    compiled_piece(args.steps)
    per_sample_gradients()


if __name__ == "__main__":
    main()
