"""Scenarios: a function, a point, contexts and tangents, an operator, and the expected result.

A ``Scenario`` is what ``test_differentiation`` and ``benchmark_differentiation`` run. When its
``result`` is not given, the reference backend (``AutoAutograd``) computes it on first use.
Every scenario also has a deterministic *second point* (inputs and ``Constant`` values scaled
by a fixed random factor in ``[0.9, 1.1]``; ``Cache`` values unchanged): preparation happens
there and execution at the scenario's own point, so that a ``Prep`` that froze a value is
caught.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import torchdi
from torchdi.contexts import Cache, Constant, Context
from torchdi.families import FAMILIES

__all__ = [
    "OPERATORS",
    "OperatorInfo",
    "Scenario",
    "benchmark_scenarios",
    "call_operator",
    "default_scenarios",
    "prepare_operator_for",
]


# --------------------------------------------------------------------------------------------
# The operator table


@dataclass(frozen=True)
class OperatorInfo:
    """How to prepare and call one operator generically.

    Attributes:
        name: the operator's public name (``"value_and_gradient"``).
        family: the preparation it shares (``"gradient"``).
        tangents: what the tangents are shaped like: ``"x"``, ``"y"`` or ``None`` (no tangents).
        scalar_x: ``x`` must be a scalar (``derivative`` family).
        tensor_x: ``x`` must be a tensor (no pytree).
        scalar_y: ``f`` must return a one-element tensor.
        order: 1 or 2 (second-order operators).
    """

    name: str
    family: str
    tangents: str | None
    scalar_x: bool = False
    tensor_x: bool = False
    scalar_y: bool = False
    order: int = 1

    @property
    def prepare(self) -> Callable[..., Any]:
        return getattr(torchdi, f"prepare_{self.family}")  # type: ignore[no-any-return,unused-ignore]

    @property
    def function(self) -> Callable[..., Any]:
        return getattr(torchdi, self.name)  # type: ignore[no-any-return,unused-ignore]


_OPERATOR_LIST = [
    OperatorInfo(name, row.name, row.tangents_like, row.scalar_x, row.tensor_x, row.scalar_y, row.order)
    for row in FAMILIES.values()
    for name in (row.operator, row.value_operator)
]

#: Every operator by name, in the order of DESIGN.md.
OPERATORS: dict[str, OperatorInfo] = {info.name: info for info in _OPERATOR_LIST}


def _operator(op: str) -> OperatorInfo:
    try:
        return OPERATORS[op]
    except KeyError:
        raise ValueError(f"unknown operator {op!r}; valid operators: {', '.join(OPERATORS)}") from None


def prepare_operator_for(
    op: str, f: Callable[..., Any], backend: Any, x: Any, tangents: Any, contexts: Sequence[Any]
) -> torchdi.Prep:
    """``prepare_<family of op>(f, backend, x, [tangents,] *contexts)``."""
    info = _operator(op)
    head = (x,) if info.tangents is None else (x, tangents)
    return info.prepare(f, backend, *head, *contexts)  # type: ignore[no-any-return,unused-ignore]


def call_operator(
    op: str, f: Callable[..., Any], backend: Any, x: Any, tangents: Any, contexts: Sequence[Any], prep: Any = None
) -> Any:
    """``op(f, backend, x, [tangents,] *contexts, prep=prep)``."""
    info = _operator(op)
    head = (x,) if info.tangents is None else (x, tangents)
    return info.function(f, backend, *head, *contexts, prep=prep)


# --------------------------------------------------------------------------------------------
# Deterministic perturbations and copies


def _seed(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _perturb_leaf(leaf: Any, generator: torch.Generator) -> Any:
    """A nearby value of the same kind: floats scaled by a factor in [0.9, 1.1]; others unchanged."""
    if isinstance(leaf, torch.Tensor):
        if not leaf.is_floating_point():
            return leaf.clone()
        factor = 1 + 0.1 * (2 * torch.rand(leaf.shape, generator=generator, dtype=torch.float64) - 1)
        return (leaf.detach().cpu().double() * factor).to(dtype=leaf.dtype, device=leaf.device)
    if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.floating):
        factors = 1 + 0.1 * (2 * torch.rand(leaf.shape, generator=generator, dtype=torch.float64).numpy() - 1)
        return (leaf * factors).astype(leaf.dtype)
    if isinstance(leaf, float):
        return leaf * (1 + 0.1 * (2 * float(torch.rand((), generator=generator, dtype=torch.float64)) - 1))
    return copy.deepcopy(leaf)


def perturb(tree: Any, seed: int) -> Any:
    """``tree`` with every float leaf moved to a deterministic nearby value."""
    generator = torch.Generator().manual_seed(seed)
    return pytree.tree_map(lambda leaf: _perturb_leaf(leaf, generator), tree)


def clone_tree(tree: Any) -> Any:
    """A deep copy of a pytree whose tensors are cloned (bit-identical, independent storage)."""
    def leaf_copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone()
        if isinstance(leaf, np.ndarray):
            return leaf.copy()
        return copy.deepcopy(leaf)

    return pytree.tree_map(leaf_copy, tree)


def clone_contexts(contexts: Sequence[Context[Any]]) -> tuple[Context[Any], ...]:
    return tuple(type(c)(clone_tree(c.value)) for c in contexts)


# --------------------------------------------------------------------------------------------
# Scenario


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        shape = "x".join(str(s) for s in obj.shape) or "scalar"
        return f"{shape} {str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, float):
        return "float"
    if isinstance(obj, dict):
        return "dict(" + ", ".join(f"{k}: {_describe(v)}" for k, v in obj.items()) + ")"
    if isinstance(obj, (list, tuple)):
        return type(obj).__name__ + "(" + ", ".join(_describe(v) for v in obj) + ")"
    return type(obj).__name__


def _first_dtype(tree: Any) -> torch.dtype:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.get_default_dtype()


@dataclass(eq=False)
class Scenario:
    """One test or benchmark case: ``op`` of ``f`` at ``x`` with ``contexts`` (and ``tangents``).

    Args:
        op: the operator's name, e.g. ``"gradient"``, ``"value_and_jacobian"``, ``"hvp"``.
        f: the function ``f(x, *contexts)``.
        x: the point (tensor, scalar, or pytree of tensors, as the operator accepts).
        contexts: ``torchdi.Constant``/``torchdi.Cache`` arguments, in the order ``f`` takes them.
        tangents: a tuple of tangents (``tx`` or ``ty``) for pushforward, pullback and hvp;
            ``None`` picks one deterministic random tangent.
        result: the expected result of ``op`` at ``x``; ``None`` computes it with the reference
            backend (``AutoAutograd``) on first use.
        name: a readable label (default: the function's name, the operator and the input).
        tags: free-form labels used to select scenarios (e.g. ``"large"``, ``"overhead"``).

    Example::

        >>> s = Scenario("gradient", lambda x: (x**2).sum(), torch.ones(3))
        >>> s.reference()
        tensor([2., 2., 2.])
    """

    op: str
    f: Callable[..., Any]
    x: Any
    contexts: tuple[Context[Any], ...] = ()
    tangents: tuple[Any, ...] | None = None
    result: Any = None
    name: str = ""
    tags: Iterable[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        info = _operator(self.op)
        self.contexts = tuple(self.contexts)
        for i, context in enumerate(self.contexts):
            if not isinstance(context, (Constant, Cache)):
                raise TypeError(
                    f"Scenario: context {i} must be torchdi.Constant(...) or torchdi.Cache(...), "
                    f"got {type(context).__name__}"
                )
        self.tags = frozenset(self.tags)
        if not self.name:
            fname = getattr(self.f, "__name__", type(self.f).__name__)
            ctx = "".join(f", {type(c).__name__}" for c in self.contexts)
            self.name = f"{fname}({_describe(self.x)}{ctx})"
        if info.tangents is None:
            if self.tangents is not None:
                raise ValueError(f"Scenario {self.name!r}: operator {self.op!r} takes no tangents")
        elif self.tangents is None:
            like = self.x if info.tangents == "x" else self._value()
            self.tangents = (perturb(pytree.tree_map(torch.ones_like, like), _seed(self.name + "t")),)
        elif not isinstance(self.tangents, tuple):
            raise TypeError(f"Scenario {self.name!r}: tangents must be a tuple, one entry per tangent")
        self._second: tuple[Any, Any, tuple[Context[Any], ...]] | None = None

    @property
    def info(self) -> OperatorInfo:
        return OPERATORS[self.op]

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of ``x`` (used to choose tolerances)."""
        return _first_dtype(self.x)

    @property
    def label(self) -> str:
        """``"<op>: <name>"``, how reports name the scenario."""
        return f"{self.op}: {self.name}"

    def _value(self) -> Any:
        return _evaluate(self.f, self.x, self.contexts)

    def fresh_inputs(self) -> tuple[Any, Any, tuple[Context[Any], ...]]:
        """Independent copies of ``(x, tangents, contexts)`` (a mutating ``f`` cannot spoil the scenario)."""
        return clone_tree(self.x), clone_tree(self.tangents), clone_contexts(self.contexts)

    def second_point(self) -> tuple[Any, Any, tuple[Context[Any], ...]]:
        """A deterministic nearby ``(x, tangents, contexts)`` with the same signatures.

        Floats in ``x``, the tangents and ``Constant`` values are scaled by fixed random factors
        in ``[0.9, 1.1]``; ``Cache`` values are kept.
        """
        if self._second is None:
            seed = _seed(self.name + self.op)
            x2 = perturb(self.x, seed)
            t2 = None if self.tangents is None else perturb(self.tangents, seed + 1)
            c2: tuple[Context[Any], ...] = tuple(
                Constant(perturb(c.value, seed + 2 + i)) if isinstance(c, Constant) else Cache(clone_tree(c.value))
                for i, c in enumerate(self.contexts)
            )
            self._second = (x2, t2, c2)
        x2, t2, c2 = self._second
        return clone_tree(x2), clone_tree(t2), clone_contexts(c2)

    def reference(self) -> Any:
        """The expected result at ``x``: ``result`` when given, else ``AutoAutograd``'s (cached)."""
        if self.result is None:
            x, tangents, contexts = self.fresh_inputs()
            self.result = call_operator(self.op, self.f, torchdi.AutoAutograd(), x, tangents, contexts)
        return self.result

    def __repr__(self) -> str:
        return f"Scenario({self.label!r})"


# --------------------------------------------------------------------------------------------
# The default scenarios (DifferentiationInterfaceTest's default_scenarios)


def scalar_to_scalar(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * x**2 + torch.exp(0.5 * x)


def scalar_to_vector(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.sin(x), x**3, torch.cos(2 * x) * x])


def vector_to_scalar(x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(x) * torch.exp(0.3 * x)).sum() + (x**3).sum() / 3 + x[0] * x[-1]


def vector_to_vector(x: torch.Tensor) -> torch.Tensor:
    weights = torch.arange(3 * x.shape[0], dtype=x.dtype, device=x.device).reshape(3, -1) / 10 - 0.5
    return torch.tanh(weights @ x) * x[:3] + x[1:4] ** 2


def matrix_to_matrix(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T) + torch.sin(x[:, : x.shape[0]]) * 2


def pytree_to_scalar(p: dict[str, torch.Tensor]) -> torch.Tensor:
    w, b = p["w"], p["b"]
    # Made on the CPU: torch-xla 2.9 computes a float64 linspace in float32 precision (1e-7 off).
    inputs = torch.linspace(-1, 1, 4 * w.shape[0], dtype=w.dtype).reshape(4, w.shape[0]).to(w.device)
    return (torch.tanh(inputs @ w + b) ** 2).sum() + (w**2).sum() * 0.1


def _with_constant(f: Callable[..., Any]) -> Callable[..., Any]:
    def with_constant(x: Any, c: Any) -> Any:
        return f(pytree.tree_map(lambda t: t * c, x))

    with_constant.__name__ = f"{f.__name__}_constant"
    return with_constant


def _with_cache(f: Callable[..., Any]) -> Callable[..., Any]:
    def with_cache(x: Any, cache: Any) -> Any:
        # Overwrite the scratch completely, then read it: the result depends on the scratch
        # holding what was just written, never on its initial value.
        pytree.tree_map(lambda buf, t: buf.copy_(torch.cos(t)), cache, x)
        return f(pytree.tree_map(lambda t, buf: t + 0.1 * buf, x, cache))

    with_cache.__name__ = f"{f.__name__}_cache"
    return with_cache


def _with_constant_and_cache(f: Callable[..., Any]) -> Callable[..., Any]:
    cached = _with_cache(f)

    def with_constant_and_cache(x: Any, c: Any, cache: Any) -> Any:
        return cached(pytree.tree_map(lambda t: t * c, x), cache)

    with_constant_and_cache.__name__ = f"{f.__name__}_constant_cache"
    return with_constant_and_cache


# (function, point builder, operators, constant kind) per input/output kind.
_FIRST_ORDER_TENSOR = ("pushforward", "value_and_pushforward", "pullback", "value_and_pullback", "jacobian", "value_and_jacobian")
_SCALAR_OUT = (
    "gradient", "value_and_gradient", "hvp", "gradient_and_hvp", "hessian", "value_gradient_and_hessian",
    *_FIRST_ORDER_TENSOR,
)
_DERIVATIVES = ("derivative", "value_and_derivative", "second_derivative", "value_derivative_and_second_derivative")


def _kinds(dtype: torch.dtype) -> list[tuple[Callable[..., Any], Any, tuple[str, ...], Callable[[Any], Any]]]:
    def t(values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    vector = t([0.5, -1.2, 0.8, 1.5, -0.3])
    matrix = t([[0.2, -0.4, 0.6, 0.1], [0.9, 0.3, -0.7, 0.5], [-0.1, 0.8, 0.4, -0.6]])
    tree = {"w": t([[0.3, -0.5], [0.7, 0.2], [-0.4, 0.6]]), "b": t([0.1, -0.2])}
    tensor_constant = lambda x: Constant(1.0 + 0.5 * torch.cos(torch.arange(x.numel(), dtype=dtype)).reshape(x.shape))  # noqa: E731
    float_constant = lambda x: Constant(1.3)  # noqa: E731
    return [
        (scalar_to_scalar, t(0.7), _DERIVATIVES, float_constant),
        (scalar_to_vector, t(-0.4), _DERIVATIVES, float_constant),
        (vector_to_scalar, vector, _SCALAR_OUT, tensor_constant),
        (vector_to_vector, vector, _FIRST_ORDER_TENSOR, tensor_constant),
        (matrix_to_matrix, matrix, _FIRST_ORDER_TENSOR, tensor_constant),
        # jacobian/hessian of a pytree (torch.func's nesting) are checked against torch.func in
        # tests/test_pytrees.py; the default scenarios keep tensor inputs for them.
        (pytree_to_scalar, tree, tuple(o for o in _SCALAR_OUT if OPERATORS[o].family not in ("jacobian", "hessian")), float_constant),
    ]


CONTEXT_VARIANTS = ("none", "constant", "cache", "constant+cache")


def default_scenarios(
    *,
    operators: Iterable[str] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    contexts: Sequence[str] = ("none", "constant", "cache"),
    compact: bool = False,
) -> list[Scenario]:
    """Scenarios for every operator: scalar->scalar, scalar->vector, vector->scalar,
    vector->vector, matrix->matrix and pytree (dict of tensors)->scalar, each without contexts,
    with a ``Constant`` (a float or a tensor), with a ``Cache``, in float32 and float64.

    Tangent operators get one tangent in float32 and two (batched) in float64.

    Args:
        operators: keep only these operators (names as in ``torchdi``).
        dtypes: the floating dtypes to cover.
        contexts: which context variants: ``"none"``, ``"constant"``, ``"cache"``,
            ``"constant+cache"``.
        compact: one scenario per (operator, dtype), the context variants and input kinds taken
            in turn, for backends where each preparation is expensive (compiled ones).

    Returns:
        A list of ``Scenario`` whose expected results come from ``AutoAutograd`` on first use.
    """
    wanted = None if operators is None else set(operators)
    for op in wanted or ():
        _operator(op)
    for variant in contexts:
        if variant not in CONTEXT_VARIANTS:
            raise ValueError(f"unknown context variant {variant!r}; valid: {', '.join(CONTEXT_VARIANTS)}")
    scenarios: list[Scenario] = []
    for dtype in dtypes:
        n_tangents = 1 if dtype == torch.float32 else 2
        seen: dict[str, int] = {}
        for f, x, ops, constant in _kinds(dtype):
            for op in ops:
                if wanted is not None and op not in wanted:
                    continue
                variants = list(contexts)
                if compact:
                    count = seen.get(op, 0)
                    seen[op] = count + 1
                    if count:
                        continue
                    variants = [contexts[len(scenarios) % len(contexts)]]
                for variant in variants:
                    scenarios.append(_make(op, f, x, variant, constant, n_tangents))
    return scenarios


def _make(op: str, f: Callable[..., Any], x: Any, variant: str, constant: Callable[[Any], Any], n_tangents: int) -> Scenario:
    cache = lambda: Cache(pytree.tree_map(torch.zeros_like, x))  # noqa: E731
    contexts: tuple[Context[Any], ...]
    if variant == "none":
        g, contexts = f, ()
    elif variant == "constant":
        g, contexts = _with_constant(f), (constant(x),)
    elif variant == "cache":
        g, contexts = _with_cache(f), (cache(),)
    else:
        g, contexts = _with_constant_and_cache(f), (constant(x), cache())
    info = OPERATORS[op]
    tangents = None
    if info.tangents is not None:
        like = x if info.tangents == "x" else _evaluate(g, x, contexts)
        tangents = tuple(
            perturb(pytree.tree_map(torch.ones_like, like), 1000 + i) for i in range(n_tangents)
        )
    return Scenario(op, g, x, contexts, tangents=tangents)


# --------------------------------------------------------------------------------------------
# Benchmark scenarios


def mlp_small_loss(params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A tiny MLP (8 -> 16 -> 1, batch 4) as a function of its 161 parameters: overhead-bound."""
    w1 = params[:128].reshape(8, 16)
    b1 = params[128:144]
    w2 = params[144:160].reshape(16, 1)
    b2 = params[160:161]
    hidden = torch.tanh(inputs @ w1 + b1)
    return ((hidden @ w2 + b2 - targets) ** 2).mean()


def rosenbrock(x: torch.Tensor) -> torch.Tensor:
    """The extended Rosenbrock function: bandwidth-bound for large ``x``."""
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def mlp_dict_loss(params: dict[str, torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a 64 -> 128 -> 128 -> 10 MLP as a function of a dict of parameters."""
    h = torch.relu(inputs @ params["w1"] + params["b1"])
    h = torch.relu(h @ params["w2"] + params["b2"])
    return F.cross_entropy(h @ params["w3"] + params["b3"], labels)


def square_map(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """R^n -> R^n, ``tanh(W x) + x^2 / 2``: a dense jacobian."""
    return torch.tanh(weights @ x) + 0.5 * x**2


def coupled_quartic(x: torch.Tensor) -> torch.Tensor:
    """A scalar function with a banded, non-constant Hessian."""
    return (x**4).sum() / 12 + (x[1:] * x[:-1]).sum() + torch.logsumexp(x, dim=0)


def benchmark_scenarios(*, quick: bool = False) -> list[Scenario]:
    """The benchmark suite (float32): where each backend shines or pays its overhead.

    - ``mlp-small``: value_and_gradient of a 161-parameter MLP: per-call overhead dominates.
    - ``rosenbrock-1e6``: value_and_gradient of Rosenbrock in 10^6 dims: memory bandwidth.
    - ``mlp-dict``: value_and_gradient of a cross-entropy w.r.t. a dict of 6 tensors (26k parameters).
    - ``jacobian-100``: jacobian of a 100 -> 100 map.
    - ``hessian-1000`` and ``hvp-1000``: hessian and one HVP of a 1000-dim function.

    Tags: ``"overhead"`` marks the overhead-bound scenarios (tiny work per call, where a
    backend's fixed cost shows); ``"large"`` marks those that cost ``O(numel(x))`` evaluations
    of ``f`` by finite differences (too slow to time). ``quick`` keeps the same scenarios: the
    quick bench saves time on rounds, not on sizes.
    """
    del quick
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    small_inputs, small_targets = randn(4, 8), randn(4, 1)
    small_params = randn(161, scale=0.3)
    n = 1_000_000
    ros_x = 1 + 0.1 * randn(n)
    dict_params = {
        "w1": randn(64, 128, scale=64**-0.5), "b1": torch.zeros(128),
        "w2": randn(128, 128, scale=128**-0.5), "b2": torch.zeros(128),
        "w3": randn(128, 10, scale=128**-0.5), "b3": torch.zeros(10),
    }
    dict_inputs, dict_labels = randn(128, 64), torch.randint(0, 10, (128,), generator=g)
    jac_x, jac_w = randn(100), randn(100, 100, scale=0.1)
    hess_x = randn(1000, scale=0.5)
    return [
        Scenario("value_and_gradient", mlp_small_loss, small_params,
                 (Constant(small_inputs), Constant(small_targets)), name="mlp-small", tags={"overhead"}),
        Scenario("value_and_gradient", rosenbrock, ros_x, name="rosenbrock-1e6", tags={"large"}),
        Scenario("value_and_gradient", mlp_dict_loss, dict_params,
                 (Constant(dict_inputs), Constant(dict_labels)), name="mlp-dict", tags={"large"}),
        Scenario("jacobian", square_map, jac_x, (Constant(jac_w),), name="jacobian-100"),
        Scenario("hessian", coupled_quartic, hess_x, name="hessian-1000", tags={"large"}),
        Scenario("hvp", coupled_quartic, hess_x, tangents=(randn(1000),), name="hvp-1000", tags={"overhead"}),
    ]


def _evaluate(f: Callable[..., Any], x: Any, contexts: Sequence[Context[Any]]) -> Any:
    """``f(x, *contexts)`` on copies of the inputs, without autograd."""
    with torch.no_grad():
        return f(clone_tree(x), *(clone_tree(c.value) for c in contexts))
