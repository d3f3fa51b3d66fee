"""The consumer's own setup agrees with the plugin's: the device its conftest-time probe found
is the one gradref runs on (the simulated npu under ``--gradref-simulate=npu
--gradref-device=npu``), and its autouse fixture seeded the test."""

from __future__ import annotations

import torch
from preference_utils import DEVICE


def test_the_probe_found_the_plugins_device(gradref_device: torch.device) -> None:
    assert gradref_device.type == DEVICE


def test_the_suite_seeds_every_test(gradref_device: torch.device) -> None:
    assert torch.initial_seed() == 42
    # The device's generator too: the same draw as straight after seeding it.
    drawn = torch.randn(4, device=gradref_device)
    torch.manual_seed(42)
    assert torch.equal(drawn, torch.randn(4, device=gradref_device))
