"""``out=td.into_grad(params)``: gradients land in the parameters' current ``.grad``, as with ``backward()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import torchdi as td

BACKENDS = [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")]
IDS = ["autograd", "func", "compile-aot_eager"]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(params, model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(functional_call(model, params, (inputs,)), labels, reduction="sum")


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_leftover_zero_grad_set_to_none_still_trains(backend):
    """The optimizer's default zero_grad() drops .grad: into_grad creates it again, as backward() does."""
    reference, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = dict(model.named_parameters())
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data(16)))
    for step in range(3):
        batch = data(16, seed=step)
        ref_opt.zero_grad()
        loss_fn(dict(reference.named_parameters()), reference, batch).backward()
        ref_opt.step()
        optimizer.zero_grad()  # set_to_none=True: every .grad is None now
        grads = td.gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params))
        assert all(grads[n] is p.grad for n, p in params.items())
        optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_four_accumulated_micro_batches_equal_one_batch(backend):
    model = make_model()
    params = dict(model.named_parameters())
    inputs, labels = data(16)
    full = td.gradient(loss_fn, td.AutoAutograd(), params, td.Constant(model), td.Constant((inputs, labels)))
    micro = [(inputs[i : i + 4], labels[i : i + 4]) for i in range(0, 16, 4)]
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(micro[0]))
    model.zero_grad()
    for batch in micro:
        td.value_and_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params))
    grad_ids = {n: id(p.grad) for n, p in params.items()}
    for n, p in params.items():
        torch.testing.assert_close(p.grad, full[n], atol=1e-5, rtol=1e-5)
    # a second round accumulates in place into the same tensors
    for batch in micro:
        td.gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params))
    assert {n: id(p.grad) for n, p in params.items()} == grad_ids
    for n, p in params.items():
        torch.testing.assert_close(p.grad, 2 * full[n], atol=1e-5, rtol=1e-5)


def test_overwrite_mode_and_views_are_not_adopted():
    x = torch.nn.Parameter(torch.ones(3))
    x.grad = torch.full((3,), 7.0)
    td.gradient(lambda t: (t["x"] ** 2).sum(), td.AutoFunc(), {"x": x}, out=td.into_grad({"x": x}, accumulate=False))
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    x.grad = None
    td.gradient(lambda t: t.sum(), td.AutoFunc(), x, out=td.into_grad(x))  # d sum = an expanded view of one
    x.grad.add_(1.0)  # an adopted expanded view would refuse this in-place add
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_into_grad_with_another_structure_is_refused():
    x = {"a": torch.ones(2), "b": torch.ones(2)}
    with pytest.raises(ValueError, match="into_grad"):
        td.gradient(lambda t: t["a"].sum() + t["b"].sum(), td.AutoFunc(), x, out=td.into_grad([x["a"], x["b"]]))


def test_into_grad_of_a_computed_tensor_is_refused_naming_it():
    weight = torch.randn(3, requires_grad=True)
    params = {"scaled": weight * 2}  # a computed tensor: not what an optimizer holds
    with pytest.raises(ValueError, match=r"params\['scaled'\] is not a leaf tensor.*named_parameters"):
        td.into_grad(params)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("partial", [False, True], ids=["all-params", "trainable-only"])
def test_frozen_parameters_stay_frozen_as_with_backward(backend, partial):
    """Fine-tuning with a frozen layer: the README recipe (all named parameters in x) leaves the
    frozen ones' .grad None, as backward() does, so Adam does not move them (issue 23 item 4)."""
    reference, model = make_model(), make_model()
    for m in (reference, model):
        m[0].weight.requires_grad_(False)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    frozen = model[0].weight.detach().clone()
    named = dict(model.named_parameters())
    params = {n: p for n, p in named.items() if p.requires_grad} if partial else named
    prep = td.prepare_gradient(loss_fn, backend, params, td.Constant(model), td.Constant(data(16)))
    for step in range(3):
        batch = data(16, seed=step)
        ref_opt.zero_grad()
        loss_fn(dict(reference.named_parameters()), reference, batch).backward()
        ref_opt.step()
        optimizer.zero_grad()
        grads = td.gradient(loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params))
        assert reference[0].weight.grad is None and model[0].weight.grad is None
        if not partial:
            assert grads["0.weight"] is None  # what .grad holds, as for every other parameter
        optimizer.step()
    assert torch.equal(model[0].weight, frozen)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
