"""Real models from their packages: torchvision's resnet18 in train mode, transformers' GPT-2.

Each test skips, saying why, when its package is missing or cannot be imported (torchvision's
registry wheels are built against the CUDA build of torch and fail to load next to a CPU-only
torch: there is then no matching build to test).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from torch import nn
from torch.func import functional_call

import torchdi as td

BACKENDS = [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")]
IDS = ["autograd", "func", "compile-aot_eager"]


def import_or_skip(name: str) -> ModuleType:
    """The package, or a skip naming why it cannot be used (not installed, or a mismatched build)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        pytest.skip(f"{name} is not installed ({error})")
    except Exception as error:  # a wheel built for another torch fails with RuntimeError/OSError
        pytest.skip(f"{name} is installed but does not load with torch {torch.__version__} (no matching build): {error}")


def resnet_loss(params, buffers, model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(functional_call(model, (params, buffers), (images,)), labels)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_resnet18_train_mode_matches_eager_backward(backend):
    torchvision = import_or_skip("torchvision")

    def make() -> nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=4).train()

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(2)]
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for images, labels in data:
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(images), labels).backward()
        ref_opt.step()

    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    prep = td.prepare_gradient(resnet_loss, backend, params, td.State(buffers), td.Constant(model), td.Constant(data[0]))
    for batch in data:
        optimizer.zero_grad()
        td.value_and_gradient(
            resnet_loss, backend, params, td.State(buffers), td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params)
        )
        optimizer.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)


def gpt2_setup():
    transformers = import_or_skip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids


def gpt2_loss(params, model, ids):
    return functional_call(model, params, (ids,), {"labels": ids}).loss


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc()], ids=["autograd", "func"])
def test_gpt2_prepares_and_matches_backward(backend):
    model, ids = gpt2_setup()
    model.eval()  # no dropout: the gradient is deterministic
    params = dict(model.named_parameters())
    prep = td.prepare_gradient(gpt2_loss, backend, params, td.Constant(model), td.Constant(ids))
    loss, grads = td.value_and_gradient(gpt2_loss, backend, params, td.Constant(model), td.Constant(ids), prep=prep)
    model.zero_grad()
    reference = model(ids, labels=ids).loss
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt2_prepares_under_autocompile_defaults():
    """transformers' loss logs through logger.warning_once: AutoCompile's default fullgraph capture
    must not break on it, and the compiled gradient matches backward()."""
    model, ids = gpt2_setup()
    model.eval()
    params = dict(model.named_parameters())
    backend = td.AutoCompile(compiler="aot_eager")
    prep = td.prepare_gradient(gpt2_loss, backend, params, td.Constant(model), td.Constant(ids))
    loss, grads = td.value_and_gradient(gpt2_loss, backend, params, td.Constant(model), td.Constant(ids), prep=prep)
    model.zero_grad()
    reference = model(ids, labels=ids).loss
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert prep.num_compilations == 1
