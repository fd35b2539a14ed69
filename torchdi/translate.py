"""The translation hook (what a compiled program traces) and pytree-aware buffer helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch.utils import _pytree as pytree

__all__ = [
    "IMMUTABLE_STATIC",
    "Static",
    "copyfrom",
    "keep_float_factories_traced",
    "copyto_",
    "float_positions",
    "overlaps_itself",
    "ravel",
    "to_device_tensor",
    "unravel",
]

Device = torch.device | str | None
T = TypeVar("T")


@dataclass(frozen=True)
class Static(Generic[T]):
    """A context value that compiled backends keep static (baked into the program) instead of tracing.

    ``to_device_tensor`` traces floats, numpy arrays and tensors, so that a new value does not
    recompile; Python-level use of such a value (``range(int(c))``, a branch on it, numpy calls)
    cannot be traced. Wrap it in ``Static``: ``f`` receives the wrapper on every backend and reads
    ``.value`` (a plain Python object), the compiled program bakes it in, and the strict check
    compares it by value, so a new value needs a new preparation (with ``strict=False``: a counted,
    logged recompilation).

    Args:
        value: a hashable value (a float, int, str, or a tuple of them).

    Raises:
        TypeError: when ``value`` is not hashable (it could not be compared across calls).

    Example::

        >>> f = lambda x, steps: x.sum() * len(range(int(steps.value)))
        >>> torchdi.gradient(f, torchdi.AutoCompile(), torch.ones(2), torchdi.Constant(torchdi.Static(3.0)))
        tensor([3., 3.])
    """

    value: T

    def __post_init__(self) -> None:
        try:
            hash(self.value)
        except TypeError:
            raise TypeError(
                f"Static(value) needs a hashable value (a float, int, str or a tuple of them), got "
                f"{type(self.value).__name__}"
            ) from None


# Static values a description compares by value (prep's strict check, AutoSparse's watch of the
# context values its pattern was traced with): immutable, so holding one keeps nothing alive.
IMMUTABLE_STATIC = (int, bool, str, bytes, type(None), type(Ellipsis), torch.dtype, torch.device, Static)


@functools.singledispatch
def to_device_tensor(obj: Any, device: Device) -> Any:
    """Turn one input or context leaf into what a compiled program takes as a traced input.

    This is the one place that decides traced vs static:

    - tensors go to ``device`` (no copy when already there);
    - numpy arrays and numpy scalars become tensors;
    - Python ``float``/``complex`` become 0-d float64/complex128 tensors (traced: a new value
      does not recompile; compiled programs hand floats back to ``f`` as Python floats, see
      ``float_positions``);
    - Python ``int``, ``bool``, ``str``, ``None`` and unknown objects stay as they are (static:
      partially evaluated into the program, as sizes and bounds should be);
    - tuples, lists, dicts and namedtuples are walked.

    Register your own types with ``@torchdi.to_device_tensor.register(MyType)``.

    Args:
        obj: the leaf or container to translate.
        device: the device traced tensors must live on (``None``: leave tensors where they are,
            put new ones on the CPU).

    Returns:
        The translated object.

    Example::

        >>> torchdi.to_device_tensor({"lr": 0.1, "steps": 3}, "cpu")
        {'lr': tensor(0.1000, dtype=torch.float64), 'steps': 3}
    """
    return obj


@to_device_tensor.register(torch.Tensor)
def _(obj: torch.Tensor, device: Device) -> torch.Tensor:
    return obj if device is None else obj.to(device)


@to_device_tensor.register(np.ndarray)
def _(obj: np.ndarray, device: Device) -> torch.Tensor:
    return torch.as_tensor(obj, device=device)


@to_device_tensor.register(np.generic)
def _(obj: np.generic, device: Device) -> torch.Tensor:
    return torch.as_tensor(obj, device=device)


# Exact values (float64, complex128); compiled programs turn floats back into Python floats (float_positions).
@to_device_tensor.register(float)
def _(obj: float, device: Device) -> torch.Tensor:
    return torch.tensor(obj, dtype=torch.float64, device=device)


@to_device_tensor.register(complex)
def _(obj: complex, device: Device) -> torch.Tensor:
    return torch.tensor(obj, dtype=torch.complex128, device=device)


@to_device_tensor.register(Static)
@to_device_tensor.register(bool)
@to_device_tensor.register(int)
@to_device_tensor.register(str)
@to_device_tensor.register(type(None))
def _(obj: Any, device: Device) -> Any:
    return obj


@to_device_tensor.register(tuple)
def _(obj: tuple, device: Device) -> tuple:
    items = [to_device_tensor(item, device) for item in obj]
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


@to_device_tensor.register(list)
def _(obj: list, device: Device) -> list:
    return [to_device_tensor(item, device) for item in obj]


@to_device_tensor.register(dict)
def _(obj: dict, device: Device) -> dict:
    translated = {key: to_device_tensor(value, device) for key, value in obj.items()}
    return translated if type(obj) is dict else type(obj)(translated)


def float_positions(values: Any) -> tuple[int, ...]:
    """The positions of Python floats among the flat leaves of ``values``.

    The one float policy of the compiled backends (rule 8): ``to_device_tensor`` turns a Python
    float into an exact float64 0-d tensor (a program input, so a new value does not recompile),
    and the program turns it back into a Python float (``.item()``: a symbolic float to dynamo)
    before ``f`` sees it. ``f`` then does its Python arithmetic on it in double precision and
    combines it with tensors by eager's wrapped-number rule (``x * c`` keeps ``x``'s dtype), as
    eager code does. These are the positions to turn back.

    Args:
        values: a pytree (the contexts' values).

    Returns:
        The flat positions (``pytree.tree_leaves`` order) of the leaves that are Python floats.

    Example::

        >>> torchdi.translate.float_positions((0.5, {"n": 3, "lr": 1e-3}, torch.ones(2)))
        (0, 2)
    """
    return tuple(i for i, leaf in enumerate(pytree.tree_leaves(values)) if isinstance(leaf, float))


def _float_factories() -> frozenset[Any]:
    factories = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.full_like}
    # dynamo records torch.tensor(<symbolic float>) as the reference implementation's call
    reference = getattr(getattr(torch, "_refs", None), "tensor", None)
    if reference is not None:
        factories.add(reference)
    return frozenset(factories)


_FLOAT_FACTORIES = _float_factories()


def keep_float_factories_traced(graph: torch.fx.GraphModule) -> int:
    """Rewrite tensors made from a traced float into products, so the float stays traced.

    A compiled ``f`` receives a Python-float context as a symbolic float (rule 8). Arithmetic
    with tensors keeps it symbolic (``x * c``), but torch's compiler specializes a float that a
    factory turns into a tensor (``torch.tensor(c)``, ``torch.as_tensor(c)``,
    ``torch.scalar_tensor(c)``, ``torch.full(size, c)``, ``torch.full_like(x, c)``), and then
    recompiles for each new value. Made as ``ones(..., dtype) * c`` instead, the tensor has the
    same value (``c`` rounded once to the factory's dtype), dtype and device, and ``c`` stays an
    input of the program. Only float32 and float64 results made from a symbolic float, with no
    keyword but ``dtype`` and ``device``, are rewritten.

    Args:
        graph: the graph dynamo hands a ``torch.compile`` backend (``example_value`` metadata).

    Returns:
        How many calls were rewritten (the graph is recompiled when any was).

    Example::

        >>> # inside a backend: torchdi.translate.keep_float_factories_traced(gm); then compile gm
    """
    rewritten = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in _FLOAT_FACTORIES or set(node.kwargs) - {"dtype", "device"}:
            continue
        shaped = node.target in (torch.full, torch.full_like)
        if len(node.args) != (2 if shaped else 1):
            continue
        value, result = node.args[-1], node.meta.get("example_value")
        if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("example_value"), torch.SymFloat):
            continue
        # float32/float64 only: 1 * c rounds c once to them, as the factory does (a half-precision
        # product could round twice, through float32).
        if not isinstance(result, torch.Tensor) or result.dtype not in (torch.float32, torch.float64):
            continue
        options: dict[str, Any] = {"dtype": result.dtype, "device": result.device}
        with graph.graph.inserting_before(node):
            if node.target is torch.full_like:
                ones = graph.graph.call_function(torch.ones_like, (node.args[0],), options)
            else:
                ones = graph.graph.call_function(torch.ones, (node.args[0] if shaped else (),), options)
            product = graph.graph.call_function(torch.mul, (ones, value))
        ones.meta["example_value"] = product.meta["example_value"] = result
        node.replace_all_uses_with(product)
        graph.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.recompile()
    return rewritten


def _flatten_pair(dst: Any, src: Any, what: str) -> tuple[list[Any], list[Any]]:
    dst_leaves, dst_spec = pytree.tree_flatten(dst)
    src_leaves, src_spec = pytree.tree_flatten(src)
    if dst_spec != src_spec:
        raise ValueError(f"{what}: structure mismatch: destination is {dst_spec}, source is {src_spec}")
    return dst_leaves, src_leaves


def copyto_(dst: Any, src: Any) -> Any:
    """Copy ``src`` into the preallocated ``dst`` in place, leaf by leaf (across devices).

    Args:
        dst: a tensor or pytree of tensors to overwrite.
        src: a tensor or pytree of the same structure and shapes (tensors, numpy arrays or scalars).

    Returns:
        ``dst``.

    Raises:
        ValueError: on a structure or shape mismatch, or a non-tensor leaf in ``dst`` that
            differs from ``src``.

    Example::

        >>> buf = torch.empty(3)
        >>> torchdi.copyto_(buf, torch.ones(3))
        tensor([1., 1., 1.])
    """
    dst_leaves, src_leaves = _flatten_pair(dst, src, "copyto_")
    for i, (d, s) in enumerate(zip(dst_leaves, src_leaves)):
        if isinstance(d, torch.Tensor):
            if not isinstance(s, torch.Tensor):
                s = torch.as_tensor(s)
            if d.shape != s.shape:
                raise ValueError(
                    f"copyto_: shape mismatch at leaf {i}: destination {tuple(d.shape)}, source {tuple(s.shape)}"
                )
            if d.layout == torch.sparse_csr:
                _copy_csr_values(d, s, i)
                continue
            if s.layout != torch.strided:  # torch's own copy_ error names neither out= nor the remedy
                raise ValueError(
                    f"copyto_: leaf {i} of the source is a sparse {s.layout} tensor (an AutoSparse result) but "
                    f"the destination is {d.layout}: out= for a sparse result must be the CSR tensor a previous "
                    "call of the same preparation returned (out = jacobian(..., prep=prep); later "
                    "jacobian(..., prep=prep, out=out)); for a dense matrix, call .to_dense() on the result"
                )
            d.copy_(s)
        elif d is not s and d != s:
            raise ValueError(
                f"copyto_: leaf {i} of the destination is not a tensor ({type(d).__name__}) and differs "
                "from the source: it cannot be overwritten in place"
            )
    return dst


def _copy_csr_values(dst: torch.Tensor, src: torch.Tensor, leaf: int) -> None:
    """Fill a sparse CSR ``dst`` in place from ``src`` of the same sparsity pattern (values only)."""
    if src.layout == torch.sparse_csr and _same_storage(dst.crow_indices(), src.crow_indices()) and _same_storage(
        dst.col_indices(), src.col_indices()
    ):  # the same index tensors (dst is src): no O(nnz) comparison. (AutoSparse results own
        # theirs, so the comparison below runs for out=; it is O(nnz), like the values' copy.)
        dst.values().copy_(src.values())
        return
    if src.layout != torch.sparse_csr or not (
        torch.equal(dst.crow_indices(), src.crow_indices().to(dst.device))
        and torch.equal(dst.col_indices(), src.col_indices().to(dst.device))
    ):
        raise ValueError(
            f"copyto_: leaf {leaf} is a sparse CSR destination; the source must be a CSR tensor with the same "
            "sparsity pattern (crow_indices and col_indices), e.g. a result of the same AutoSparse preparation"
        )
    dst.values().copy_(src.values())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (conservative: ``True`` when unsure): an
    ``expand``ed tensor (stride 0), an ``as_strided`` view whose strides overlap.

    Dimensions sorted by stride, each must step past everything the smaller ones span. Such a
    tensor cannot take different values per element: ``torch.func``'s forward mode refuses it as
    a primal ("more than one element of the written-to tensor refers to a single memory
    location"), so operators hand runners a contiguous copy of such an ``x`` (and ``AutoFunc`` of
    such a context primal), and ``distributed.all_reduce_`` points such a gradient at fresh memory.
    """
    if t.numel() <= 1:
        return False
    span = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def copyfrom(src: Any, out: Any = None) -> Any:
    """Bring a device result back: to host memory, or into ``out`` in place.

    Args:
        src: a tensor or pytree of tensors, on any device.
        out: optional preallocated destination of the same structure.

    Returns:
        ``out`` after copying, or host (CPU) tensors when ``out`` is ``None``.

    Example::

        >>> torchdi.copyfrom(torch.ones(2))
        tensor([1., 1.])
    """
    if out is not None:
        return copyto_(out, src)
    return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, src)


def ravel(tree: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """Flatten a tensor pytree into one vector; returns it and the inverse (``unravel``)."""
    leaves, spec = pytree.tree_flatten(tree)
    shapes = [leaf.shape for leaf in leaves]
    sizes = [leaf.numel() for leaf in leaves]
    flat = torch.cat([leaf.reshape(-1) for leaf in leaves]) if len(leaves) != 1 else leaves[0].reshape(-1)

    def inverse(vector: torch.Tensor) -> Any:
        return unravel(vector, spec, shapes, sizes)

    return flat, inverse


def unravel(vector: torch.Tensor, spec: pytree.TreeSpec, shapes: list[torch.Size], sizes: list[int]) -> Any:
    """Split a (possibly batched, batch dims first) vector back into a pytree of ``shapes``."""
    batch = vector.shape[:-1]
    pieces = torch.split(vector, sizes, dim=-1)
    return pytree.tree_unflatten([p.reshape(*batch, *s) for p, s in zip(pieces, shapes)], spec)
