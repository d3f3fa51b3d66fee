"""Repo-wide test configuration."""

from __future__ import annotations

import os

import pytest

# The suite's processes share the cores: the xdist workers and the ranks, torchrun jobs and
# pytester runs they start. A torch thread that waits for another one spins on its core by
# default (OpenMP's active wait), burning the time another process needs; waiting passively
# changes no result, only whose core it is. Set before any process loads torch (this module
# loads first), and inherited by every process the tests start; a value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Triton runs kernels on CPU tensors only through its interpreter, which it picks when a
    # kernel is defined: choose it before any test imports Triton, on machines without CUDA.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
