"""Doctests of ``torchdi`` (``pytest --doctest-modules torchdi``) see ``torch`` and ``torchdi``.

Docstring examples are written as a user would type them after ``import torch, torchdi``; this
namespace provides those two names, so every example runs as written.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchdi


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict[str, Any]) -> None:
    doctest_namespace["torch"] = torch
    doctest_namespace["torchdi"] = torchdi
