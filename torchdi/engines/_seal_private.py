"""The fence of the global state a seal checks (``engines/_sealed.py``), without dynamo.

Dynamo guards the global state of a compiled frame: ``GLOBAL_STATE`` (its C++
``GlobalStateGuard``: grad mode, autocast, deterministic algorithms, default dtype, threads, the
torch-function switches), the functorch interpreter stack, the torch-function mode stack, the
forward-AD level, the saved-tensors hooks and the default device. A seal records them and checks
them on every call with the same C++ object (its ``__getstate__``/``__setstate__``) and torch's
own accessors, none of which imports ``torch._dynamo``.

The fast path (``FAST_PATHS``): ``"sealed_programs"``, the private internals
``torch._C._dynamo.guards.GlobalStateGuard``, ``torch._C._functorch.peek_interpreter_stack``,
``torch._C._autograd._top_saved_tensors_default_hooks`` and ``torch._C._len_torch_function_stack``
(torch 2.9 .. 2.14.1). Fallback: nothing is sealed (a warm run traces with dynamo, as before).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from torchdi._fence import Fence
from torchdi._fence import probe as _probe

__all__ = ["FAST_PATHS", "fence", "global_state", "global_state_check"]

FAST_PATHS = {
    "sealed_programs": "torch._C._dynamo.guards.GlobalStateGuard and torch's interpreter, mode and hook stacks, which "
    "let a persisted AOTInductor preparation check dynamo's global-state guards without importing dynamo",
}
fence = Fence(FAST_PATHS, {"sealed_programs": "dynamo's import and trace on every warm run (about a second)"})

# torch 2.9 .. 2.14.1: C++ objects and functions, reachable without importing torch._dynamo.
_GLOBAL_STATE_GUARD: Any = _probe(lambda: torch._C._dynamo.guards.GlobalStateGuard)
_PEEK_INTERPRETER: Callable[[], Any] | None = _probe(lambda: torch._C._functorch.peek_interpreter_stack)
_TOP_HOOKS: Callable[[bool], Any] | None = _probe(lambda: torch._C._autograd._top_saved_tensors_default_hooks)
_TORCH_FUNCTION_STACK: Callable[[], int] | None = _probe(lambda: torch._C._len_torch_function_stack)


def _current_device() -> str | None:
    device = getattr(sys.modules.get("torch.utils._device"), "CURRENT_DEVICE", None)
    return None if device is None else str(device)


def global_state(refusal: type[Exception]) -> dict[str, Any]:
    """The global state dynamo guards, now, written down.

    Args:
        refusal: raised (with why) where a seal cannot check that state: this torch lacks the
            internals, or a ``torch.func`` transform, a ``TorchFunctionMode`` or saved-tensors
            hooks are active (states a seal does not record).

    Returns:
        ``{"state": GlobalStateGuard's JSON, "dual_level": ..., "device": ...}``.
    """
    if _GLOBAL_STATE_GUARD is None or _PEEK_INTERPRETER is None or _TOP_HOOKS is None or _TORCH_FUNCTION_STACK is None:
        fence.warn_off("sealed_programs")
        raise refusal("this torch lacks the global-state internals")
    if _PEEK_INTERPRETER() is not None:
        raise refusal("a torch.func transform is active")
    if _TORCH_FUNCTION_STACK() != 0:
        raise refusal("a TorchFunctionMode is active")
    if _TOP_HOOKS(True) is not None:
        raise refusal("saved-tensors hooks are active")
    return {"state": _GLOBAL_STATE_GUARD().__getstate__(), "dual_level": fwAD._current_level, "device": _current_device()}


def global_state_check(recorded: dict[str, Any]) -> Callable[[], bool]:
    """A check that the global state is ``recorded`` (``global_state``'s) again; raises
    ``ValueError`` when this torch cannot read it back."""
    if _GLOBAL_STATE_GUARD is None or _PEEK_INTERPRETER is None or _TOP_HOOKS is None or _TORCH_FUNCTION_STACK is None:
        raise ValueError("this torch lacks the global-state internals")
    guard = _GLOBAL_STATE_GUARD.__new__(_GLOBAL_STATE_GUARD)
    guard.__setstate__(recorded["state"])
    check, level, device = guard.check, recorded["dual_level"], recorded["device"]
    peek, hooks, modes = _PEEK_INTERPRETER, _TOP_HOOKS, _TORCH_FUNCTION_STACK

    def global_state_holds() -> bool:
        return bool(check()) and peek() is None and modes() == 0 and hooks(True) is None and fwAD._current_level == level and _current_device() == device

    return global_state_holds
