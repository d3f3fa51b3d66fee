"""A simulated npu device on the CPU: a testing aid for CI machines without Ascend hardware.

``install()`` (what ``--gradref-simulate=npu`` calls, before pytest imports the initial
conftests, so before any probe of theirs or of the modules they import) makes this process
look like one with torch_npu and N NPUs:

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

What training code does to tensors works as on a device, or raises an error naming the
operation, never leaves a stale value: ``tensor.data = value`` in any direction (CPU modules
take npu data in place, as with torch_npu and CUDA, and ``Module.to`` keeps the parameter
objects an optimizer holds, unless a live autograd graph or a view holds them too), ``set_``,
``copy_`` between any two devices, state dicts, ``torch.save`` / ``torch.load`` (a real npu
checkpoint's format, tagged ``npu:N``, so ``map_location`` and ``weights_only`` work and
``map_location="cpu"`` loads it without the simulation), ``copy.copy`` / ``copy.deepcopy``,
and pinned memory (``pin_memory()``, ``DataLoader(pin_memory=True)``: an ordinary CPU copy
marked pinned, as copies here are synchronous). Not modelled: a factory's ``pin_memory=True``
and pinning under ``torch.inference_mode()`` (torch's own error about PrivateUse1 hooks),
storage identity (``data_ptr()`` is 0 and each npu tensor has its own empty storage object;
``set_(storage)`` still reaches the data), and loading a legacy (non-zip) file onto the npu
(refused).

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

What it does not prove: Ascend numerics (every operator is torch's CPU kernel; with
``install(numerics="ascend")``, ``--gradref-simulate-numerics=ascend``, the float32 matmul-class
and convolution operators round their operands to HF32 as torch_npu documents, under its
``torch.npu.matmul.allow_hf32`` and ``torch.npu.conv.allow_hf32`` switches, and nothing else
of Ascend is modelled: see ascend_numerics.py), torch_npu's own operators (``torch_npu.npu_*``,
stubs here) and compiled code. The simulation is
process-global and cannot be undone; it refuses to install where a real torch_npu imports,
with or without a device (only a torch_npu that fails to import, which the npu probe reports
as unavailable, leaves it free). Code that ran before it was installed (a plugin that imports
torch when pytest loads it) may have probed and seen no npu: the run says so in its first
lines (``install_notes``). It needs torch 2.10 or later (``REQUIRED_TORCH``); on an older
torch the option is a usage error.
"""

from __future__ import annotations

import collections
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

from pytest_gradref.devices import ascend_numerics

DEVICE_TYPE = "npu"
DEFAULT_DEVICE_COUNT = 2
DEVICE_NAME = "simulated NPU on CPU (pytest-gradref)"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

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


def installed() -> bool:
    """Whether this process runs the simulated npu."""
    return bool(_installed)


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

# Attributes on the Python objects of storages (which live as long as the storage): the npu
# location a CPU storage is saved with, the CPU storage behind an npu one, and a pinned copy.
_LOCATION = "_gradref_npu_location"
_BACKING = "_gradref_npu_backing"
_PINNED = "_gradref_pinned"
# A wrapper's own attributes, which a saved parameter's state leaves out.
_OWN_ATTRIBUTES = frozenset({"cpu_data", "_is_param"})


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

    def __reduce_ex__(self, proto: Any) -> Any:
        # torch.save writes what torch_npu writes: torch's own reduction of the CPU data (a
        # storage and _rebuild_tensor_v2), the storage tagged with the npu location
        # (_location_tag). So the file loads with weights_only, map_location applies, and
        # map_location="cpu" loads it without the simulation, as a real npu checkpoint.
        if getattr(self, "_is_param", False):
            hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
            state = {k: v for k, v in vars(self).items() if k not in _OWN_ATTRIBUTES}
            if state:
                with_state = (self.detach(), self.requires_grad, hooks, state)
                return (torch._utils._rebuild_parameter_with_state, with_state)
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, hooks))
        rebuild, args = self.cpu_data._reduce_ex_internal(proto)  # type: ignore[no-untyped-call]
        setattr(self.cpu_data.untyped_storage(), _LOCATION, str(self.device))
        return (rebuild, (*args[:4], self.requires_grad, *args[5:]))

    def __copy__(self) -> Any:
        # copy.copy would rebuild from __reduce_ex__, whose storage is the CPU data's: a
        # tensor of its own on the same data, as torch's shallow copy of a tensor.
        copied: torch.Tensor
        if getattr(self, "_is_param", False):
            copied = torch.nn.Parameter(self.detach(), self.requires_grad)
        else:
            copied = self.detach().requires_grad_(self.requires_grad)
        vars(copied).update((k, v) for k, v in vars(self).items() if k not in _OWN_ATTRIBUTES)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A parameter copies as torch.nn.Parameter does (its data, no .grad), as parameters on
        # a real npu, which are Parameters, do; other tensors as torch copies any wrapper.
        if not getattr(self, "_is_param", False):
            return super().__deepcopy__(memo)  # type: ignore[no-untyped-call]
        if id(self) not in memo:
            data = self.detach().clone(memory_format=torch.preserve_format)
            memo[id(self)] = torch.nn.Parameter(data, self.requires_grad)
        return memo[id(self)]

    def untyped_storage(self) -> torch.UntypedStorage:
        # A wrapper's own storage holds no data: it carries the CPU storage, which set_(storage,
        # ...) runs on (_dispatch). A storage's Python object lives as long as the storage.
        storage = super().untyped_storage()
        setattr(storage, _BACKING, self.cpu_data.untyped_storage())
        return storage

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
    if func is aten._pin_memory.default:
        raise SimulatedDeviceError(
            f"cannot pin a tensor on {args[0].device}: only CPU tensors can be pinned (in {func})"
        )
    devices: set[torch.device] = set()
    foreign: set[torch.device] = set()  # of CPU operands (0-dim scalars aside) and storages

    def look(value: Any) -> Any:
        if isinstance(value, SimulatedNpuTensor):
            devices.add(value.device)
        elif isinstance(value, torch.Tensor) and not _is_cpu_scalar(value):
            foreign.add(value.device)
        elif isinstance(value, torch.UntypedStorage):  # set_(storage, ...)
            (devices if value.device.type == DEVICE_TYPE else foreign).add(value.device)
        return value

    if func in _INDEX_OPS:
        # The indices (argument 1) may stay on the CPU, as on CUDA; npu ones must match.
        tree_map(look, (args[0], args[2:], kwargs))
        for index in args[1]:
            if isinstance(index, SimulatedNpuTensor):
                look(index)
    else:
        tree_map(look, (args, kwargs))
    # A copy goes between any two devices, as on real hardware.
    copying = func in (aten.copy_.default, aten._copy_from.default)
    if not copying and (len(devices) > 1 or foreign):
        where = sorted(str(d) for d in devices | foreign)
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
        if isinstance(value, torch.UntypedStorage) and value.device.type == DEVICE_TYPE:
            return _backing(value, func)
        return value

    cpu_args, cpu_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if _ascend[0]:
        cpu_args, cpu_kwargs = ascend_numerics.apply(func, cpu_args, cpu_kwargs)
    out = func(*cpu_args, **cpu_kwargs)
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


def _backing(storage: torch.UntypedStorage, func: Any) -> torch.UntypedStorage:
    """The CPU storage behind an npu storage (from untyped_storage() or torch.load)."""
    backing: torch.UntypedStorage | None = getattr(storage, _BACKING, None)
    if backing is None:
        raise SimulatedDeviceError(
            f"{func} got an npu storage that does not come from a simulated npu tensor's "
            "untyped_storage() or from torch.load: the simulated npu has no data behind it. "
            "Pass the storage of a simulated npu tensor, or set_(tensor) instead."
        )
    return backing


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


def _pins_for_npu(tensor: torch.Tensor, device: torch.device | None) -> bool:
    """Whether pinning a dense tensor is for the simulated npu: named, or the current
    accelerator (sparse layouts have kernels of their own)."""
    target = device if device is not None else torch.accelerator.current_accelerator()
    return tensor.layout == torch.strided and target is not None and target.type == DEVICE_TYPE


# Pinned memory comes from the accelerator's allocator, which a Python-registered PrivateUse1
# backend cannot provide (torch asks for getPinnedMemoryAllocator). For the simulated npu a
# pinned tensor is an ordinary CPU copy marked pinned: the simulation copies synchronously,
# so what pinning buys on hardware (an asynchronous copy) changes no value here. These run at
# AutogradCPU, ahead of torch's own kernels, and hand any other device to them.
@_not_traced
def _pin_memory(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if not _pins_for_npu(tensor, device):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.aten._pin_memory.default(tensor, device)  # type: ignore[no-any-return]
    pinned = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
    pinned.copy_(tensor)
    setattr(pinned.untyped_storage(), _PINNED, True)
    return pinned


@_not_traced
def _is_pinned(tensor: torch.Tensor, device: torch.device | None = None) -> bool:
    if not _pins_for_npu(tensor, device):
        with torch._C._AutoDispatchBelowAutograd():
            return bool(torch.ops.aten.is_pinned.default(tensor, device))
    return getattr(tensor.untyped_storage(), _PINNED, False) is True


_library: list[Any] = []


def _register_kernels() -> None:
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    kernels: dict[str, tuple[Callable[..., Any], str]] = {
        "empty.memory_format": (_empty, "PrivateUse1"),
        "empty_strided": (_empty_strided, "PrivateUse1"),
        "_copy_from": (_copy_from, "PrivateUse1"),
        "_pin_memory": (_pin_memory, "AutogradCPU"),
        "is_pinned": (_is_pinned, "AutogradCPU"),
        "_has_compatible_shallow_copy_type": (
            _compatible_shallow_copy_type,
            "AutogradPrivateUse1",
        ),
    }
    for name, (kernel, key) in kernels.items():
        library.impl(name, kernel, key)  # type: ignore[no-untyped-call]
    _library.append(library)  # a Library deregisters its kernels when collected


# --- tensor.data = value -------------------------------------------------------------------

# tensor.data = value runs set_data in C++ (TensorImpl::shallow_copy_from), which copies the
# sizes, dtype, device and storage but no Python attribute: an npu tensor would keep its old
# cpu_data (stale values under the new dtype), and a CPU tensor cannot become an npu one (its
# Python object has no __torch_dispatch__; torch refuses "incompatible tensor type", where
# torch_npu, like CUDA, takes it). Only __torch_function__ sees that C setter, at a cost to
# every operator, so the simulation puts a Python property in front of it on torch.Tensor
# that hands every tensor but a simulated one to torch's own.
_TENSOR_DATA: Any = vars(torch._C.TensorBase)["data"]


def _get_data(tensor: torch.Tensor) -> Any:
    return _TENSOR_DATA.__get__(tensor, type(tensor))


def _set_data(tensor: torch.Tensor, value: Any) -> None:
    if isinstance(tensor, SimulatedNpuTensor) and isinstance(value, SimulatedNpuTensor):
        _TENSOR_DATA.__set__(tensor, value)  # dtype, device, storage and autograd bookkeeping
        tensor.cpu_data = value.cpu_data
    elif isinstance(value, torch.Tensor) and SimulatedNpuTensor in (type(tensor), type(value)):
        _move_in_place(tensor, value)
    else:
        _TENSOR_DATA.__set__(tensor, value)


def _delete_data(tensor: torch.Tensor) -> None:
    _TENSOR_DATA.__delete__(tensor)


def _move_in_place(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value`` across the CPU and the simulated npu: the tensor object takes
    a new TensorImpl that shares value's data (torch.utils.swap_tensors), keeping its identity,
    requires_grad, parameter-ness and attributes, as set_data keeps them."""
    operation = f"tensor.data = value (a {tensor.device} tensor given {value.device} data)"
    hooks = getattr(tensor, "_backward_hooks", None) or getattr(
        tensor, "_post_accumulate_grad_hooks", None
    )
    if tensor.grad_fn is not None or hooks:
        raise SimulatedDeviceError(
            f"{operation}: the simulated npu moves a tensor between devices in place only "
            "while it has no grad_fn or hooks; assign data on the tensor's own device "
            "(value.to(tensor.device))"
        )
    fresh = value.detach()
    if isinstance(tensor, torch.nn.Parameter):
        fresh = torch.nn.Parameter(fresh, tensor.requires_grad)
    else:
        fresh.requires_grad_(tensor.requires_grad)
    state = {k: v for k, v in vars(tensor).items() if k not in _OWN_ATTRIBUTES}
    grad, tensor.grad = tensor.grad, None  # swap_tensors moves the autograd state too
    try:
        torch.utils.swap_tensors(tensor, fresh)  # type: ignore[no-untyped-call]
    except RuntimeError as error:
        tensor.grad = grad
        raise SimulatedDeviceError(
            f"{operation}: {error}; the simulated npu moves a tensor between devices in "
            "place only where nothing else holds it (a view, an autograd graph). Assign data "
            "on the tensor's own device (value.to(tensor.device)), or move the module first."
        ) from None
    vars(tensor).update(state)
    if grad is not None:
        # set_data leaves the gradient behind, for Module._apply to move next (its .data = is
        # then on one device); a gradient can only be assigned on the tensor's device.
        tensor.grad = grad.to(tensor.device, tensor.dtype)


# The references to a tensor argument that a call into a Python kernel holds (the dispatcher's
# argument stack), measured at install: inside _compatible_shallow_copy_type, a tensor that
# nothing else holds has this many more than one.
_CALL_REFERENCES = [0]
_last_use_count = [0]


def _compatible_shallow_copy_type(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """torch_npu's answer, as for CPU and CUDA: a dense CPU or npu tensor takes the other's
    data (set_data), so Module.to moves parameters in place and an optimizer made before the
    move keeps them. Between the CPU and the npu that move swaps TensorImpls (_move_in_place),
    which only a tensor that nothing else holds allows (an autograd graph or a view holds it):
    for another, Module.to makes a new Parameter, as torch does for types it cannot copy into.
    Registered for AutogradPrivateUse1, so torch answers for any other pair."""
    dense = ("cpu", DEVICE_TYPE)
    if not (
        tensor.layout == other.layout == torch.strided
        and tensor.device.type in dense
        and other.device.type in dense
    ):
        return False
    _last_use_count[0] = tensor._use_count()  # type: ignore[attr-defined]
    return tensor.device.type == other.device.type or _last_use_count[0] <= 1 + _CALL_REFERENCES[0]


def _count_call_references() -> None:
    alone = torch.empty(0)
    torch._has_compatible_shallow_copy_type(alone, torch.empty(0, device=DEVICE_TYPE))
    _CALL_REFERENCES[0] = _last_use_count[0] - alone._use_count()  # type: ignore[attr-defined]


# --- torch.save and torch.load -------------------------------------------------------------


def _location_tag(storage: Any) -> str | None:
    """The npu location of a CPU storage that a simulated npu tensor is saved with."""
    location: str | None = getattr(storage, _LOCATION, None)
    return location


def _restore_location(storage: Any, location: str) -> Any:
    """For torch.load: a storage saved at (or mapped to) an npu location becomes an npu
    storage backed by the loaded CPU one, which torch's _rebuild_tensor then set_()s."""
    if location != DEVICE_TYPE and not location.startswith(f"{DEVICE_TYPE}:"):
        return None
    if getattr(storage, "_torch_load_uninitialized", False):
        raise SimulatedDeviceError(
            "torch.load of a legacy (non-zip) file onto the simulated npu is not simulated: "
            f"load it with map_location='cpu' and move it with .to('{DEVICE_TYPE}')"
        )
    try:
        device = _torch_device(location)
    except RuntimeError as error:
        raise RuntimeError(
            f"torch.load: {error}. Use torch.load with map_location to map the storages to a "
            f"visible device ('{DEVICE_TYPE}:0' or 'cpu')."
        ) from None
    # A storage on the npu at the loaded data's address, which it does not own (the backing
    # CPU storage does): torch.load shares a storage between the tensors that shared it when
    # saved only where its data pointer is not 0.
    npu_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), device, storage.nbytes()
    )
    setattr(npu_storage, _BACKING, storage)
    return npu_storage


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


def install(count: int = DEFAULT_DEVICE_COUNT, numerics: str = "cpu") -> list[str]:
    """Make this process run a simulated npu with ``count`` devices (idempotent), its
    operators computing as torch's CPU kernels do (``numerics="cpu"``) or with the Ascend
    numerics that ascend_numerics.py models (``"ascend"``).

    Returns the cached npu probes of other libraries that had already run (and seen no npu),
    which it cleared so that their next call sees the simulated one; empty where none had.
    Raises pytest.UsageError where a real torch_npu imports, where torch is older than
    REQUIRED_TORCH, and where PrivateUse1 already belongs to another backend.
    """
    if _installed:
        return []
    if count < 1:
        raise ValueError(f"a simulated npu needs at least one device, got {count}")
    if numerics not in ascend_numerics.NUMERICS:
        raise ValueError(
            f"simulated npu numerics must be one of {ascend_numerics.NUMERICS}, got {numerics!r}"
        )
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
    _ascend[0] = numerics == "ascend"
    npu = _device_module()
    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=npu)
    _register_kernels()
    _count_call_references()
    data = property(_get_data, _set_data, _delete_data, _TENSOR_DATA.__doc__)
    setattr(torch.Tensor, "data", data)  # noqa: B010 (mypy: a property cannot be assigned)
    # Before torch's cpu tagger (10) and its PrivateUse1 deserializer (23).
    torch.serialization.register_package(9, _location_tag, _restore_location)
    # The engine sizes its device queues by the guard's deviceCount(), 1 for a Python backend,
    # and picks a queue by device index unless multithreading is off for the calling thread:
    # off, every simulated index runs backward here, on the thread that runs the tests.
    torch.autograd.set_multithreading_enabled(False)
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu"] = _stand_in(npu)
    return _clear_cached_probes()


def numerics() -> str:
    """The simulated npu's numerics: "ascend" (ascend_numerics.py) or "cpu"."""
    return "ascend" if _ascend[0] else "cpu"


def numerics_note() -> str:
    """The header's account of the simulated numerics: what a result computed here says."""
    if _ascend[0]:
        return (
            "simulated numerics: ascend (float32 matmul-class operators in HF32 while "
            "torch.npu.matmul.allow_hf32, default False; convolutions while "
            "torch.npu.conv.allow_hf32, default True; otherwise torch's CPU kernels)"
        )
    return (
        "simulated numerics: cpu (torch's CPU kernels, not Ascend's; "
        "--gradref-simulate-numerics=ascend models Ascend's documented HF32)"
    )


# Npu probes that libraries cache on their first call (functools.lru_cache), as (module,
# function): one that ran before install() answered False.
_CACHED_PROBES = (("transformers.utils.import_utils", "is_torch_npu_available"),)


def _clear_cached_probes() -> list[str]:
    cleared = []
    for module_name, name in _CACHED_PROBES:
        probe = getattr(sys.modules.get(module_name), name, None)
        cache_info = getattr(probe, "cache_info", None)
        if cache_info is not None and cache_info().currsize:
            probe.cache_clear()  # type: ignore[union-attr]
            cleared.append(f"{module_name}.{name}()")
    return cleared


def install_notes(
    cleared: list[str],
    *,
    torch_imported: bool,
    plugins: Iterable[object],
    after_conftests: bool,
) -> list[str]:
    """What ran before install() and may have probed for an npu without seeing one: torch
    imported by a plugin loaded before gradref's hook (``torch_imported``: before install
    imported it), initial conftests imported first (gradref's plugin loaded late), and the
    cached probes install() cleared."""
    notes = []
    if after_conftests:
        notes.append(
            "the simulated npu was installed after the initial conftests had been imported "
            "(the gradref plugin was loaded late, from a conftest's pytest_plugins?): an npu "
            "probe they ran saw none"
        )
    if torch_imported:
        importers = sorted(
            plugin.__name__
            for plugin in plugins
            if isinstance(plugin, types.ModuleType)
            and any(value is torch for value in vars(plugin).values())
        )
        by = ", ".join(importers) or "a plugin loaded before gradref's"
        notes.append(
            f"torch was imported (by {by}) before the simulated npu was installed: an npu "
            "probe that ran then (import torch_npu, torch.npu.is_available()) saw none; "
            "--gradref-strict-device fails a run whose tests never used the npu"
        )
    if cleared:
        notes.append(
            f"{' and '.join(cleared)} had run before the simulated npu was installed and was "
            "cleared: later calls see it, values computed from the first call do not"
        )
    return notes


class InstallNotes:
    """A pytest plugin that shows ``install_notes`` once at the start of the run: in the
    header, or after collection where -q hides the header."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes

    def pytest_report_header(self) -> list[str]:
        lines = [f"gradref: {note}" for note in self.notes]
        self.notes = []
        return lines

    pytest_report_collectionfinish = pytest_report_header
