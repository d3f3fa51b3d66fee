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

This module installs it and says what was installed; simulated_devices.py holds the devices,
``torch.npu`` and the ``torch_npu`` stand-in, simulated_tensor.py the tensor and its dispatch.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterable

import pytest
import torch

from pytest_gradref.devices import ascend_numerics
from pytest_gradref.devices.simulated_devices import (
    DEFAULT_DEVICE_COUNT,
    DEVICE_TYPE,
    _ascend,
    _installed,
    device_module,
    stand_in,
)
from pytest_gradref.devices.simulated_tensor import install_tensor


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


def installed() -> bool:
    """Whether this process runs the simulated npu."""
    return bool(_installed)


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
    npu = device_module()
    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=npu)
    install_tensor()
    # The engine sizes its device queues by the guard's deviceCount(), 1 for a Python backend,
    # and picks a queue by device index unless multithreading is off for the calling thread:
    # off, every simulated index runs backward here, on the thread that runs the tests.
    torch.autograd.set_multithreading_enabled(False)
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu"] = stand_in(npu)
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
