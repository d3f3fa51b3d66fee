"""Backend policies and the registry that holds them.

A backend is a *policy*: how to detect the device family, which gradient strategy its
reference gradients use, which tolerances apply per dtype, and how to seed, synchronize and
read memory statistics. *Placement* (``device_type``) is only the torch device type its tensors
live on. Keeping the two apart lets a test register the npu policy with CPU placement and
exercise it on machines that have no NPU.

Nothing here imports torch at module load: the plugin must stay cheap for projects that
never use it. torch (and torch_npu) are imported when a backend is probed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gradref.config.strategies import STRATEGIES, Strategy

if TYPE_CHECKING:
    import torch

    from pytest_gradref.config.tolerances import Tolerance


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """The policy for one device family.

    Attributes:
        name: registry key, used by ``--gradref-device`` and the markers.
        device_type: torch device type the tensors are placed on ("cuda", "npu", "cpu", ...).
        default_strategy: how reference gradients are computed unless a test or the command
            line says otherwise.
        tolerances: per-dtype overrides (keyed by dtype name, e.g. "bfloat16") of
            torch.testing.assert_close's default tolerances.
        probe: returns None when the backend can run here, else the reason it cannot.
        auto_rank: position in ``--gradref-device=auto`` (lower is tried first); None means
            never chosen automatically.
        visible_devices_env: the environment variable that restricts the visible devices.
        count_devices: how many devices are visible; None asks torch's per-backend module.
        cpu_only_dtypes: dtypes the device cannot compute in (by name); golden references
            in those dtypes are computed on the CPU.
        collective_backend: the torch.distributed backend its multi-rank tests initialise
            (``@pytest.mark.gradref_ranks``): "gloo", "nccl", "hccl", or a plugin's own; None
            where the device has no collective library, which skips those tests.
    """

    name: str
    device_type: str
    default_strategy: Strategy = "autograd"
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    probe: Callable[[], str | None] = _always_available
    auto_rank: int | None = None
    visible_devices_env: str | None = None
    count_devices: Callable[[], int] | None = None
    cpu_only_dtypes: frozenset[str] = frozenset()
    collective_backend: str | None = None

    def __post_init__(self) -> None:
        if self.default_strategy not in STRATEGIES:
            raise ValueError(
                f"Backend {self.name!r}: default_strategy must be one of {STRATEGIES}, "
                f"got {self.default_strategy!r}"
            )

    def replace(self, **changes: Any) -> Backend:
        """A copy with some fields changed, e.g. the npu policy with CPU placement."""
        return dataclasses.replace(self, **changes)

    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else a human-readable reason.

        A probe that raises makes the backend unavailable with the error as the reason: a
        broken driver or plugin must not crash the run (auto then moves on to the next).
        """
        try:
            return self.probe()
        except Exception as error:
            return f"its probe failed: {type(error).__name__}: {error}"

    def _module(self) -> Any:
        import torch

        return getattr(torch, self.device_type, None)

    def device_count(self) -> int:
        if self.count_devices is not None:
            return self.count_devices()
        if self.device_type == "cpu":
            return 1
        module = self._module()
        count = getattr(module, "device_count", None)
        return int(count()) if count is not None else 1

    def device(self, index: int | None = None) -> torch.device:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, 0 if index is None else index)

    def describe_device(self, device: torch.device) -> str:
        """A short human name for the device, e.g. "NVIDIA H200"."""
        if device.type == "cpu":
            import platform

            return platform.processor() or platform.machine() or "CPU"
        get_name = getattr(self._module(), "get_device_name", None)
        if get_name is None:
            return device.type
        try:
            return str(get_name(device))
        except Exception as error:  # a description must never fail a run
            return f"{device.type} ({type(error).__name__})"

    def activate(self, device: torch.device) -> None:
        """Make device the current one, so code that uses the default device lands there."""
        set_device = getattr(self._module(), "set_device", None)
        if device.type != "cpu" and set_device is not None:
            set_device(device)

    def current_device(self) -> str:
        """The device that tensors created without a device index land on."""
        current = getattr(self._module(), "current_device", None)
        if self.device_type == "cpu" or current is None:
            return self.device_type
        return f"{self.device_type}:{current()}"

    def seed(self, seed: int) -> None:
        """Seed torch's CPU generator and every generator of this device family.

        Not ``torch.manual_seed``: it also queues a seed for every device family that is not
        initialised (cuda, xpu, mtia on a CPU build), formatting the caller's stack for each,
        which at pytest's depth costs more than a small test's whole comparison.
        """
        import torch

        torch.default_generator.manual_seed(seed)
        seed_all = getattr(self._module(), "manual_seed_all", None)
        if seed_all is not None and self.device_type != "cpu":
            seed_all(seed)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cpu":
            return
        sync = getattr(self._module(), "synchronize", None)
        if sync is not None:
            sync(device)

    def memory_stats(self, device: torch.device) -> dict[str, int]:
        """Allocated and peak bytes on the device; empty where torch does not track them."""
        module = self._module()
        stats: dict[str, int] = {}
        if device.type == "cpu" or module is None:
            return stats
        for key in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
            reader = getattr(module, key, None)
            if reader is not None:
                stats[key] = int(reader(device))
        return stats

    def allocation_count(self, device: torch.device) -> int | None:
        """How many allocations the device's allocator has made so far, a count that only
        grows: read before and after a test, it says whether the test allocated on the device.
        None where the backend does not count them (the CPU, mps, xpu's byte-only statistics).

        It reads ``memory_stats_as_nested_dict`` (torch.cuda, torch_npu's torch.npu and the
        simulated npu have it, with the same keys): it skips the flattening that makes the
        flat ``memory_stats`` several times slower a read.
        """
        reader = getattr(self._module(), "memory_stats_as_nested_dict", None)
        if device.type == "cpu" or reader is None:
            return None
        stats = reader(device)
        if not stats:  # torch answers {} for an allocator it has not started: none allocated
            return 0
        count = stats.get("allocation", {}).get("all", {}).get("allocated")
        return None if count is None else int(count)

    def reset_peak_memory(self, device: torch.device) -> None:
        """Start ``max_memory_allocated`` afresh from what is allocated now (to measure the
        peak of one operation); a no-op where torch tracks no allocations."""
        module = self._module()
        reset = getattr(module, "reset_peak_memory_stats", None)
        if device.type != "cpu" and reset is not None:
            reset(device)


class BackendRegistry:
    """Backends by name, filled by the ``pytest_gradref_register_backends`` hook."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend, *, replace: bool = False) -> None:
        """Add a backend; replacing an existing name needs ``replace=True``."""
        if backend.name in self._backends and not replace:
            raise ValueError(
                f"A gradref backend named {backend.name!r} is already registered; "
                "pass replace=True to override it."
            )
        self._backends[backend.name] = backend

    def register_default(self, backend: Backend) -> None:
        """Add a backend unless another plugin already registered that name.

        The built-ins arrive this way, last, so a third-party plugin overrides them just by
        registering the same name.
        """
        self._backends.setdefault(backend.name, backend)

    def get(self, name: str) -> Backend:
        return self._backends[name]

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def names(self) -> list[str]:
        return list(self._backends)

    def auto_order(self) -> list[Backend]:
        """Backends that ``auto`` may choose, in the order it tries them."""
        ranked = [b for b in self._backends.values() if b.auto_rank is not None]
        return sorted(ranked, key=lambda b: (b.auto_rank, b.name))


# --- built-in probes -------------------------------------------------------------------------


def _probe_cuda() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    suffix = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return f"no CUDA device visible{suffix}"


def _probe_npu() -> str | None:
    # torch_npu is imported only here, so machines without the Ascend toolkit never touch it.
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as error:  # a broken torch_npu makes npu unavailable, never a crash
        return f"torch_npu failed to import: {type(error).__name__}: {error}"
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "torch_npu imported but no NPU device is visible"
    return None


def _probe_xpu() -> str | None:
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return "no Intel XPU device visible"
    return None


def _probe_mps() -> str | None:
    import torch

    if not torch.backends.mps.is_available():
        return "MPS needs macOS on Apple silicon"
    return None


def builtin_backends() -> Iterable[Backend]:
    """cpu, cuda (ROCm reports as cuda), npu, xpu and mps."""
    return (
        Backend(
            name="cuda",
            device_type="cuda",
            probe=_probe_cuda,
            auto_rank=10,
            visible_devices_env="CUDA_VISIBLE_DEVICES",
            collective_backend="nccl",  # RCCL on ROCm, under the same name
        ),
        # On Ascend, autograd and torch.func.grad_and_value disagree slightly in some ops, so a
        # kernel that uses grad_and_value inside is checked against a grad_and_value reference.
        Backend(
            name="npu",
            device_type="npu",
            default_strategy="grad_and_value",
            probe=_probe_npu,
            auto_rank=20,
            visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
            # Ascend runs few float64 kernels, so float64 goldens are computed on the CPU.
            cpu_only_dtypes=frozenset({"float64"}),
            collective_backend="hccl",  # registered with torch.distributed by torch_npu
        ),
        Backend(
            name="xpu",
            device_type="xpu",
            probe=_probe_xpu,
            auto_rank=30,
            visible_devices_env="ZE_AFFINITY_MASK",
            collective_backend="xccl",  # torch 2.8 and later
        ),
        Backend(
            name="mps",
            device_type="mps",
            probe=_probe_mps,
            auto_rank=40,
            cpu_only_dtypes=frozenset({"float64"}),  # MPS has no float64
        ),
        Backend(name="cpu", device_type="cpu", auto_rank=1000, collective_backend="gloo"),
    )


def builtin_backend(name: str) -> Backend:
    """One built-in policy by name, to derive a variant with ``Backend.replace``."""
    for backend in builtin_backends():
        if backend.name == name:
            return backend
    names = ", ".join(b.name for b in builtin_backends())
    raise KeyError(f"no built-in gradref backend named {name!r}; built-ins are {names}")
