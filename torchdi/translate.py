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
    "Static",
    "copyfrom",
    "copyto_",
    "ravel",
    "to_device_tensor",
    "translate_contexts",
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


@functools.singledispatch
def to_device_tensor(obj: Any, device: Device) -> Any:
    """Turn one input or context leaf into what a compiled program takes as a traced input.

    This is the one place that decides traced vs static:

    - tensors go to ``device`` (no copy when already there);
    - numpy arrays and numpy scalars become tensors;
    - Python ``float``/``complex`` become 0-d float64/complex128 tensors (traced: a new value
      does not recompile; compiled backends then narrow them to the precision of ``x``, as a
      Python scalar combines with ``x``);
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


# Exact values (float64, complex128); engines narrow them to the precision of x (translate_contexts).
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


def translate_contexts(contexts: Any, device: Device, precision_of: Any) -> Any:
    """``to_device_tensor(contexts, device)``, with Python floats in the precision of ``precision_of``.

    A Python float meets ``x`` as a scalar: ``x`` keeps its dtype. A float64 0-d tensor would
    promote 0-d float32 arithmetic to float64 instead, and a float32 one would round the value
    in float64 programs; so the exact translation is narrowed to ``x``'s (real) dtype.
    """
    translated = to_device_tensor(contexts, device)
    leaf = next((t for t in pytree.tree_leaves(precision_of) if isinstance(t, torch.Tensor)), None)
    if leaf is None or not (leaf.is_floating_point() or leaf.is_complex()):
        return translated
    real = leaf.real.dtype if leaf.is_complex() else leaf.dtype
    originals, spec = pytree.tree_flatten(contexts)
    leaves, translated_spec = pytree.tree_flatten(translated)
    if spec != translated_spec:  # a user translation changed the structure: leave it alone
        return translated
    complex_of_real = torch.complex128 if real == torch.float64 else torch.complex64
    narrowed = [
        t.to(real if type(o) is float else complex_of_real) if type(o) in (float, complex) and isinstance(t, torch.Tensor) else t
        for o, t in zip(originals, leaves)
    ]
    return pytree.tree_unflatten(narrowed, spec)


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
    ):  # results of one AutoSparse preparation share their index tensors: no O(nnz) comparison
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
