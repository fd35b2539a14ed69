"""torch-xla's private internals are fenced in ``torchdi/engines/_xla_private.py`` (and dynamo's in
``_dynamo.py``): with each removed in turn, AutoXLA gives the same results, compiles once, keeps
``State`` updates and fresh randomness, and one warning names the fast path that is off."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("torch_xla", reason="torch-xla is not installed here: `make test-xla` runs these in .venv-xla")

import torchdi as td
from torchdi.engines import _dynamo, _xla_private

XLA = td.AutoXLA()
REFERENCE = td.AutoAutograd()
XLA_HOOKS = {"openxla_parts": ("aot_autograd",), "xla_sync_multi": ("sync_multi",), "xla_get_cpu_tensors": ("get_cpu_tensors",)}


def loss(x, c, counter):
    counter.add_(1)
    return (torch.tanh(x) * c).sum() + (x**2).sum() * counter.sum()


def noisy(x):
    return (nn.functional.dropout(torch.tanh(x), p=0.5, training=True)).sum()


def lazy(x):
    y = (torch.sin(x) ** 2).sum()
    return y * float(y.detach().item() > -1.0)  # = y; .item() keeps dynamo from capturing f


@pytest.mark.parametrize("name", [*sorted(XLA_HOOKS), "guard_lookup", "release"])
def test_autoxla_without_an_internal(name, monkeypatch, caplog):
    if name in XLA_HOOKS:
        found = _xla_private.hooks()._replace(**dict.fromkeys(XLA_HOOKS[name]))
        monkeypatch.setattr(_xla_private, "hooks", lambda: found)
        monkeypatch.setattr(_xla_private.fence, "warned", set())
    else:
        monkeypatch.setattr(_dynamo, {"guard_lookup": "_CACHE_ENTRY_LIST", "release": "_RELEASE"}[name], None)
        monkeypatch.setattr(_dynamo.fence, "warned", set())
    x, c = torch.linspace(-1.0, 1.0, 5), torch.rand(5)
    counter = torch.zeros(1)
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        prep = td.prepare_gradient(loss, XLA, x, td.Constant(c), td.State(counter))
        assert counter.item() == 0  # preparation updated nothing
        compiled = prep.num_compilations
        for i in range(3):
            x2, c2 = torch.randn(5), torch.rand(5)
            want = td.value_and_gradient(loss, REFERENCE, x2, td.Constant(c2), td.State(counter.clone()))
            got = td.value_and_gradient(loss, XLA, x2, td.Constant(c2), td.State(counter), prep=prep)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert counter.item() == i + 1  # State updated once per call
        assert prep.num_compilations == compiled
        # randomness stays fresh per call
        wide = torch.linspace(-1.0, 1.0, 64)
        noisy_prep = td.prepare_gradient(noisy, XLA, wide)
        seen = {tuple(td.gradient(noisy, XLA, wide, prep=noisy_prep).tolist()) for _ in range(5)}
        assert len(seen) == 5
        if name == "xla_sync_multi":  # used by the lazy fallback only
            lazy_prep = td.prepare_gradient(lazy, XLA, x)
            assert lazy_prep.runner.path.startswith("lazy fallback")
            for _ in range(2):
                x2 = torch.randn(5)
                torch.testing.assert_close(td.gradient(lazy, XLA, x2, prep=lazy_prep), td.gradient(lazy, REFERENCE, x2))
    if name != "release":  # (nothing is dropped here while the test looks)
        assert sum(f"({name}:" in r.getMessage() for r in caplog.records if r.name == "torchdi") == 1
