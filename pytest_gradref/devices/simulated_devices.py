"""The simulated npu's devices and what other code sees of them: how many there are and which
is current, the ``torch.npu`` device module and the ``torch_npu`` stand-in.

One of the simulated npu's three modules (simulated.py installs it, simulated_tensor.py holds
its tensor); the process-wide state they share lives here, and their underscored names are
theirs alone.
"""

from __future__ import annotations

import collections
import importlib.machinery
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from pytest_gradref.devices import ascend_numerics

DEVICE_TYPE = "npu"
DEFAULT_DEVICE_COUNT = 2
DEVICE_NAME = "simulated NPU on CPU (pytest-gradref)"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

# Set by install(): the number of devices.
_installed: dict[str, int] = {}
_current = [0]
# --gradref-simulate-numerics=ascend: the operators' CPU arguments go through
# ascend_numerics.apply (HF32 where torch_npu documents it) before the CPU kernel runs.
_ascend = [False]
# Tensors created per device index, views included: enough to tell whether a test used the
# device (the plugin's device coverage), not how much memory it took.
_created: collections.Counter[int] = collections.Counter()


class SimulatedDeviceError(RuntimeError):
    """An operator mixed devices, as real hardware would refuse to."""


def _physical_count() -> int:
    return _installed.get("count", 0)


def device_count() -> int:
    """The simulated devices, restricted by ASCEND_RT_VISIBLE_DEVICES (ids of simulated ones)."""
    total = _physical_count()
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if visible is None:
        return total
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    count = 0
    for part in ids:  # stops at the first id that names no device, as CUDA_VISIBLE_DEVICES does
        if not part.isdigit() or int(part) >= total:
            break
        count += 1
    return count


def _index(device: Any = None) -> int:
    if device is None:
        return _current[0]
    if isinstance(device, int):
        index = device
    else:
        parsed = torch.device(device)
        if parsed.type != DEVICE_TYPE:
            raise ValueError(f"expected an {DEVICE_TYPE} device, got {parsed}")
        index = parsed.index if parsed.index is not None else _current[0]
    if not 0 <= index < device_count():
        raise RuntimeError(
            f"invalid simulated {DEVICE_TYPE} device index {index}: {device_count()} visible"
        )
    return index


def _torch_device(device: Any) -> torch.device:
    return torch.device(DEVICE_TYPE, _index(device))


def device_module() -> types.ModuleType:
    """The ``torch.npu`` module of the simulated devices."""
    module = types.ModuleType("torch.npu", "The simulated npu device module (pytest-gradref).")
    module.__spec__ = importlib.machinery.ModuleSpec("torch.npu", None)

    def is_available() -> bool:
        return device_count() > 0

    def current_device() -> int:
        return _current[0]

    def set_device(device: Any) -> None:
        _current[0] = _index(device)

    def manual_seed(seed: int) -> None:
        # Operators run on the CPU, so they draw from the CPU generator.
        torch.default_generator.manual_seed(int(seed))

    def synchronize(device: Any = None) -> None:
        _index(device)  # checks the device, like the real call; there is nothing to wait for

    def get_device_name(device: Any = None) -> str:
        return f"{DEVICE_NAME} {_index(device)}"

    def zero(device: Any = None) -> int:
        _index(device)
        return 0

    def nothing(device: Any = None) -> None:
        _index(device)

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        return {"allocation": {"all": {"allocated": _created[_index(device)]}}}

    def is_initialized() -> bool:
        return True

    module.__dict__.update(
        is_available=is_available,
        device_count=device_count,
        current_device=current_device,
        set_device=set_device,
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        seed=lambda: None,
        seed_all=lambda: None,
        initial_seed=torch.initial_seed,
        synchronize=synchronize,
        get_device_name=get_device_name,
        memory_allocated=zero,
        max_memory_allocated=zero,
        memory_reserved=zero,
        max_memory_reserved=zero,
        reset_peak_memory_stats=nothing,
        memory_stats_as_nested_dict=memory_stats_as_nested_dict,
        empty_cache=lambda: None,
        is_initialized=is_initialized,
        _is_in_bad_fork=lambda: False,
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
        get_rng_state=lambda device="npu": torch.get_rng_state(),
        set_rng_state=lambda state, device="npu": torch.set_rng_state(state),
        # torch_npu's HF32 switches, with their documented defaults; they change results
        # only under --gradref-simulate-numerics=ascend (ascend_numerics.py).
        matmul=ascend_numerics.MATMUL,
        conv=ascend_numerics.CONV,
        simulated=True,
    )
    return module


def _kernel_stub(name: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise SimulatedDeviceError(
            f"torch_npu.{name} is not simulated: the simulated npu (--gradref-simulate=npu) "
            "runs torch's own CPU operators and has none of torch_npu's kernels. Take the "
            "portable path where torch_npu.simulated is True, mark the test "
            "@pytest.mark.gradref_skip('npu', reason=...), or run it on a real NPU."
        )

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = "torch_npu"
    return stub


def stand_in(npu: types.ModuleType) -> types.ModuleType:
    """The module ``import torch_npu`` returns: ``npu`` and stubs of torch_npu's kernels."""
    module = types.ModuleType(
        "torch_npu", "A stand-in for torch_npu: the simulated npu of pytest-gradref."
    )

    def kernel(name: str) -> Callable[..., Any]:
        # The rule other libraries see: the npu is there (torch_npu imports, torch.npu is
        # available), and torch_npu's own kernels (npu_*) import, as transformers' npu
        # attention module imports npu_fusion_attention, but raise SimulatedDeviceError when
        # called. Other missing names stay an AttributeError.
        if not name.startswith("npu_"):
            raise AttributeError(f"module 'torch_npu' (simulated) has no attribute {name!r}")
        stub = module.__dict__[name] = _kernel_stub(name)
        return stub

    module.__dict__.update(
        npu=npu,
        __version__=f"{torch.__version__}+simulated",
        simulated=True,
        __getattr__=kernel,
    )
    # importlib.util.find_spec("torch_npu"), as the npu probe calls it, reads the spec.
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    return module
