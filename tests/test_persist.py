"""Persisted preparations (issue 28): torchdi.cache's storage, the keys (torchdi.fingerprint),
AutoSparse's persisted pattern and colouring, AutoCompile's persisted artifacts, the CLI.

The suite runs with the cache off (tests/conftest.py sets TORCHDI_CACHE_DIR=""); each test here
turns it on with its own temporary directory.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import torchdi
from torchdi.__main__ import main as cli
from torchdi.cache import MAGIC, Store, cache_directory, store_for
from torchdi.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("TORCHDI_CACHE_DIR", str(directory))
    return directory


# --------------------------------------------------------------------------------------------
# Storage


def test_directory_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHDI_CACHE_DIR", "")
    assert cache_directory() is None and store_for() is None
    monkeypatch.setenv("TORCHDI_CACHE_DIR", str(tmp_path))
    assert cache_directory() == tmp_path
    assert cache_directory("") is None  # an explicit "" wins over the environment
    monkeypatch.delenv("TORCHDI_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "torchdi"


def test_roundtrip_and_rejections(tmp_path, caplog):
    store = Store(tmp_path)
    assert store.get("k", "a") is None
    assert store.put("k", "a", b"payload-a")
    assert store.get("k", "a") == b"payload-a"
    path = store.path("k", "a")
    good = path.read_bytes()
    caplog.set_level(logging.DEBUG, logger="torchdi")
    # corrupt: one payload byte flipped
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert store.get("k", "a") is None and "checksum" in caplog.text
    # truncated
    path.write_bytes(good[:-3])
    assert store.get("k", "a") is None and "truncated" in caplog.text
    # foreign: written by another torch
    end = good.index(b"\n", len(MAGIC))
    header = json.loads(good[len(MAGIC):end])
    header["torch"] = "1.0.0"
    path.write_bytes(MAGIC + json.dumps(header).encode() + good[end:])
    assert store.get("k", "a") is None and "torch='1.0.0'" in caplog.text
    # another key whose file name collides (the full key is in the header)
    header = json.loads(good[len(MAGIC):end])
    header["key"] = "b"
    path.write_bytes(MAGIC + json.dumps(header).encode() + good[end:])
    assert store.get("k", "a") is None
    # not an entry at all, and a header that is not JSON
    path.write_bytes(b"\x00garbage")
    assert store.get("k", "a") is None
    path.write_bytes(MAGIC + b"{not json\n" + b"x")
    assert store.get("k", "a") is None
    # a valid rewrite is served again
    assert store.put("k", "a", b"payload-a") and store.get("k", "a") == b"payload-a"


def test_unwritable_directory_is_not_an_error(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="torchdi")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    store = Store(blocker / "cache")
    assert store.put("k", "a", b"x") is False and store.get("k", "a") is None
    assert "cannot write" in caplog.text
    # read-only (as root a chmod does not stop writes: make the write itself fail) and full disk
    store = Store(tmp_path / "ro")

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    assert store.put("k", "a", b"x") is False
    monkeypatch.undo()
    assert not [p for p in (tmp_path / "ro").iterdir() if p.suffix == ".tmp"]  # no temporary left behind


def test_least_recently_used_eviction(tmp_path):
    store = Store(tmp_path, max_bytes=10**9)
    for i, name in enumerate("abc"):
        store.put("k", name, bytes(1000))
        os.utime(store.path("k", name), (1000 + i, 1000 + i))  # written in the order a, b, c
    assert store.get("k", "a") is not None  # a read is a use: a is now the most recent
    entry = store.path("k", "a").stat().st_size
    store.max_bytes = 3 * entry
    store.put("k", "d", bytes(1000))  # one must go: b, the least recently used
    assert store.get("k", "b") is None
    assert all(store.get("k", name) is not None for name in "acd")
    info = store.info()
    assert info.entries == 3 and info.bytes == 3 * entry and info.by_kind == {"k": 3}


def _writer(directory: str, payload_size: int, rounds: int) -> None:
    store = Store(directory)
    for _ in range(rounds):
        store.put("k", "same", bytes([payload_size % 251]) * payload_size)


def test_concurrent_writers(tmp_path):
    """Two processes write the same entry over and over while this one reads it: every read is
    one writer's whole payload or nothing, never a mix or a torn file."""
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_writer, args=(str(tmp_path), size, 200)) for size in (30_000, 70_001)]
    for writer in writers:
        writer.start()
    store = Store(tmp_path)
    seen = set()
    while any(w.is_alive() for w in writers):
        payload = store.get("k", "same")
        if payload is not None:
            seen.add(len(payload))
            assert payload in (bytes([30_000 % 251]) * 30_000, bytes([70_001 % 251]) * 70_001)
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert store.get("k", "same") is not None
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_info_and_clear(cache_dir, capsys, monkeypatch):
    Store(cache_dir).put("sparsity", "a", b"12345")
    assert cli(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out and "entries:   1 (sparsity: 1)" in out
    assert cli(["cache", "clear"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert Store(cache_dir).info().entries == 0
    monkeypatch.setenv("TORCHDI_CACHE_DIR", "")
    assert cli(["cache", "info"]) == 0 and "off" in capsys.readouterr().out


def test_fenced_internals_have_fallbacks(monkeypatch, caplog):
    """Without torch's artifact scope or cache counters (a torch that moved them) persistence
    still works: a scope that keeps the process's artifacts, and no hit counts (one warning each)."""
    from torchdi.engines import _dynamo

    assert _dynamo.compile_cache_counts() is not None  # this torch has both
    with _dynamo.artifact_scope():
        pass
    monkeypatch.setattr(_dynamo.fence, "warned", set())
    monkeypatch.setattr(_dynamo, "_FRESH_ARTIFACTS", None)
    monkeypatch.setattr(_dynamo, "_COUNTERS", None)
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        with _dynamo.artifact_scope():
            pass
        assert _dynamo.compile_cache_counts() is None
    messages = [r.getMessage() for r in caplog.records if r.name == "torchdi"]
    assert any("(artifact_scope:" in m for m in messages) and any("(compile_cache_counts:" in m for m in messages)


def test_cache_dir_argument():
    with pytest.raises(TypeError, match="cache_dir"):
        torchdi.AutoCompile(cache_dir=3)
    # the cache directory is no part of the program: equal hashes, preparations match
    assert hash(torchdi.AutoCompile(cache_dir="/tmp/a")) == hash(torchdi.AutoCompile())


# --------------------------------------------------------------------------------------------
# Keys


SCALE = 2.0
MASK = torch.tensor([1.0, 0.0, 1.0])


def _helper(x):
    return x * SCALE


def _uses_all(x):
    return _helper(x) * MASK


def test_fingerprint_follows_what_f_reads(monkeypatch):
    global SCALE, _helper
    base = fingerprint(_uses_all)
    assert base is not None and base == fingerprint(_uses_all)
    monkeypatch.setitem(globals(), "SCALE", 3.0)  # a global of a helper
    assert fingerprint(_uses_all) != base
    monkeypatch.undo()
    assert fingerprint(_uses_all) == base
    MASK[1] = 1.0  # a global tensor's values (they may decide a pattern)
    try:
        assert fingerprint(_uses_all) != base
    finally:
        MASK[1] = 0.0
    monkeypatch.setitem(globals(), "_helper", lambda x: x * SCALE)  # the helper function itself
    assert fingerprint(_uses_all) != base

    def closure(c):
        return lambda x: x * c

    assert fingerprint(closure(1.0)) != fingerprint(closure(2.0))  # a closure cell
    assert fingerprint(closure(torch.zeros(2))) != fingerprint(closure(torch.ones(2)))
    assert fingerprint(lambda x: x + 1) != fingerprint(lambda x: x + 2)  # the body
    # what cannot be keyed soundly is not keyed
    generator = (i for i in range(3))
    assert fingerprint(lambda x: x * next(generator)) is None
    # a context's tensors by layout only (the tracer never reads their values)
    a, b = torch.zeros(3), torch.ones(3)
    assert fingerprint((a,), meta_only=(a,)) == fingerprint((b,), meta_only=(b,))
    assert fingerprint((a,)) != fingerprint((b,))


# --------------------------------------------------------------------------------------------
# AutoSparse


WEIGHTS = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0])


def _sparse_f(x):
    return torch.diff(x) * WEIGHTS[:-1] + x[1:] ** 2


def test_sparse_persistence_in_process(cache_dir, monkeypatch):
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    x = torch.linspace(0.5, 1.5, 5)
    reference = torch.func.jacrev(_sparse_f)(x)
    cold = torchdi.prepare_jacobian(_sparse_f, backend, x)
    warm = torchdi.prepare_jacobian(_sparse_f, backend, x)
    assert not cold.loaded_from_cache and warm.loaded_from_cache
    assert torch.equal(cold.sparsity_pattern.to_dense(), warm.sparsity_pattern.to_dense())
    assert torch.equal(cold.colors, warm.colors) and cold.ncolors == warm.ncolors
    assert torch.equal(torchdi.jacobian(_sparse_f, backend, x, prep=warm).to_dense(), reference)
    assert Store(cache_dir).info().by_kind == {"coloring": 1, "sparsity": 1}

    # A global tensor whose values change the structure: a new key, detected again, right.
    monkeypatch.setitem(globals(), "WEIGHTS", torch.tensor([1.0, 2.0, 2.0, 2.0, 3.0]))
    changed = torchdi.prepare_jacobian(_sparse_f, backend, x)
    assert not changed.loaded_from_cache
    assert torch.equal(torchdi.jacobian(_sparse_f, backend, x, prep=changed).to_dense(), torch.func.jacrev(_sparse_f)(x))


def test_sparse_over_a_persisting_compiled_backend(tmp_path):
    """AutoSparse(AutoCompile(cache_dir=...)): the pattern and colouring load from that directory;
    aot_eager keeps no compiled artifacts, so the fused program compiles again, and the prep
    says it was not all loaded."""
    backend = torchdi.AutoSparse(torchdi.AutoCompile(compiler="aot_eager", cache_dir=str(tmp_path)))
    x = torch.linspace(0.5, 1.5, 5)
    cold = torchdi.prepare_jacobian(_sparse_f, backend, x)
    warm = torchdi.prepare_jacobian(_sparse_f, backend, x)
    assert not cold.loaded_from_cache and not warm.loaded_from_cache
    assert cold.num_compilations == warm.num_compilations == 1
    assert Store(tmp_path).info().by_kind == {"coloring": 1, "sparsity": 1}
    assert torch.equal(torchdi.jacobian(_sparse_f, backend, x, prep=warm).to_dense(), torch.func.jacrev(_sparse_f)(x))


def test_tampered_pattern_is_caught_by_the_derivative_check(cache_dir):
    """A persisted pattern that misses non-zeros (here: written on purpose under f's key) fails
    the same check as a freshly traced one and is traced again: never a missing entry."""
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    x = torch.linspace(0.5, 1.5, 5)
    torchdi.prepare_jacobian(_sparse_f, backend, x)
    store = Store(cache_dir)
    (entry,) = cache_dir.glob("sparsity-*.entry")
    data = entry.read_bytes()
    end = data.index(b"\n", len(MAGIC))
    key = json.loads(data[len(MAGIC):end])["key"]
    buffer = io.BytesIO()  # the diagonal only: the diff's other band is missing
    meta = np.frombuffer(json.dumps({"ncols": 5, "fallbacks": []}).encode(), dtype=np.uint8)
    np.savez(buffer, indptr=np.arange(5, dtype=np.int64), indices=np.arange(4, dtype=np.int64), __meta__=meta)
    assert store.put("sparsity", key, buffer.getvalue())
    prep = torchdi.prepare_jacobian(_sparse_f, backend, x)
    assert not prep.loaded_from_cache
    assert torch.equal(torchdi.jacobian(_sparse_f, backend, x, prep=prep).to_dense(), torch.func.jacrev(_sparse_f)(x))


SCRIPT = """
import json, sys, torch, torchdi
mode = sys.argv[1]
C = float(sys.argv[2])
def helper(x):
    return x ** 2 * C
def f(x):
    return torch.diff(helper(x))
x = torch.linspace(0.5, 1.5, 6)
out = {}
if mode == "sparse":
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    prep = torchdi.prepare_jacobian(f, backend, x)
    out["loaded"] = prep.loaded_from_cache
    out["value"] = torchdi.jacobian(f, backend, x, prep=prep).to_dense().tolist()
    C = float(sys.argv[3])  # a global changed after a load: prepared again, detected again
    again = torchdi.prepare_jacobian(f, backend, x)
    out["changed_loaded"] = again.loaded_from_cache
    out["changed_value"] = torchdi.jacobian(f, backend, x, prep=again).to_dense().tolist()
else:
    backend = torchdi.AutoCompile(cache_dir=sys.argv[4])
    g = lambda x: f(x).sum()
    prep = torchdi.prepare_gradient(g, backend, x)
    out["loaded"] = prep.loaded_from_cache
    out["compilations"] = prep.num_compilations
    out["value"] = torchdi.gradient(g, backend, x, prep=prep).tolist()
    C = 3.0  # the loaded program's guards are dynamo's own: this call recompiles
    out["changed_value"] = torchdi.gradient(g, backend, x, prep=prep).tolist()
    out["changed_compilations"] = prep.num_compilations
print(json.dumps(out))
"""


def _run(tmp_path, *args, env=None):
    script = tmp_path / "persisted.py"
    script.write_text(textwrap.dedent(SCRIPT))
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run([sys.executable, str(script), *args], env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _jacobian(c):
    x = torch.linspace(0.5, 1.5, 6)
    return torch.func.jacrev(lambda x: torch.diff(x**2 * c))(x).tolist()


def test_sparse_persistence_across_processes(tmp_path):
    env = {"TORCHDI_CACHE_DIR": str(tmp_path / "cache")}
    first = _run(tmp_path, "sparse", "2.0", "3.0", env=env)
    second = _run(tmp_path, "sparse", "2.0", "4.0", env=env)
    assert first["loaded"] is False and second["loaded"] is True
    assert first["value"] == second["value"] == _jacobian(2.0)
    assert first["changed_loaded"] is False and second["changed_loaded"] is False  # C=4: never prepared before
    assert first["changed_value"] == _jacobian(3.0) and second["changed_value"] == _jacobian(4.0)


@pytest.mark.slow
@pytest.mark.inductor
def test_compiled_persistence_across_processes(tmp_path):
    """The second process loads the first one's artifacts (its compilation hits torch's caches),
    returns the same values, and a changed global still recompiles (dynamo's guards); a third
    process whose global differs from the start does not load them."""
    cache = str(tmp_path / "cache")
    first = _run(tmp_path, "compile", "2.0", "3.0", cache, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor1")})
    second = _run(tmp_path, "compile", "2.0", "3.0", cache, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor2")})
    assert first["loaded"] is False and second["loaded"] is True
    assert first["compilations"] == second["compilations"] == 1
    assert first["value"] == second["value"]
    expected = torch.func.grad(lambda x: torch.diff(x**2 * 3.0).sum())(torch.linspace(0.5, 1.5, 6))
    assert torch.allclose(torch.tensor(second["changed_value"]), expected)
    assert second["changed_compilations"] == 2
    # A global that changed before the load (C=4 from the start): another program, never the
    # persisted one's value.
    third = _run(tmp_path, "compile", "4.0", "3.0", cache, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor2")})
    assert third["loaded"] is False and third["compilations"] == 1
    expected = torch.func.grad(lambda x: torch.diff(x**2 * 4.0).sum())(torch.linspace(0.5, 1.5, 6))
    assert torch.allclose(torch.tensor(third["value"]), expected)


PRECOMPILE_C = 2.0


def _precompile_helper(x):
    return x**2 * PRECOMPILE_C


def _precompile_f(x):
    return _precompile_helper(x).sum()


def test_dynamo_caching_precompile_is_kept_off(monkeypatch):
    """A user's TORCH_CACHING_PRECOMPILE=1 (dynamo's caching precompile) drops dynamo's function and
    closure guards from every compilation: torchdi's compilations run without it, so a helper
    function rebound after preparation recompiles (rule 7) instead of returning the old value."""
    config = torch._dynamo.config
    if not hasattr(config, "caching_precompile"):
        pytest.skip("this torch has no caching precompile")
    before = config.caching_precompile
    # config.patch, not monkeypatch.setattr: monkeypatch's undo deletes a ConfigModule entry.
    with config.patch(caching_precompile=True):
        backend = torchdi.AutoCompile(compiler="aot_eager")
        x = torch.linspace(0.5, 1.5, 6)
        prep = torchdi.prepare_gradient(_precompile_f, backend, x)
        assert torchdi.value_and_gradient(_precompile_f, backend, x, prep=prep)[0].item() == pytest.approx((x**2 * 2).sum().item())
        monkeypatch.setitem(globals(), "_precompile_helper", lambda x: x**3 * PRECOMPILE_C)
        value, grad = torchdi.value_and_gradient(_precompile_f, backend, x, prep=prep)
        assert value.item() == pytest.approx((x**3 * 2).sum().item())  # the old program gave (x**2 * 2).sum()
        assert torch.allclose(grad, 6 * x**2)
        assert prep.num_compilations == 2
        assert config.caching_precompile is True  # the user's setting is left as it was
    assert config.caching_precompile is before
