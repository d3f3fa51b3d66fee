"""A simulated npu device on the CPU: a testing aid for CI machines without Ascend hardware.

``install()`` (what ``--gradref-simulate=npu`` calls, before any backend probe) makes this
process look like one with torch_npu and N NPUs:

- PyTorch's PrivateUse1 backend is renamed ``npu``, so ``torch.device("npu:1")``,
  ``tensor.npu()``, ``tensor.is_npu`` and ``module.npu()`` exist;
- ``torch.npu`` is a device module (is_available, device_count honouring
  ASCEND_RT_VISIBLE_DEVICES, current_device, set_device, manual_seed(_all), synchronize,
  get_device_name, memory statistics that are always zero but for the count of tensors
  created on each device, which ``memory_stats_as_nested_dict`` reports as
  ``["allocation"]["all"]["allocated"]``, where CUDA and torch_npu count allocations);
- ``import torch_npu`` returns a stand-in module, so the plugin's npu probe runs unchanged.

A tensor on a simulated npu is a wrapper around a CPU tensor (``SimulatedNpuTensor``); every
operator runs on the CPU tensors inside. It behaves as a separate device: ``.cpu()`` and
``.to("npu")`` copy, and an operator that mixes npu tensors with CPU tensors (0-dim CPU
scalars aside) or with another npu index raises, as on real hardware. So a test that forgot to
move a tensor fails here as it would on an NPU. Where CUDA takes CPU tensors, so does the
simulation: the indices of advanced indexing (``x[cpu_index]``, ``index_put_``).

Other libraries see an npu: ``torch_npu`` imports and ``torch.npu.is_available()`` is True (so
transformers' ``is_torch_npu_available()``). torch_npu's own kernels (any ``torch_npu.npu_*``)
import but raise ``SimulatedDeviceError`` when called, naming the way out.

Dynamo cannot trace the simulated tensors: a compiled frame that meets one runs eagerly (with
``fullgraph=True`` it raises), and the header says so.

Backward runs on the calling thread: the simulation turns off the autograd engine's device
threads for the thread that installs it (the one pytest runs tests in), so
``torch.autograd.is_multithreading_enabled()`` is False there. PyTorch's Python-registered
device guard reports a single PrivateUse1 device (``PythonDeviceGuard::deviceCount`` in
``torch/csrc/acc/Module.cpp`` returns 1, and Python can override only ``type_``), so the engine
has one device queue, and a backward through ``npu:1`` that took the device queues would fail
with an internal assert of the engine (``Engine::ready_queue``). Run in the calling thread it
needs no queue. A backward started from another thread (one the test starts itself) still
takes the device queues, and on ``npu:1`` or above meets that assert.

What it does not prove: Ascend numerics (every operator is torch's CPU kernel), torch_npu's
own operators (``torch_npu.npu_*``, stubs here) and compiled code. The simulation is
process-global and cannot be undone; it refuses to install where a real torch_npu imports,
with or without a device (only a torch_npu that fails to import, which the npu probe reports
as unavailable, leaves it free). It needs torch 2.10
or later (``REQUIRED_TORCH``); on an older torch the option is a usage error.
"""

from __future__ import annotations

import collections
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

DEVICE_TYPE = "npu"
DEFAULT_DEVICE_COUNT = 2
DEVICE_NAME = "simulated NPU on CPU (pytest-gradref)"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

_installed: dict[str, int] = {}
_current = [0]
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


# --- the tensor ----------------------------------------------------------------------------


# Dynamo cannot trace the simulation's Python (it stops at _make_wrapper_subclass), and a frame
# it fails to trace is retried per new set of arguments until the recompile limit: every entry
# point from the dispatcher runs with Dynamo off, so compiled code around simulated tensors
# takes graph breaks once and runs these eagerly. torch._disable_dynamo imports Dynamo only
# when a decorated function first runs (the public torch.compiler.disable imports it here).
_not_traced = torch._disable_dynamo  # type: ignore[attr-defined]


class SimulatedNpuTensor(torch.Tensor):
    """A tensor on a simulated npu: its data is the CPU tensor ``cpu_data``."""

    cpu_data: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device) -> SimulatedNpuTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=device,
            requires_grad=False,
            # Sizes and strides are read from the CPU tensor, so an out= operator that resizes
            # it (torch.eye, for one) resizes the npu tensor too.
            dispatch_sizes_strides_policy="sizes",
        )
        wrapper.cpu_data = inner
        _created[device.index or 0] += 1
        return wrapper

    def tolist(self) -> Any:
        # A host read, as on a real device (torch refuses tolist on tensor subclasses).
        return self.cpu_data.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{self.cpu_data!r} (on simulated {self.device})".replace(
            "tensor(", "npu_tensor(", 1
        )

    @classmethod
    @_not_traced
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        return _dispatch(func, args, kwargs)


def _is_cpu_scalar(value: torch.Tensor) -> bool:
    return value.device.type == "cpu" and value.dim() == 0


def _index_ops() -> frozenset[Any]:
    """The operators whose index tensors (argument 1) CUDA accepts on the CPU: advanced
    indexing moves them to the indexed tensor's device (``AdvancedIndex`` in ATen's
    TensorAdvancedIndexing.cpp), for reads (``x[i]``, ``x[mask]``) and writes (``x[i] = v``,
    ``index_put_``). Others that take an index (index_select, gather, scatter, masked_fill)
    check devices on CUDA and refuse a CPU index, so they refuse here too."""
    aten = torch.ops.aten
    return frozenset(
        {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
        | {aten._index_put_impl_.default}
    )


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    aten = torch.ops.aten
    if func in (aten._to_copy.default, aten.to.dtype_layout):
        return _to_copy(func, args, kwargs)
    devices: set[torch.device] = set()
    cpu_operands: list[torch.Tensor] = []

    def look(value: Any) -> Any:
        if isinstance(value, SimulatedNpuTensor):
            devices.add(value.device)
        elif isinstance(value, torch.Tensor) and not _is_cpu_scalar(value):
            cpu_operands.append(value)
        return value

    if func in _INDEX_OPS:
        # The indices (argument 1) may stay on the CPU, as on CUDA; npu ones must match.
        tree_map(look, (args[0], args[2:], kwargs))
        for index in args[1]:
            if isinstance(index, SimulatedNpuTensor):
                look(index)
    else:
        tree_map(look, (args, kwargs))
    copying = func in (aten.copy_.default, aten._copy_from.default)
    if len(devices) > 1 or (cpu_operands and not copying):
        where = sorted({str(d) for d in devices} | {str(t.device) for t in cpu_operands})
        raise SimulatedDeviceError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{' and '.join(where)}! (in {func}; simulated npu: move every tensor with "
            f".to(device))"
        )
    device = next(iter(devices)) if devices else torch.device(DEVICE_TYPE, _current[0])
    wrappers: dict[int, SimulatedNpuTensor] = {}

    def unwrap(value: Any) -> Any:
        if isinstance(value, SimulatedNpuTensor):
            wrappers[id(value.cpu_data)] = value
            return value.cpu_data
        if isinstance(value, torch.device) and value.type == DEVICE_TYPE:
            return torch.device("cpu")
        return value

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if copying:
        return args[0]

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, SimulatedNpuTensor):
            same = wrappers.get(id(value))
            if same is not None:  # an in-place or out= operator returns its operand
                return same
            return SimulatedNpuTensor(value, device)
        return value

    return tree_map(wrap, out)


_INDEX_OPS = _index_ops()


def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    source = args[0]
    target = kwargs.pop("device", None)
    target = torch.device(target) if target is not None else source.device
    inner = source.cpu_data if isinstance(source, SimulatedNpuTensor) else source
    if target.type != DEVICE_TYPE:  # to the CPU, or to another device such as meta
        return func(inner, *args[1:], device=target, **kwargs)
    copied = func(inner, *args[1:], **kwargs)
    return SimulatedNpuTensor(copied, _torch_device(target))


# --- factories: the PrivateUse1 kernels that create tensors --------------------------------


@_not_traced
def _empty(
    size: Any,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    memory_format: Any = None,
) -> torch.Tensor:
    inner = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format)
    return SimulatedNpuTensor(inner, _torch_device(device))


@_not_traced
def _empty_strided(
    size: Any,
    stride: Any,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
) -> torch.Tensor:
    inner = torch.empty_strided(size, stride, dtype=dtype, layout=layout)
    return SimulatedNpuTensor(inner, _torch_device(device))


@_not_traced
def _copy_from(source: torch.Tensor, dest: torch.Tensor, non_blocking: bool = False) -> Any:
    # Reached for copies between a CPU tensor and an npu wrapper: copy the data across.
    src = source.cpu_data if isinstance(source, SimulatedNpuTensor) else source
    dst = dest.cpu_data if isinstance(dest, SimulatedNpuTensor) else dest
    dst.copy_(src)
    return dest


_library: list[Any] = []


def _register_kernels() -> None:
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    kernels: dict[str, Callable[..., Any]] = {
        "empty.memory_format": _empty,
        "empty_strided": _empty_strided,
        "_copy_from": _copy_from,
    }
    for name, kernel in kernels.items():
        library.impl(name, kernel, "PrivateUse1")  # type: ignore[no-untyped-call]
    _library.append(library)  # a Library deregisters its kernels when collected


# --- torch.npu and torch_npu --------------------------------------------------------------


def _device_module() -> types.ModuleType:
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


def _stand_in(npu: types.ModuleType) -> types.ModuleType:
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


def _refuse_real_torch_npu() -> None:
    """A real torch_npu that imports must never be shadowed, whether or not it sees a device."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # a broken torch_npu reports no device: nothing real to shadow
        return
    npu = getattr(torch, "npu", None)
    count = 0
    try:
        count = int(npu.device_count()) if npu is not None else 0
    except Exception:
        count = 0
    raise pytest.UsageError(
        f"--gradref-simulate=npu refused: a real torch_npu is installed and imports "
        f"({count} NPU device(s) visible). Run without --gradref-simulate (and unset "
        "GRADREF_SIMULATE) to test on the real NPU."
    )


# The first torch whose Python code can register a PrivateUse1 device guard: autograd asks the
# guard of every tensor's device, and without one a Python-defined device aborts the process.
# An older torch would need a compiled extension, which a pytest option should not build.
REQUIRED_TORCH = "2.10"


def unsupported_reason() -> str | None:
    """Why this torch cannot run the simulated npu, or None where it can."""
    from torch.utils import backend_registration

    if hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        return None
    return (
        f"the simulated npu needs torch {REQUIRED_TORCH} or later (a Python-registered "
        f"PrivateUse1 device guard), this is torch {torch.__version__}"
    )


def install(count: int = DEFAULT_DEVICE_COUNT) -> None:
    """Make this process run a simulated npu with ``count`` devices (idempotent).

    Raises pytest.UsageError where a real torch_npu imports, where torch is older than
    REQUIRED_TORCH, and where PrivateUse1 already belongs to another backend.
    """
    if _installed:
        return
    if count < 1:
        raise ValueError(f"a simulated npu needs at least one device, got {count}")
    _refuse_real_torch_npu()
    taken = torch._C._get_privateuse1_backend_name()
    if taken not in ("privateuseone", DEVICE_TYPE):
        raise pytest.UsageError(
            f"--gradref-simulate=npu: PyTorch's PrivateUse1 backend is already {taken!r} in "
            "this process, so no simulated npu can be registered"
        )
    reason = unsupported_reason()
    if reason is not None:
        raise pytest.UsageError(
            f"--gradref-simulate=npu: {reason}. Install torch>={REQUIRED_TORCH}, or run without "
            "--gradref-simulate (and unset GRADREF_SIMULATE)."
        )
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _installed["count"] = count
    npu = _device_module()
    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=npu)
    _register_kernels()
    # The engine sizes its device queues by the guard's deviceCount(), 1 for a Python backend,
    # and picks a queue by device index unless multithreading is off for the calling thread:
    # off, every simulated index runs backward here, on the thread that runs the tests.
    torch.autograd.set_multithreading_enabled(False)
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu"] = _stand_in(npu)
