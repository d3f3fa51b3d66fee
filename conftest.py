"""Repo-wide test configuration."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Triton runs kernels on CPU tensors only through its interpreter, which it picks when a
    # kernel is defined: choose it before any test imports Triton, on machines without CUDA.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
