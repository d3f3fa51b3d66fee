"""What a backend policy does besides choosing a strategy: devices, seeding, synchronize and
memory statistics, checked on the cpu policy and on a policy with CPU placement."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from pytest_gradref import Backend, builtin_backend


def test_cpu_policy_operations() -> None:
    cpu = builtin_backend("cpu")
    device = cpu.device()
    assert device == torch.device("cpu")
    assert cpu.device_count() == 1
    assert cpu.current_device() == "cpu"
    assert cpu.memory_stats(device) == {}  # torch tracks no CPU allocations
    assert cpu.allocation_count(device) is None
    cpu.reset_peak_memory(device)  # nothing to reset, and no error
    cpu.synchronize(device)  # nothing to wait for, and no error
    cpu.activate(device)
    assert cpu.unavailable_reason() is None


def test_seed_makes_draws_repeatable_and_distinct() -> None:
    cpu = builtin_backend("cpu")
    cpu.seed(123)
    first = torch.rand(4)
    cpu.seed(123)
    assert torch.equal(torch.rand(4), first)
    cpu.seed(124)
    assert not torch.equal(torch.rand(4), first)


def test_placement_apart_from_policy() -> None:
    # The npu policy placed on the CPU: npu's strategy and visible-devices variable, CPU
    # tensors, and a device count the test decides.
    npu_on_cpu = builtin_backend("npu").replace(
        device_type="cpu", probe=lambda: None, count_devices=lambda: 3
    )
    assert npu_on_cpu.default_strategy == "grad_and_value"
    assert npu_on_cpu.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert npu_on_cpu.device_count() == 3
    assert npu_on_cpu.device(2) == torch.device("cpu")
    assert npu_on_cpu.memory_stats(torch.device("cpu")) == {}
    assert npu_on_cpu.unavailable_reason() is None
    assert builtin_backend("npu").cpu_only_dtypes == frozenset({"float64"})


def test_reset_peak_memory_forgets_earlier_peaks(
    gradref_backend: Backend, gradref_device: torch.device
) -> None:
    if not gradref_backend.memory_stats(gradref_device):
        pytest.skip(f"torch tracks no allocations on {gradref_device.type}")
    scratch = torch.empty(1 << 22, device=gradref_device)
    del scratch
    before = gradref_backend.memory_stats(gradref_device)
    assert before["max_memory_allocated"] >= before["memory_allocated"] + (1 << 24)
    gradref_backend.reset_peak_memory(gradref_device)
    after = gradref_backend.memory_stats(gradref_device)
    assert after["max_memory_allocated"] == after["memory_allocated"]


@pytest.mark.parametrize(
    ("stats", "count"),
    [
        ({"allocation": {"all": {"allocated": 7, "current": 2}}}, 7),  # torch.cuda's, torch_npu's
        ({}, 0),  # what torch.cuda answers before its allocator starts
        ({"allocated_bytes": {"all": {"allocated": 512}}}, None),  # bytes only, as torch.xpu
    ],
)
def test_allocation_count_reads_the_allocators_count(
    monkeypatch: pytest.MonkeyPatch, stats: dict[str, Any], count: int | None
) -> None:
    asked: list[torch.device] = []

    def memory_stats_as_nested_dict(device: torch.device) -> dict[str, Any]:
        asked.append(device)
        return stats

    # A device module as torch.cuda is one, under a device type torch knows but has none for.
    module = types.SimpleNamespace(memory_stats_as_nested_dict=memory_stats_as_nested_dict)
    monkeypatch.setattr(torch, "meta", module, raising=False)
    backend = Backend(name="counting", device_type="meta")
    assert backend.allocation_count(torch.device("meta")) == count
    assert asked == [torch.device("meta")]
    monkeypatch.delattr(torch, "meta")
    assert backend.allocation_count(torch.device("meta")) is None  # no module, no count
