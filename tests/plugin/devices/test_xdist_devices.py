"""Multi-device runs under pytest-xdist: which worker takes which device."""

from __future__ import annotations

import json

import pytest

from pytest_gradref.devices.xdist import assign_devices, physical_ids


def test_round_robin_over_visible_devices() -> None:
    assert assign_devices("cuda", 2, 4, None) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert assign_devices("cuda", 4, 2, None) == ["cuda:0", "cuda:1"]
    assert assign_devices("npu", 3, 3, None) == ["npu:0", "npu:1", "npu:2"]


def test_more_workers_than_devices_share_them_evenly() -> None:
    mapping = assign_devices("cuda", 3, 7, None)
    per_device = [mapping.count(f"cuda:{i}") for i in range(3)]
    assert max(per_device) - min(per_device) <= 1
    assert sum(per_device) == 7


def test_explicit_index_pins_every_worker() -> None:
    assert assign_devices("cuda", 2, 3, 1) == ["cuda:1"] * 3


def test_single_device_backends() -> None:
    assert assign_devices("cpu", 1, 2, None) == ["cpu:0", "cpu:0"]


def test_physical_ids_follow_the_visible_devices_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert physical_ids("CUDA_VISIBLE_DEVICES") == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_ids("CUDA_VISIBLE_DEVICES") is None
    assert physical_ids(None) is None


# A policy that reports several devices while placing tensors on the CPU, so the mapping is
# exercised on machines without accelerators. Its device count follows a variable the way
# CUDA's follows CUDA_VISIBLE_DEVICES.
MULTI_CONFTEST = """
import os

from pytest_gradref import builtin_backend


def visible():
    return len(os.environ.get("MULTI_VISIBLE_DEVICES", "0,1").split(","))


def pytest_gradref_register_backends(registry):
    registry.register(
        builtin_backend("cuda").replace(
            name="multi",
            device_type="cpu",
            probe=lambda: None,
            count_devices=visible,
            auto_rank=None,
            visible_devices_env="MULTI_VISIBLE_DEVICES",
        )
    )
"""

RECORDING_TEST = """
import json
import os

import pytest

from pytest_gradref.config.state import state_key


@pytest.mark.parametrize("i", range(8))
def test_where(i, gradref_device, pytestconfig, worker_id):
    setup = pytestconfig.stash[state_key].resolved
    with open(os.path.join(os.environ["WHERE_DIR"], f"{i}.json"), "w") as handle:
        json.dump([worker_id, setup.label], handle)
"""


def _where(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict:
    out = pytester.mkdir(f"where{len(list(pytester.path.glob('where*')))}")
    monkeypatch.setenv("WHERE_DIR", str(out))
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=8)
    ran = [json.loads((out / f"{i}.json").read_text()) for i in range(8)]
    return {"result": result, "by_worker": dict(map(tuple, ran))}


def test_workers_take_devices_round_robin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(MULTI_CONFTEST)
    pytester.makepyfile(RECORDING_TEST)
    run = _where(pytester, monkeypatch, "-n", "3", "--gradref-device=multi")
    assert run["by_worker"] == {
        "gw0": "multi:0 on cpu",
        "gw1": "multi:1 on cpu",
        "gw2": "multi:0 on cpu",
    }
    run["result"].stdout.fnmatch_lines(
        [
            "*= gradref workers =*",
            "gw0 -> multi:0 on cpu (*; current device cpu)",
            "gw1 -> multi:1 on cpu (*; current device cpu)",
            "gw2 -> multi:0 on cpu (*; current device cpu)",
        ]
    )


def test_callers_visible_devices_are_respected(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(MULTI_CONFTEST)
    pytester.makepyfile(RECORDING_TEST)
    monkeypatch.setenv("MULTI_VISIBLE_DEVICES", "5,6")
    run = _where(pytester, monkeypatch, "-n", "3", "--gradref-device=multi")
    assert sorted(set(run["by_worker"].values())) == ["multi:0 on cpu", "multi:1 on cpu"]
    run["result"].stdout.fnmatch_lines(
        [
            "gw0 -> multi:0 on cpu (*, physical 5; *)",
            "gw1 -> multi:1 on cpu (*, physical 6; *)",
            "gw2 -> multi:0 on cpu (*, physical 5; *)",
        ]
    )


def test_explicit_index_pins_every_worker_in_a_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(MULTI_CONFTEST)
    pytester.makepyfile(RECORDING_TEST)
    run = _where(pytester, monkeypatch, "-n", "2", "--gradref-device=multi:1")
    assert set(run["by_worker"].values()) == {"multi:1 on cpu"}


def test_without_xdist_nothing_changes(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(MULTI_CONFTEST)
    pytester.makepyfile(
        """
from pytest_gradref.config.state import state_key

def test_serial(gradref_device, pytestconfig):
    assert pytestconfig.stash[state_key].resolved.label == "multi:0 on cpu"
"""
    )
    result = pytester.runpytest("-p", "no:xdist", "--gradref-device=multi")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*gradref workers*")
