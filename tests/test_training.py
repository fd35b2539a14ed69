"""Drop-in use in PyTorch training code: modules, optimizers, DataLoader batches."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
from torch import nn

import torchdi as td

_spec = importlib.util.spec_from_file_location("train_mlp", pathlib.Path(__file__).parents[1] / "examples" / "train_mlp.py")
assert _spec is not None and _spec.loader is not None
train_mlp = importlib.util.module_from_spec(_spec)
sys.modules["train_mlp"] = train_mlp  # dynamo looks traced functions' modules up by name
_spec.loader.exec_module(train_mlp)

BACKENDS = [td.AutoFunc(), td.AutoCompile(compiler="aot_eager"), td.AutoCompile(), td.AutoXLA()]


@pytest.mark.parametrize("backend", BACKENDS, ids=["func", "compile-aot_eager", "compile-inductor", "xla"])
def test_training_matches_eager_autograd(backend):
    if not td.check_available(backend):
        pytest.skip("backend unavailable here (torch-xla runs in tests/xla)")
    steps = 8
    reference, ref_loss, _ = train_mlp.train(td.AutoAutograd(), steps)
    model, loss, _ = train_mlp.train(backend, steps)
    assert train_mlp.max_parameter_difference(model, reference) < 1e-5
    assert abs(loss - ref_loss) < 1e-5
    assert loss < 1.2  # it learns: log(3) ~ 1.0986 at the start, falls below after a few steps


def test_training_loss_decreases():
    _, early, _ = train_mlp.train(td.AutoFunc(), 2)
    _, late, _ = train_mlp.train(td.AutoFunc(), 60)
    assert late < early - 0.1


def _setup(batch_size=16):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = torch.zeros_like(p)
    batch = (torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,)))
    return model, params, batch


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")], ids=str)
def test_gradients_land_in_param_grad_without_new_tensors(backend):
    model, params, batch = _setup()
    grads = {n: p.grad for n, p in params.items()}
    ids = {n: id(g) for n, g in grads.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prep = td.prepare_gradient(train_mlp.loss_fn, backend, params, td.Constant(model), td.Constant(batch))
    for seed in range(3):
        batch = (torch.randn(16, 4, generator=torch.Generator().manual_seed(seed)), torch.randint(0, 2, (16,)))
        result = td.gradient(train_mlp.loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=grads)
        assert result is grads
        assert {n: id(p.grad) for n, p in params.items()} == ids  # the optimizer reads these very tensors
        model.zero_grad(set_to_none=False)
        loss = train_mlp.loss_fn({n: p for n, p in params.items()}, model, batch)
        loss.backward()
        expected = {n: p.grad.clone() for n, p in params.items()}
        td.gradient(train_mlp.loss_fn, backend, params, td.Constant(model), td.Constant(batch), prep=prep, out=grads)
        for n in params:
            torch.testing.assert_close(params[n].grad, expected[n], atol=1e-6, rtol=1e-5)
        optimizer.step()
    assert prep.num_compilations <= 2  # value_and_gradient's graph and gradient's


def test_last_batch_of_another_size_raises_with_advice():
    model, params, batch = _setup(16)
    prep = td.prepare_gradient(train_mlp.loss_fn, td.AutoFunc(), params, td.Constant(model), td.Constant(batch))
    _, _, small = _setup(10)
    with pytest.raises(td.PreparationMismatchError) as info:
        td.gradient(train_mlp.loss_fn, td.AutoFunc(), params, td.Constant(model), td.Constant(small), prep=prep)
    message = str(info.value)
    assert "context 2: mismatch" in message
    assert "dim 0: 16 -> 10" in message
    assert "drop_last=True" in message and "second Prep" in message
    assert "x: ok" in message and "context 1: ok" in message
    # the documented alternative: a second preparation for the last batch's shape
    prep_last = td.prepare_gradient(train_mlp.loss_fn, td.AutoFunc(), params, td.Constant(model), td.Constant(small))
    td.gradient(train_mlp.loss_fn, td.AutoFunc(), params, td.Constant(model), td.Constant(small), prep=prep_last)


def bn_loss(params, model, batch):
    return torch.func.functional_call(model, params, (batch,)).pow(2).mean()


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")], ids=str)
def test_batchnorm_running_stats_are_refused_not_diverging(backend):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    params = {n: p.detach() for n, p in model.named_parameters()}
    batch = torch.randn(16, 4)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(ValueError, match=r"(?s)wrote in place into context 1.*model.eval\(\).*replace_all_batch_norm_modules_"):
        td.prepare_gradient(bn_loss, backend, params, td.Constant(model), td.Constant(batch))
    for n, b in model.named_buffers():  # what the check's own evaluation wrote is undone
        assert torch.equal(b, stats[n])
    # documented pattern 1: fixed statistics
    model.eval()
    got = td.gradient(bn_loss, backend, params, td.Constant(model), td.Constant(batch))
    want = td.gradient(bn_loss, td.AutoAutograd(), params, td.Constant(model), td.Constant(batch))
    for n in params:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4)


def test_batchnorm_without_tracking_trains_on_batch_statistics():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    torch.func.replace_all_batch_norm_modules_(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    batch = torch.randn(16, 4)
    got = td.gradient(bn_loss, td.AutoFunc(), params, td.Constant(model), td.Constant(batch))
    want = td.gradient(bn_loss, td.AutoAutograd(), params, td.Constant(model), td.Constant(batch))
    for n in params:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4)


def test_writing_into_a_constant_tensor_is_refused():
    def bad(x, c):
        c.add_(1.0)
        return (x * c).sum()

    c = torch.zeros(3)
    with pytest.raises(ValueError, match="wrote in place into context 1"):
        td.prepare_gradient(bad, td.AutoFunc(), torch.ones(3), td.Constant(c))


def test_example_script_runs(capsys):
    assert train_mlp.main(["--steps", "3", "--backend", "func"]) == 0
    out = capsys.readouterr().out
    assert "func" in out and "max |param - eager|" in out
