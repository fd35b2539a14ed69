"""Shared pytest setup for the core suite (the XLA tests under tests/xla have their own)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# No persisted preparations in the suite: a test that counts compilations or detections must not
# depend on what an earlier run (or the user's own cache) left on disk. Tests of the cache opt in
# with their own temporary TORCHDI_CACHE_DIR.
os.environ["TORCHDI_CACHE_DIR"] = ""

pytest_plugins = ["pytester"]  # tests of torchdi.testing run pytest on generated test modules

# Property tests stay small and fast; no deadline (the first torch.func call warms up lazily).
settings.register_profile(
    "torchdi",
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "torchdi"))


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same RNG state and default dtype, and restores the dtype."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
