"""The simulated npu's tensor: ``SimulatedNpuTensor``, a wrapper around a CPU tensor, the
dispatch that runs every operator on the CPU tensors inside, the PrivateUse1 kernels that
create, copy and pin them, ``tensor.data =``, and ``torch.save`` / ``torch.load``.

One of the simulated npu's three modules (simulated.py installs it, through ``install_tensor``;
simulated_devices.py holds the devices).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pytest_gradref.devices import ascend_numerics
from pytest_gradref.devices.simulated_devices import (
    DEVICE_TYPE,
    SimulatedDeviceError,
    _ascend,
    _created,
    _current,
    _torch_device,
)

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


def install_tensor() -> None:
    """Register the tensor's kernels, put the ``tensor.data`` property in front of torch's, and
    register its location with torch.serialization (once, from install())."""
    _register_kernels()
    _count_call_references()
    data = property(_get_data, _set_data, _delete_data, _TENSOR_DATA.__doc__)
    setattr(torch.Tensor, "data", data)  # noqa: B010 (mypy: a property cannot be assigned)
    # Before torch's cpu tagger (10) and its PrivateUse1 deserializer (23).
    torch.serialization.register_package(9, _location_tag, _restore_location)
