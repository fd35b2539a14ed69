"""Backend descriptions: frozen, hashable dataclasses that hold settings only.

A backend says *how* to differentiate; the code that does it lives in ``torchdi/engines``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchdi.errors import BackendUnavailableError
from torchdi.sparsity import (
    DenseSparsity,
    GreedyColoring,
    KnownColoring,
    KnownSparsity,
    TracerSparsity,
)

__all__ = [
    "AutoAutograd",
    "AutoCompile",
    "AutoFiniteDiff",
    "AutoFunc",
    "AutoSparse",
    "AutoXLA",
    "Backend",
    "DataParallel",
    "MixedMode",
    "SecondOrder",
    "check_available",
]


@dataclass(frozen=True)
class AutoAutograd:
    """Eager ``torch.autograd``: the reference backend.

    Reverse mode through ``torch.autograd.grad``, forward mode through dual tensors
    (``torch.autograd.forward_ad``), second order through double backward.

    Example::

        >>> torchdi.gradient(lambda x: (x**2).sum(), torchdi.AutoAutograd(), torch.ones(3))
        tensor([2., 2., 2.])
    """


@dataclass(frozen=True)
class AutoFunc:
    """Eager ``torch.func`` transforms (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``vmap``).

    Args:
        chunk_size: passed to ``jacrev``/``jacfwd`` to bound the memory of batched jacobians.
            ``None`` computes all rows at once.
        mode: how jacobians are built: ``"forward"`` forces ``jacfwd`` (one column per input),
            ``"reverse"`` forces ``jacrev`` (one row per output); ``None`` picks by shape
            (forward when ``x`` has fewer elements than ``f(x)``).
    """

    chunk_size: int | None = None
    mode: str | None = None

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (
            not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1
        ):
            raise ValueError(f"AutoFunc: chunk_size must be None or a positive int, got {self.chunk_size!r}")
        if self.mode not in (None, "forward", "reverse"):
            raise ValueError(f"AutoFunc: mode must be None, 'forward' or 'reverse', got {self.mode!r}")


@dataclass(frozen=True)
class AutoCompile:
    """The functional closure built by ``inner``, compiled once with ``torch.compile`` at preparation.

    Args:
        inner: the eager backend whose closure is compiled (``AutoFunc()`` by default).
        mode: ``torch.compile`` mode (``None``, ``"reduce-overhead"``, ``"max-autotune"``, ...).
        fullgraph: refuse graph breaks (an error at preparation names the reason).
        dynamic: ``torch.compile``'s ``dynamic=``.
        compiler: ``torch.compile``'s ``backend=`` (``"inductor"``, ``"aot_eager"``, ...), or
            ``"aot_inductor"`` (torchdi's): each graph dynamo traces compiled by AOTInductor and
            called from C++ behind the same guards, inductor for the graphs it must not run
            (``engines/_aoti_private.py``); faster calls, slower cold compilations; CPU.
        options: inductor options (a mapping), as ``torch.compile(options=...)``. Over torchdi's
            one default: ``{"layout_optimization": False}`` (see ``engines._compiled.inductor_options``).
        cache_dir: persist the compiled artifacts of each preparation (torch's Mega-Cache:
            AOTAutograd's and inductor's FX graph caches) in this directory, and load them when a
            later preparation (this process or another) compiles the same program. ``None``:
            ``TORCHDI_CACHE_DIR`` when it is set, else no persistence (opt-in, see the README);
            ``""``: never. Dynamo traces ``f`` again on every preparation and builds its guards
            from that trace, so a changed global, closure cell or helper function compiles anew:
            a loaded program is never stale. ``prep.loaded_from_cache`` says whether this
            preparation's compilation reused persisted artifacts.
    """

    inner: Backend = field(default_factory=lambda: AutoFunc())
    mode: str | None = None
    fullgraph: bool = True
    dynamic: bool | None = None
    compiler: str = "inductor"
    options: Mapping[str, Any] | None = field(default=None, hash=False)
    cache_dir: str | os.PathLike[str] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.inner, (AutoAutograd, AutoFunc, SecondOrder)):
            raise TypeError(
                "AutoCompile: inner must be AutoFunc(), AutoAutograd() or SecondOrder(...) of them, "
                f"got {self.inner!r}"
            )
        if self.mode is not None and self.options is not None:
            raise ValueError("AutoCompile: pass either mode= or options=, not both (torch.compile rule)")
        if not isinstance(self.compiler, str):
            raise TypeError(f"AutoCompile: compiler must be a backend name (str), got {self.compiler!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"AutoCompile: cache_dir must be a directory (str or path), \"\" or None, got {self.cache_dir!r}")

    def __hash__(self) -> int:
        options = tuple(sorted(self.options.items())) if self.options else None
        return hash((self.inner, self.mode, self.fullgraph, self.dynamic, self.compiler, options))


@dataclass(frozen=True)
class AutoXLA:
    """The closure built by ``inner``, lowered through torch-xla to an XLA device.

    Args:
        inner: the eager backend whose closure is lowered (``AutoFunc()`` by default).
        device: the XLA device (``None``: torch-xla's default device).
        reuse_buffers: own device buffers for ``x`` and tensor contexts and copy new values into
            them each call, instead of transferring fresh tensors.
    """

    inner: Backend = field(default_factory=lambda: AutoFunc())
    device: Any = None
    reuse_buffers: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.inner, (AutoAutograd, AutoFunc, SecondOrder)):
            raise TypeError(f"AutoXLA: inner must be an eager backend, got {self.inner!r}")


@dataclass(frozen=True)
class AutoFiniteDiff:
    """Finite differences, for black-box code and for checking other backends.

    Args:
        method: ``"central"`` (error O(h^2)), ``"forward"`` or ``"backward"`` (O(h)).
        step: the relative step ``h``; ``None`` picks ``eps**(1/3)`` (central) or ``eps**(1/2)``
            for the input's dtype, scaled by ``1 + max|x|``.
    """

    method: Literal["central", "forward", "backward"] = "central"
    step: float | None = None

    def __post_init__(self) -> None:
        if self.method not in ("central", "forward", "backward"):
            raise ValueError(
                f"AutoFiniteDiff: method must be 'central', 'forward' or 'backward', got {self.method!r}"
            )
        if self.step is not None and not (isinstance(self.step, (int, float)) and self.step > 0):
            raise ValueError(f"AutoFiniteDiff: step must be None or a positive number, got {self.step!r}")


@dataclass(frozen=True)
class SecondOrder:
    """Second-order operators where ``outer`` differentiates what ``inner`` computes.

    ``SecondOrder(AutoFunc(), AutoFunc())`` computes an HVP as a forward-mode pushforward (outer)
    of a reverse-mode gradient (inner). First-order operators use ``inner``.
    """

    outer: Backend
    inner: Backend

    def __post_init__(self) -> None:
        for name in ("outer", "inner"):
            value = getattr(self, name)
            if not isinstance(value, _BACKEND_TYPES):
                raise TypeError(f"SecondOrder: {name} must be a torchdi backend, got {value!r}")


@dataclass(frozen=True)
class MixedMode:
    """Forward passes of ``forward`` and reverse passes of ``reverse``, mixed (DI's ``MixedMode``).

    Under ``AutoSparse``, jacobians use *bidirectional* colouring: some non-zeros are read from
    colour-compressed pushforwards of ``forward``, the others from colour-compressed pullbacks of
    ``reverse`` (a jacobian with a dense first row and column takes 3 passes instead of ``n``);
    a one-sided colouring is kept when it needs no more passes. A dense jacobian uses whichever
    mode needs fewer passes (forward when ``x`` is smaller than ``f(x)``). Pushforwards and
    derivatives use ``forward``; pullbacks and gradients ``reverse``; second-order operators
    ``SecondOrder(forward, reverse)`` (forward over reverse).

    Args:
        forward: the backend of the forward passes (``AutoFunc()``, ``AutoCompile()``, ...).
        reverse: the backend of the reverse passes.

    Example::

        >>> backend = torchdi.AutoSparse(torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoFunc()))
        >>> def f(x):  # an arrowhead jacobian
        ...     return torch.cat([x.sum().reshape(1), x[1:] * x[0]])
        >>> torchdi.prepare_jacobian(f, backend, torch.rand(100)).ncolors
        3
    """

    forward: Backend
    reverse: Backend

    def __post_init__(self) -> None:
        for name in ("forward", "reverse"):
            value = getattr(self, name)
            if not isinstance(value, _BACKEND_TYPES) or isinstance(value, (AutoSparse, MixedMode)):
                raise TypeError(
                    f"MixedMode: {name} must be a dense torchdi backend such as AutoFunc() or AutoCompile(), got {value!r}"
                )


@dataclass(frozen=True)
class AutoSparse:
    """Sparse jacobians and hessians from colour-compressed passes of a dense backend.

    At preparation the sparsity pattern is detected (``sparsity``), its columns or rows are
    coloured so that structurally orthogonal ones share one pass (``coloring``), and the dense
    backend's *batched* pushforward, pullback (jacobian) or HVP (hessian) is prepared once on the
    colour seeds (one compiled program on compiled backends, never recompiled). Each call runs
    the compressed passes and decompresses into a sparse CSR tensor (``x`` and ``y`` flattened):
    ``.to_dense().reshape(y.shape + x.shape)`` gives the dense layout, ``.to_sparse_coo()`` COO.
    The jacobian uses forward mode (column colouring) or reverse mode (row colouring), whichever
    needs fewer colours. Other operators go to ``dense`` unchanged.

    The pattern is traced from ``f`` as it reads its globals, closure cells, attributes and
    closed-over tensors at preparation. Every call compares what ``f`` read then
    (``torchdi.reads``: identities, simple values, tensors' version counters; about 0.1 us per
    place) and traces the pattern again when something changed, colouring and preparing again
    when it is not inside the old one; a write through ``tensor.data`` bumps no version and is not
    seen. Static context values (an int, a string, a ``Static``: ``x.roll(k)`` with
    ``Constant(k)``) are compared too, and a new one traces the pattern again. A
    ``KnownSparsity`` or ``KnownColoring`` is used as given. Every call also compares the
    shape of ``f(x)`` with the pattern's: a changed one raises ``PreparationMismatchError``.

    Args:
        dense: the torchdi backend that runs the compressed passes (``AutoFunc()``,
            ``AutoCompile()``, ``AutoXLA()``, ``AutoAutograd()``, ...); ``MixedMode(forward,
            reverse)`` for bidirectional colouring of jacobians.
        sparsity: ``TracerSparsity()`` (global, from ``f``'s graph), ``DenseSparsity()`` (local, at
            the preparation point) or ``KnownSparsity(pattern)``.
        coloring: ``GreedyColoring(order=..., postprocessing=..., decompression=...)``, or a
            ``KnownColoring`` (``prep.known_coloring`` of an earlier preparation of the same ``f``:
            its pattern and colours are used as they are, with no detection and no colouring).

    The prep exposes ``sparsity_pattern`` (a boolean sparse CSR tensor), ``ncolors`` (the number
    of compressed passes), ``colors`` (``"mixed"``: a pair, column colours then row colours, ``-1``
    for a column or row in no pass), ``groups`` (the indices of each colour, forward ones first),
    ``sparse_mode`` (``"forward"``, ``"reverse"``, ``"mixed"``, ``"star"`` or ``"substitution"``),
    ``sparsity_fallbacks`` (ops the tracer had no rule for), ``loaded_from_cache`` and
    ``known_coloring`` (the pattern and colouring as a picklable ``KnownColoring``, to pass back
    as ``coloring=``).

    Detection and colouring persist in ``torchdi.cache`` (``TORCHDI_CACHE_DIR``, on by default
    under the user's cache directory; ``""`` turns it off): a ``TracerSparsity`` pattern is keyed
    by ``f`` and everything it reads (code, globals, closure cells, helper functions, tensor
    values; ``torchdi.fingerprint``) with the layouts of ``x``, ``y`` and the contexts, and a
    loaded pattern passes the same check against ``f``'s own derivative as a fresh one (else it is
    traced again); a colouring is keyed by the pattern and the colouring settings. A
    ``KnownColoring`` is used as given (nothing is read from or written to the cache).

    Example::

        >>> backend = torchdi.AutoSparse(torchdi.AutoFunc())
        >>> prep = torchdi.prepare_jacobian(torch.diff, backend, torch.ones(5))
        >>> prep.ncolors
        2
        >>> torchdi.jacobian(torch.diff, backend, torch.arange(5.0), prep=prep).to_dense()
        tensor([[-1.,  1.,  0.,  0.,  0.],
                [ 0., -1.,  1.,  0.,  0.],
                [ 0.,  0., -1.,  1.,  0.],
                [ 0.,  0.,  0., -1.,  1.]])
    """

    dense: Backend = field(default_factory=lambda: AutoFunc())
    sparsity: Any = field(default_factory=lambda: _default_sparsity())
    coloring: Any = field(default_factory=lambda: _default_coloring())

    def __post_init__(self) -> None:
        if not isinstance(self.dense, _BACKEND_TYPES) or isinstance(self.dense, AutoSparse):
            raise TypeError(f"AutoSparse: dense must be a dense torchdi backend such as AutoFunc() or AutoCompile(), got {self.dense!r}")
        if not isinstance(self.sparsity, (TracerSparsity, DenseSparsity, KnownSparsity)):
            raise TypeError(
                "AutoSparse: sparsity must be TracerSparsity(), DenseSparsity(...) or KnownSparsity(pattern), "
                f"got {self.sparsity!r}"
            )
        if not isinstance(self.coloring, (GreedyColoring, KnownColoring)):
            raise TypeError(
                f"AutoSparse: coloring must be GreedyColoring(...) or a KnownColoring (prep.known_coloring), got {self.coloring!r}"
            )


@dataclass(frozen=True)
class DataParallel:
    """Data-parallel training: ``backend``'s gradients reduced across the processes of ``group``.

    Exported as ``torchdi.distributed.DataParallel``. Each process calls ``gradient`` or
    ``value_and_gradient`` on its own batch; every process gets the gradient of the mean loss
    (``op="mean"``, what ``DistributedDataParallel`` computes; ``"sum"``: of the sum), and
    ``value_and_gradient``'s value is reduced the same way. Two kinds of ``x``:

    - plain tensors (a replicated model, as with DDP): the gradients are all-reduced in flat
      buckets (one collective per dtype for a small model);
    - DTensors sharded by FSDP2 (``fully_shard``; ``x = dict(model.named_parameters())``): the
      shards are all-gathered before ``f`` runs and the gradients reduce-scattered back, so
      they come back as DTensors with the parameters' placements (FSDP2's own communication).
      ``f`` calls ``torchdi.distributed.functional_call`` (which keeps FSDP2's hooks out). On
      ``AutoAutograd`` FSDP2's own hooks run instead, gathering the parameters layer by layer
      (eager FSDP2's memory and prefetching; any mesh and placement ``fully_shard`` takes). On
      ``AutoFunc`` ``f`` receives the shards and ``functional_call`` gathers each unit while it
      runs, by differentiable operations (its full parameters freed after its forward and
      gathered again for its backward); ``f`` must then reach ``x`` only through it.

    On ``AutoCompile`` the collectives are inside the compiled program (traceable functional
    collectives); on eager backends they run eagerly around the gradient.

    Args:
        backend: the backend that computes each process's gradient: ``AutoAutograd()``,
            ``AutoFunc()``, ``AutoCompile(...)`` or ``AutoFiniteDiff(...)``.
        group: the ``torch.distributed`` process group of plain-tensor ``x`` (``None``: the
            default group). Sharded ``x`` uses its device mesh's group.
        op: ``"mean"`` or ``"sum"``.

    Example (in each process of ``python -m torch.distributed.run --nproc-per-node 2``)::

        backend = torchdi.distributed.DataParallel(torchdi.AutoCompile())
        loss, grads = torchdi.value_and_gradient(loss_fn, backend, params, torchdi.Constant(model),
                                                 torchdi.Constant(local_batch), out=torchdi.into_grad(params))
        optimizer.step()
    """

    backend: Backend
    group: Any = None
    op: Literal["mean", "sum"] = "mean"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, (AutoAutograd, AutoFunc, AutoCompile, AutoFiniteDiff)):
            raise TypeError(
                "DataParallel: backend must be AutoAutograd(), AutoFunc(), AutoCompile(...) or AutoFiniteDiff(...), "
                f"got {self.backend!r}"
            )
        if self.op not in ("mean", "sum"):
            raise ValueError(f'DataParallel: op must be "mean" or "sum", got {self.op!r}')

    def __hash__(self) -> int:
        return hash((DataParallel, self.backend, id(self.group) if self.group is not None else None, self.op))


def _default_sparsity() -> Any:
    return TracerSparsity()


def _default_coloring() -> Any:
    return GreedyColoring()


Backend = AutoAutograd | AutoFunc | AutoCompile | AutoXLA | AutoFiniteDiff | SecondOrder | AutoSparse | MixedMode | DataParallel
_BACKEND_TYPES = (AutoAutograd, AutoFunc, AutoCompile, AutoXLA, AutoFiniteDiff, SecondOrder, AutoSparse, MixedMode, DataParallel)


def check_available(backend: Backend) -> bool:
    """Whether ``backend`` can run here (its package is installed and its device present).

    Example::

        >>> torchdi.check_available(torchdi.AutoFunc())
        True
    """
    return unavailable_reason(backend) is None


def unavailable_reason(backend: Backend) -> str | None:
    """Why ``backend`` cannot run here, or ``None`` when it can."""
    if not isinstance(backend, _BACKEND_TYPES):
        raise TypeError(f"backend must be a torchdi backend (AutoAutograd(), AutoFunc(), ...), got {backend!r}")
    if isinstance(backend, SecondOrder):
        return unavailable_reason(backend.outer) or unavailable_reason(backend.inner)
    if isinstance(backend, MixedMode):
        return unavailable_reason(backend.forward) or unavailable_reason(backend.reverse)
    if isinstance(backend, AutoCompile):
        return unavailable_reason(backend.inner)
    if isinstance(backend, AutoSparse):
        return unavailable_reason(backend.dense)
    if isinstance(backend, DataParallel):
        return unavailable_reason(backend.backend)
    if isinstance(backend, AutoXLA):
        if importlib.util.find_spec("torch_xla") is None:
            return "AutoXLA needs the 'torch_xla' package (pip install torchdi[xla]; torch-xla pins its torch version)"
        return xla_device_problem(backend)
    return None


def require_available(backend: Backend) -> None:
    """Raise ``BackendUnavailableError`` naming what is missing when ``backend`` cannot run."""
    reason = unavailable_reason(backend)
    if reason is not None:
        raise BackendUnavailableError(reason)


@functools.cache
def _probe(device: Any) -> str | None:
    try:
        import torch_xla
    except Exception as error:  # ImportError, or undefined symbols on a torch version mismatch
        return f"AutoXLA: 'import torch_xla' failed ({type(error).__name__}: {error}); torch-xla pins its torch version"
    try:
        target = torch_xla.device() if device is None else torch.device(device)
        torch.zeros(1, device=target).add_(1).cpu()
    except Exception as error:  # no libtpu, no PJRT plugin, ...
        return (
            f"AutoXLA: no XLA device is usable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "set PJRT_DEVICE=TPU on a TPU host, or PJRT_DEVICE=CPU for torch-xla's CPU client"
        )
    try:
        probe = torch.zeros(1, device=target, requires_grad=True)
        (probe * 2).sum().backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        # PyTorch's autograd engine sizes its per-device queues at its first backward pass.
        return (
            "AutoXLA: this process ran a backward pass before the XLA device existed, and PyTorch's "
            "autograd engine cannot learn about new devices afterwards. Call "
            "torchdi.check_available(torchdi.AutoXLA()) (or torch_xla.device()) before any other "
            "differentiation in the process."
        )
    return None


def xla_device_problem(backend: AutoXLA) -> str | None:
    """Why ``backend``'s XLA device cannot be used here, or ``None`` (the probe runs once)."""
    return _probe(None if backend.device is None else str(backend.device))

