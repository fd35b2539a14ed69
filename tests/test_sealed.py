"""Sealed preparations (issue 28): a persisted ``aot_inductor`` preparation loads without dynamo.

A second process finds the seal (every guard dynamo installed, written down), checks each guard
against its own objects and runs the stored AOTInductor programs: dynamo is never imported. A
change a guard covers, made before the load (a monkeypatched torch function, another global
state) or after it (a global, a helper function, a list item, a dict entry, an attribute, a
closure cell), goes through dynamo, which
traces and compiles as always: the result is never stale. Each check is made against eager
``torch.func`` in the same process. The processes share one cold compilation (seconds each).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchdi.engines import _dynamo, _sealed

pytestmark = pytest.mark.inductor

CHILD = r'''
import json, sys
import torch
import torchdi as td

cache, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
SCALE = 2.0
W = torch.linspace(-1, 1, 48).reshape(6, 8)
COEFS = [1.0, 0.5]
CONFIG = {"shift": 0.25}


class Settings:
    power = 2.0


settings = Settings()


def helper(t):
    return torch.tanh(t)


def f(x):
    return SCALE * helper(W @ x) * COEFS[1] + CONFIG["shift"] * (W @ x) ** settings.power


if mode == "body":  # the same name, another body: another key, another program
    def f(x):
        return SCALE * helper(W @ x) * COEFS[1] + CONFIG["shift"] * (W @ x) ** settings.power + x[:6]


def make(k):
    def g(x):
        return k * torch.sin(x)

    def set_k(value):
        nonlocal k
        k = value

    return g, set_k


g, set_k = make(1.5)


def h(x, c):  # a float context: a symbolic-shape guard, which a seal does not cover
    return c * torch.cos(x)


if mode == "wrapped":  # a user's wrapper in place of torch.tanh (the same graph), torch.cos for torch.sin
    original = torch.tanh
    torch.tanh = lambda t: original(t)
    torch.sin = torch.cos
if mode == "deterministic":
    torch.use_deterministic_algorithms(True)
backend = td.AutoCompile(compiler="aot_inductor", cache_dir=cache)
x = torch.linspace(0.1, 0.9, 8)
out = {}
preps = {"f": td.prepare_jacobian(f, backend, x), "g": td.prepare_jacobian(g, backend, x)}
if mode == "first":
    preps["h"] = td.prepare_jacobian(h, backend, x, td.Constant(0.5))
results = {name: td.jacobian(fn, backend, x, prep=preps[name]) for name, fn in (("f", f), ("g", g))}
out["dynamo"] = "torch._dynamo" in sys.modules
out["loaded"] = [preps["f"].loaded_from_cache, preps["g"].loaded_from_cache]
out["values"] = {name: value.tolist() for name, value in results.items()}
out["right"] = [bool(torch.allclose(results[name], torch.func.jacrev(fn)(x), atol=1e-6)) for name, fn in (("f", f), ("g", g))]
out["compilations"] = [preps["f"].num_compilations, preps["g"].num_compilations]
y = torch.linspace(-1, 1, 8)
out["new_x_right"] = bool(torch.allclose(td.jacobian(f, backend, y, prep=preps["f"]), torch.func.jacrev(f)(y), atol=1e-6))


def right(name, fn):
    value = td.jacobian(fn, backend, x, prep=preps[name])
    return [bool(torch.allclose(value, torch.func.jacrev(fn)(x), atol=1e-6)), preps[name].num_compilations]


if mode == "changes":  # after a sealed load, in this process
    changes = {}
    SCALE = 3.0
    changes["global"] = right("f", f)
    W = torch.linspace(1, 2, 48).reshape(6, 8)  # another tensor of the same layout: an input, no compilation
    changes["tensor"] = right("f", f)

    def helper(t):
        return torch.sigmoid(t)

    changes["helper"] = right("f", f)
    COEFS[1] = 4.0  # an item of a global list, a dict entry, an object's attribute: each guarded
    changes["list"] = right("f", f)
    CONFIG["shift"] = -1.0
    changes["dict"] = right("f", f)
    settings.power = 3.0
    changes["attribute"] = right("f", f)
    set_k(-2.0)
    changes["cell"] = right("g", g)
    out["changes"] = changes
if mode == "warm":  # a dropped preparation frees its seal and programs (rule 9)
    import gc
    import weakref

    seal = preps["f"].runner._sealed
    if seal is not None:
        sealed = weakref.ref(seal)
        del preps, results, seal
        gc.collect()
        out["freed"] = sealed() is None
print(json.dumps(out))
'''


def test_a_sealed_preparation_loads_without_dynamo_and_never_serves_a_stale_result(tmp_path):
    script = tmp_path / "sealed_child.py"
    script.write_text(CHILD)
    cache = tmp_path / "cache"

    def run(mode):
        done = subprocess.run([sys.executable, str(script), str(cache), mode], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("first")
    assert first["dynamo"] and first["loaded"] == [False, False] and first["right"] == [True, True] and first["new_x_right"]
    seals = sorted(cache.glob("sealed-*"))
    assert len(seals) == 2  # f's and g's; h's float context is not sealed

    warm = run("warm")
    assert not warm["dynamo"], "a sealed preparation imported dynamo"
    assert warm["loaded"] == [True, True] and warm["right"] == [True, True] and warm["new_x_right"]
    assert warm["values"] == first["values"]  # the same programs: the same bits
    assert warm["compilations"] == first["compilations"] == [1, 1]
    assert warm["freed"]

    # Changes a guard covers, before the load: dynamo traces (its programs load from the cache).
    for mode in ("wrapped", "deterministic", "body"):
        changed = run(mode)
        assert changed["dynamo"] and changed["right"] == [True, True] and changed["new_x_right"], mode

    # After a sealed load: each change is seen; the global, helper and cell compile (counted).
    changes = run("changes")["changes"]
    assert changes["global"] == [True, 2]
    assert changes["tensor"] == [True, 2]
    assert changes["helper"] == [True, 3]
    assert changes["list"] == [True, 4] and changes["dict"] == [True, 5] and changes["attribute"] == [True, 6]
    assert changes["cell"] == [True, 2]

    # A corrupt seal is ignored: dynamo prepares, right as always.
    for seal in seals:
        seal.write_bytes(seal.read_bytes()[:80])
    corrupt = run("warm")
    assert corrupt["dynamo"] and corrupt["right"] == [True, True]


def test_sources_parse_into_steps_and_refuse_what_a_seal_cannot_evaluate():
    steps = _sealed._parse("G['runner'].__closure__[0].cell_contents", ("x",))
    assert steps == (("G", "runner"), ("attr", "__closure__"), ("item", 0), ("attr", "cell_contents"))
    assert _sealed._parse("type(x)", ("x",)) == (("L", "x"), ("type", None))
    assert _sealed._parse("list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[0]", ())[-1] == ("key_at", 0)
    for name in ("x + 1", "G[f()]", "getattr(x, 'a')", "L[x]"):
        with pytest.raises(_sealed.Unsealable):
            _sealed._parse(name, ("x",))


def user_function(t):
    return t + 1


def test_objects_are_described_by_name_where_torch_pins_them_else_by_fingerprint():
    assert _sealed.describe_object(torch.tanh) != _sealed.describe_object(torch.sigmoid)
    assert _sealed.describe_object(torch.tanh) == _sealed.describe_object(torch.tanh)
    assert _sealed.describe_object(torch.func) == {"module": "torch.func"}
    described = _sealed.describe_object(user_function)
    assert described["named"] == [__name__, "user_function"] and "fingerprint" in described

    def closure(t):
        return t * 2

    first = _sealed.describe_object(closure)

    def closure(t):
        return t * 3

    assert _sealed.describe_object(closure) != first


def test_the_global_state_check_sees_grad_mode_and_transforms():
    recorded = _dynamo.global_state(_sealed.Unsealable)
    holds = _dynamo.global_state_check(recorded)
    assert holds()
    with torch.no_grad():
        assert not holds()
    assert torch.func.vmap(lambda t: torch.tensor(holds()) + 0 * t)(torch.ones(2)).tolist() == [0.0, 0.0]
    torch.use_deterministic_algorithms(True)
    try:
        assert not holds()
    finally:
        torch.use_deterministic_algorithms(False)
    assert holds()


def test_without_the_internals_nothing_is_sealed(monkeypatch):
    monkeypatch.setattr(_dynamo, "_GLOBAL_STATE_GUARD", None)
    monkeypatch.setattr(_dynamo.fence, "warned", set())
    with pytest.raises(_sealed.Unsealable):
        _dynamo.global_state(_sealed.Unsealable)
    with pytest.raises(ValueError):
        _dynamo.global_state_check({})
