"""Sparse scenarios: jacobians and hessians with known structure, for ``AutoSparse``.

Each scenario is a ``Scenario`` (``op`` ``"jacobian"`` or ``"hessian"``, tagged ``"sparse"``)
whose reference is the *dense* matrix from ``AutoAutograd``; ``true_pattern`` gives the exact
structural pattern of the ones whose structure is known in closed form.

- ``brusselator``: the 2-D Brusselator right-hand side on an ``N x N`` periodic grid, two
  species, ``x`` of shape ``(N, N, 2)`` (2N^2 x 2N^2 jacobian, 6 non-zeros per row).
- ``banded_linear``: ``A @ x`` with a fixed banded ``A`` (closed over, so its zeros are structural).
- ``diff_square`` / ``diff_cube``: ``diff(x)**2`` and ``diff(x)**3``.
- ``chained_rosenbrock`` / ``broyden_tridiagonal``: scalar functions with tridiagonal and
  pentadiagonal hessians.
- ``sparse_conv``: ``tanh`` of a 2-D convolution with a fixed 5-point stencil kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from torchdi.testing.scenarios import Scenario

__all__ = [
    "banded_linear",
    "brusselator",
    "broyden_tridiagonal",
    "chained_rosenbrock",
    "diff_cube",
    "diff_square",
    "sparse_conv",
    "sparse_scenarios",
    "true_pattern",
]


def brusselator(u: torch.Tensor) -> torch.Tensor:
    """The 2-D Brusselator reaction-diffusion right-hand side (DifferentiationInterface.jl's and
    asdex's benchmark): ``u`` of shape ``(N, N, 2)`` on ``[0, 1]^2`` with periodic boundaries."""
    n = u.shape[0]
    a, b, alpha = 3.4, 1.0, 10.0
    alpha = alpha * (n - 1) ** 2  # alpha / dx^2 with dx = 1 / (N - 1)
    grid = torch.linspace(0, 1, n, dtype=u.dtype, device=u.device)
    gx, gy = torch.meshgrid(grid, grid, indexing="ij")
    forcing = ((gx - 0.3) ** 2 + (gy - 0.6) ** 2 <= 0.1**2).to(u.dtype) * 5.0
    lap = u.roll(1, 0) + u.roll(-1, 0) + u.roll(1, 1) + u.roll(-1, 1) - 4 * u
    u1, u2 = u[..., 0], u[..., 1]
    du1 = alpha * lap[..., 0] + b + u1**2 * u2 - (a + 1) * u1 + forcing
    du2 = alpha * lap[..., 1] + a * u1 - u1**2 * u2
    return torch.stack([du1, du2], dim=-1)


def _banded_matrix(n: int, bandwidth: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    dense = torch.randn(n, n, generator=g, dtype=dtype)
    i = torch.arange(n)
    return dense * ((i[:, None] - i[None, :]).abs() <= bandwidth)


def banded_linear(n: int = 200, bandwidth: int = 2, dtype: torch.dtype = torch.float64) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> A @ x`` for a fixed random banded ``A`` (``|i - j| <= bandwidth``), closed over."""
    matrix = _banded_matrix(n, bandwidth, dtype)

    def banded_linear_map(x: torch.Tensor) -> torch.Tensor:
        return matrix @ x

    return banded_linear_map


def diff_square(x: torch.Tensor) -> torch.Tensor:
    return torch.diff(x) ** 2


def diff_cube(x: torch.Tensor) -> torch.Tensor:
    return torch.diff(x) ** 3


def chained_rosenbrock(x: torch.Tensor) -> torch.Tensor:
    """The chained Rosenbrock function: a tridiagonal hessian."""
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def broyden_tridiagonal(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of the Broyden tridiagonal residuals: a pentadiagonal hessian."""
    padded = F.pad(x, (1, 1))
    residual = (3 - 2 * x) * x - padded[:-2] - 2 * padded[2:] + 1
    return (residual**2).sum()


_STENCIL = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])


def sparse_conv(x: torch.Tensor) -> torch.Tensor:
    """``tanh`` of a 5-point stencil convolution (zero padding) of a ``(1, C, H, W)`` image, per channel."""
    channels = x.shape[1]
    kernel = _STENCIL.to(x.dtype).expand(channels, 1, 3, 3)
    return torch.tanh(F.conv2d(x, kernel, padding=1, groups=channels))


def true_pattern(name: str, x_shape: Sequence[int]) -> np.ndarray:
    """The exact structural pattern (boolean ``(m, n)``) of a scenario function at ``x``'s shape."""
    if name == "brusselator":
        n = x_shape[0]
        size = 2 * n * n
        out = np.zeros((size, size), dtype=bool)

        def flat(i: int, j: int, s: int) -> int:
            return ((i % n) * n + (j % n)) * 2 + s

        for i in range(n):
            for j in range(n):
                for s in range(2):
                    row = flat(i, j, s)
                    for di, dj in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
                        out[row, flat(i + di, j + dj, s)] = True
                    out[row, flat(i, j, 1 - s)] = True
        return out
    length = int(np.prod(x_shape))
    idx = np.arange(length)
    if name in ("diff_square", "diff_cube"):
        out = np.zeros((length - 1, length), dtype=bool)
        out[idx[:-1], idx[:-1]] = True
        out[idx[:-1], idx[1:]] = True
        return out
    if name in ("chained_rosenbrock", "broyden_tridiagonal"):
        band = 1 if name == "chained_rosenbrock" else 2
        return np.abs(idx[:, None] - idx[None, :]) <= band
    raise ValueError(f"true_pattern: no closed form for {name!r}")


def sparse_scenarios(*, sizes: Sequence[int] = (8, 16), dtype: torch.dtype = torch.float64) -> list[Scenario]:
    """The sparse scenarios at small sizes (the reference is a dense ``AutoAutograd`` matrix).

    ``sizes`` are the Brusselator grid sizes ``N`` (``2 N^2`` unknowns); the other scenarios use
    fixed moderate sizes.
    """
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    scenarios = [
        Scenario("jacobian", brusselator, 1 + 0.1 * randn(n, n, 2), name=f"brusselator-{n}", tags={"sparse"}) for n in sizes
    ]
    scenarios += [
        Scenario("jacobian", banded_linear(200, 2, dtype), randn(200), name="banded-linear-200", tags={"sparse"}),
        Scenario("jacobian", diff_square, randn(100), name="diff-square-100", tags={"sparse"}),
        Scenario("jacobian", diff_cube, randn(100), name="diff-cube-100", tags={"sparse"}),
        Scenario("jacobian", sparse_conv, randn(1, 2, 12, 12), name="sparse-conv-2x12x12", tags={"sparse"}),
        Scenario("hessian", chained_rosenbrock, 1 + 0.1 * randn(100), name="chained-rosenbrock-100", tags={"sparse"}),
        Scenario("hessian", broyden_tridiagonal, randn(100), name="broyden-tridiagonal-100", tags={"sparse"}),
    ]
    return scenarios
