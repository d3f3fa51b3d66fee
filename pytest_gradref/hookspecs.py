"""Hooks that other plugins implement to extend pytest-gradref."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gradref.devices.backends import BackendRegistry


@pytest.hookspec
def pytest_gradref_register_backends(registry: BackendRegistry) -> None:
    """Add or replace gradref backend policies.

    Called once per session, at configure time, before any device is chosen. Implement it in a
    plugin or in the rootdir's ``conftest.py`` (conftests below the rootdir load too late).
    The built-in backends (cpu, cuda, npu, xpu, mps) arrive through this same hook, last and
    with ``registry.register_default``, so a plugin that registers one of those names
    overrides the built-in just by being installed.

    :param registry: the session's :class:`~pytest_gradref.BackendRegistry`.

    Example, the built-in npu policy with a looser float32 tolerance::

        from pytest_gradref import Tolerance, builtin_backend

        def pytest_gradref_register_backends(registry):
            npu = builtin_backend("npu")
            registry.register(npu.replace(tolerances={"float32": Tolerance(1e-5, 1e-5)}))
    """
