"""``State`` contexts (module buffers updated by ``f``) and preparation without visible side effects."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import torchdi as td

BACKENDS = [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")]
IDS = ["autograd", "func", "compile-aot_eager"]


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )


def batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        out.append((torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 2, (8,), generator=g)))
    return out


def cnn_loss(params, buffers, model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(functional_call(model, (params, buffers), (inputs,)), labels)


def eager_training(data):
    model = make_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_batchnorm_state_trains_like_eager_backward(backend):
    data = batches()
    reference = eager_training(data)
    model = make_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    prep = td.prepare_gradient(cnn_loss, backend, params, td.State(buffers), td.Constant(model), td.Constant(data[0]))
    assert int(buffers["1.num_batches_tracked"]) == 0  # preparation updated nothing
    assert torch.equal(buffers["1.running_mean"], torch.zeros(4))
    for batch in data:
        optimizer.zero_grad()
        td.value_and_gradient(
            cnn_loss, backend, params, td.State(buffers), td.Constant(model), td.Constant(batch), prep=prep, out=td.into_grad(params)
        )
        optimizer.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
    assert int(buffers["1.num_batches_tracked"]) == len(data)
    assert prep.num_compilations == (1 if isinstance(backend, td.AutoCompile) else 0)  # value_and_gradient only


def counting_loss(x, counter):
    counter.add_(1)
    return (x * counter).sum()


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_state_is_updated_exactly_once_per_call(backend):
    counter = torch.zeros(())
    x = torch.ones(3)
    prep = td.prepare_gradient(counting_loss, backend, x, td.State(counter))
    assert float(counter) == 0.0
    for step in range(1, 4):
        y, g = td.value_and_gradient(counting_loss, backend, x, td.State(counter), prep=prep)
        assert float(counter) == step and float(y) == 3.0 * step
        torch.testing.assert_close(g, torch.full((3,), float(step)))
    td.gradient(counting_loss, backend, x, td.State(counter), prep=prep)  # the plain operator too
    assert float(counter) == 4.0
    td.gradient(counting_loss, backend, x, td.State(counter))  # one-shot: prepares, then runs once
    assert float(counter) == 5.0


def test_state_where_an_update_cannot_happen_once_is_refused():
    counter = torch.zeros(())
    with pytest.raises(td.UnsupportedOperatorError, match=r"State.*gradient and value_and_gradient"):
        td.prepare_jacobian(lambda x, c: x * c.add_(1), td.AutoFunc(), torch.ones(3), td.State(counter))
    with pytest.raises(td.UnsupportedOperatorError, match="State"):
        td.prepare_gradient(counting_loss, td.AutoFiniteDiff(), torch.ones(3), td.State(counter))
    with pytest.raises(TypeError, match=r"context 1 \(State\) must be a tensor"):
        td.prepare_gradient(counting_loss, td.AutoFunc(), torch.ones(3), td.State(3.0))
    assert float(counter) == 0.0
    # a model without buffers gives an empty State: nothing to update, no error
    td.gradient(lambda x, buffers: x.sum(), td.AutoFunc(), torch.ones(3), td.State({}))


def test_strict_check_names_a_state():
    counter = torch.zeros(())
    prep = td.prepare_gradient(counting_loss, td.AutoFunc(), torch.ones(3), td.State(counter))
    with pytest.raises(td.PreparationMismatchError, match=r"context 1: mismatch: expected State\(Tensor"):
        td.gradient(counting_loss, td.AutoFunc(), torch.ones(3), td.State(torch.zeros(2)), prep=prep)


def dropout_loss(params, model, inputs):
    return functional_call(model, params, (inputs,)).pow(2).mean()


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_preparation_leaves_the_global_rng_as_it_found_it(backend):
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    params = {n: p.detach() for n, p in model.named_parameters()}
    inputs = torch.randn(8, 4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    prep = td.prepare_gradient(dropout_loss, backend, params, td.Constant(model), td.Constant(inputs))
    assert torch.equal(torch.get_rng_state(), before)
    if isinstance(backend, td.AutoCompile):
        return  # a compiled graph draws its dropout masks its own way
    # the first prepared step draws the masks the eager step draws from the same seed
    got = td.gradient(dropout_loss, backend, params, td.Constant(model), td.Constant(inputs), prep=prep)
    torch.manual_seed(123)
    tracked = {n: p.detach().requires_grad_() for n, p in params.items()}
    dropout_loss(tracked, model, inputs).backward()
    for n in params:
        torch.testing.assert_close(got[n], tracked[n].grad)


class RawBatchNorm(nn.Module):
    """Running statistics updated by F.batch_norm, whose kernel does not bump version counters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.mean, self.var, training=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_write_without_version_bump_into_a_constant_is_caught(backend):
    module = RawBatchNorm()

    def loss(x, m):
        return m(x).pow(3).sum()

    with pytest.raises(ValueError, match=r"context 1 \(Constant\): 2 buffers of RawBatchNorm modules \(mean, var\).*td.State"):
        td.prepare_gradient(loss, backend, torch.randn(5, 3), td.Constant(module))
    assert torch.equal(module.mean, torch.zeros(3)) and torch.equal(module.var, torch.ones(3))


def test_the_buffer_error_summarizes_a_deep_network():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(7)])
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, m, x):
        return functional_call(m, p, (x,)).sum()

    with pytest.raises(ValueError) as info:
        td.prepare_gradient(loss, td.AutoFunc(), params, td.Constant(model), td.Constant(torch.randn(6, 4)))
    message = str(info.value)
    assert "context 1 (Constant): 21 buffers of BatchNorm1d modules (running_mean, running_var, num_batches_tracked)" in message
    assert "td.State(dict(model.named_buffers()))" in message
    assert message.count("num_batches_tracked") == 1 and len(message) < 1000
