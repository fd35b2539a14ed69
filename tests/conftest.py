"""Shared pytest setup for the core suite (the XLA tests under tests/xla have their own)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
