"""Device and strategy selection: every source, the precedence between them, the header line.

Precedence, highest first: marker (strategy only), command line, environment variable, ini
key, backend default. Which strategy ran is asserted on ``Reference.strategy`` inside the
generated tests (on CPU both strategies give bit-identical numbers), which device was chosen
on ``gradref_backend.name``; the outer test checks the header line that names each source.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

# The generated test asserts the backend and strategy it was told to expect through
# EXPECT_BACKEND / EXPECT_STRATEGY (set by the outer test with monkeypatch).
EXPECTING = """
import os

import torch


def test_expected(grad_reference, gradref_backend, gradref_device):
    assert gradref_backend.name == os.environ["EXPECT_BACKEND"]
    assert gradref_device == torch.device("cpu")
    ref = grad_reference(lambda x: (x * x).sum(), torch.randn(3))
    assert ref.strategy == os.environ["EXPECT_STRATEGY"]
    assert ref.backend == os.environ["EXPECT_BACKEND"]
"""

CLI = "the --gradref-device option"
ENV = "the GRADREF_DEVICE environment variable"
INI = "the gradref_device ini key in tox.ini"
S_CLI = "from the --gradref-strategy option"
S_ENV = "from the GRADREF_STRATEGY environment variable"
S_INI = "from the gradref_strategy ini key in tox.ini"


def _configure(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    *,
    cli: str | None,
    env: str | None,
    ini: str | None,
    option: str,
) -> list[str]:
    """Set one setting from the given sources; return the command-line arguments."""
    name = option.replace("-", "_")
    if ini is not None:
        pytester.makeini(f"[pytest]\ngradref_{name} = {ini}\n")
    if env is not None:
        monkeypatch.setenv(f"GRADREF_{name.upper()}", env)
    return [] if cli is None else [f"--gradref-{option}={cli}"]


@pytest.mark.parametrize(
    ("cli", "env", "ini", "backend", "source"),
    [
        pytest.param("npu", None, None, "npu", CLI, id="cli"),
        pytest.param(None, "npu", None, "npu", ENV, id="env"),
        pytest.param(None, None, "npu", "npu", INI, id="ini"),
        pytest.param("cpu", "npu", "npu", "cpu", CLI, id="cli-over-env-and-ini"),
        pytest.param("npu", "cpu", None, "npu", CLI, id="cli-over-env"),
        pytest.param("npu", None, "cpu", "npu", CLI, id="cli-over-ini"),
        pytest.param(None, "cpu", "npu", "cpu", ENV, id="env-over-ini"),
        pytest.param(None, "npu", "cpu", "npu", ENV, id="env-over-ini-2"),
    ],
)
def test_device_sources_and_precedence(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    npu_on_cpu: Callable[[str], None],
    cli: str | None,
    env: str | None,
    ini: str | None,
    backend: str,
    source: str,
) -> None:
    # Two backends that both run here: cpu (autograd) and the npu policy on CPU tensors
    # (grad_and_value), so the chosen device shows in the strategy that ran as well.
    npu_on_cpu("")
    pytester.makepyfile(EXPECTING)
    args = _configure(pytester, monkeypatch, cli=cli, env=env, ini=ini, option="device")
    strategy = "grad_and_value" if backend == "npu" else "autograd"
    monkeypatch.setenv("EXPECT_BACKEND", backend)
    monkeypatch.setenv("EXPECT_STRATEGY", strategy)
    result = pytester.runpytest(*args)
    label = "npu:0 on cpu" if backend == "npu" else "cpu"
    result.stdout.fnmatch_lines(
        [f"gradref: device={label} (*; from {source}) strategy={strategy} ({backend} default)*"]
    )
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("cli", "env", "ini", "strategy", "source"),
    [
        pytest.param("grad_and_value", None, None, "grad_and_value", S_CLI, id="cli"),
        pytest.param(None, "grad_and_value", None, "grad_and_value", S_ENV, id="env"),
        pytest.param(None, None, "grad_and_value", "grad_and_value", S_INI, id="ini"),
        pytest.param(None, None, None, "autograd", "cpu default", id="backend-default"),
        pytest.param(
            "autograd", "grad_and_value", "grad_and_value", "autograd", S_CLI, id="cli-over-all"
        ),
        pytest.param(None, "autograd", "grad_and_value", "autograd", S_ENV, id="env-over-ini"),
        pytest.param(
            None, "grad_and_value", "autograd", "grad_and_value", S_ENV, id="env-over-ini-2"
        ),
        # An explicit auto on a higher source restores the backend default.
        pytest.param("auto", "grad_and_value", None, "autograd", "cpu default", id="cli-auto"),
        pytest.param(None, "auto", "grad_and_value", "autograd", "cpu default", id="env-auto"),
    ],
)
def test_strategy_sources_and_precedence(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    cli: str | None,
    env: str | None,
    ini: str | None,
    strategy: str,
    source: str,
) -> None:
    pytester.makepyfile(EXPECTING)
    args = _configure(pytester, monkeypatch, cli=cli, env=env, ini=ini, option="strategy")
    monkeypatch.setenv("EXPECT_BACKEND", "cpu")
    monkeypatch.setenv("EXPECT_STRATEGY", strategy)
    result = pytester.runpytest("--gradref-device=cpu", *args)
    result.stdout.fnmatch_lines([f"gradref: device=cpu (*) strategy={strategy} ({source})*"])
    result.assert_outcomes(passed=1)


def test_ini_key_in_pyproject(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml(
        """
[tool.pytest.ini_options]
gradref_device = "cpu"
gradref_strategy = "grad_and_value"
"""
    )
    pytester.makepyfile(
        """
import torch

def test_it(grad_reference, gradref_backend):
    assert gradref_backend.name == "cpu"
    assert grad_reference(lambda x: x.sum(), torch.ones(2)).strategy == "grad_and_value"
"""
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        [
            "gradref: device=cpu (*; from the gradref_device ini key in pyproject.toml) "
            "strategy=grad_and_value (from the gradref_strategy ini key in pyproject.toml)*"
        ]
    )
    result.assert_outcomes(passed=1)


def test_marker_strategy_beats_every_other_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeini("[pytest]\ngradref_strategy = crosscheck\n")
    monkeypatch.setenv("GRADREF_STRATEGY", "crosscheck")
    pytester.makepyfile(
        """
import pytest
import torch

def loss(x):
    return (x * x).sum()

@pytest.mark.gradref(strategy="autograd")
def test_marker_autograd(grad_reference):
    ref = grad_reference(loss, torch.randn(3))
    assert ref.strategy == "autograd"
    assert ref.crosscheck is None

def test_unmarked_follows_the_command_line(grad_reference):
    ref = grad_reference(loss, torch.randn(3))
    assert ref.strategy == "grad_and_value"
    assert ref.crosscheck is None

@pytest.mark.gradref(strategy="autograd")
class TestClassMarker:
    def test_inherits_the_class_marker(self, grad_reference):
        assert grad_reference(loss, torch.randn(3)).strategy == "autograd"

    @pytest.mark.gradref(strategy="crosscheck")
    def test_closest_marker_wins(self, grad_reference):
        ref = grad_reference(loss, torch.randn(3))
        assert ref.strategy == "autograd"  # crosscheck reports the backend default
        assert ref.crosscheck is not None

@pytest.mark.parametrize(
    "expected",
    [
        pytest.param("autograd", marks=pytest.mark.gradref(strategy="autograd")),
        pytest.param("grad_and_value", marks=pytest.mark.gradref(strategy="grad_and_value")),
    ],
)
def test_param_markers(grad_reference, expected):
    assert grad_reference(loss, torch.randn(3)).strategy == expected
"""
    )
    # The command line beats the environment and the ini key (both crosscheck here) and the
    # cpu default (autograd); the marker beats the command line.
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-strategy=grad_and_value")
    result.stdout.fnmatch_lines(
        ["gradref: device=cpu (*) strategy=grad_and_value (from the --gradref-strategy option)*"]
    )
    result.assert_outcomes(passed=6)


@pytest.mark.parametrize(
    ("args", "in_subprocess"),
    [
        # Resolved at configure time (a device asked for; torch already imported): the header.
        (["--gradref-device=cpu"], False),
        # Resolved once a collected test needs it (auto, torch not yet imported): after
        # collection.
        ([], True),
        # The controller resolves and prints; the workers print nothing.
        (["-n", "2"], False),
    ],
    ids=["configure", "after-collection", "xdist"],
)
def test_the_header_line_is_printed_once(
    pytester: pytest.Pytester, args: list[str], in_subprocess: bool
) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.parametrize("i", range(2))
def test_device(gradref_device, i):
    pass
"""
    )
    run = pytester.runpytest_subprocess if in_subprocess else pytester.runpytest
    result = run(*args)
    result.assert_outcomes(passed=2)
    headers = [line for line in result.stdout.lines if line.startswith("gradref: device=")]
    assert len(headers) == 1, result.stdout.str()


def test_auto_device_header_lists_unavailable_backends(pytester: pytest.Pytester) -> None:
    # A backend that auto tries first and that is never available: it must appear in the
    # header with its reason, whatever the machine (with or without a GPU).
    pytester.makeconftest(
        """
from pytest_gradref import Backend

def pytest_gradref_register_backends(registry):
    registry.register(
        Backend(name="widget", device_type="cpu", auto_rank=0, probe=lambda: "no widget plugged in")
    )
"""
    )
    pytester.makepyfile(
        """
import torch

def test_auto(gradref_backend, gradref_device):
    assert gradref_backend.name != "widget"
    assert gradref_device.type == gradref_backend.device_type
"""
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        [
            "gradref: device=* (*; auto: first available) strategy=* (* default)*"
            "| widget unavailable: no widget plugged in*"
        ]
    )
    result.assert_outcomes(passed=1)


def test_auto_in_a_fresh_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a fresh process torch is not loaded at configure time: auto is resolved lazily,
    once collection finds a gradref test, and the header still appears (after collection).
    Environment variables reach it like any user's shell would set them."""
    pytester.makepyfile(
        """
import torch

def test_auto(grad_reference, gradref_backend):
    ref = grad_reference(lambda x: (x * x).sum(), torch.randn(3))
    assert ref.strategy == "autograd"
    assert ref.backend == gradref_backend.name
"""
    )
    # autograd: the cheaper import (a torch.func transform pulls in torch._dynamo).
    monkeypatch.setenv("GRADREF_STRATEGY", "autograd")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # auto then reaches the cpu everywhere
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        [
            "collected 1 item",
            "gradref: device=* (*; auto: first available) "
            "strategy=autograd (from the GRADREF_STRATEGY environment variable)*",
        ]
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["gradref: device=cpu (*)*| cuda unavailable: *; npu unavailable: *"]
    )


def test_every_setting_is_read_once_into_one_object_with_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Configure reads and validates every gradref setting into the session's Settings; the
    # hooks, the fixtures and the plugin objects read it from there.
    from pytest_gradref.config.settings import (
        BASELINE_OPTION,
        OPTIONS,
        RANK_TIMEOUT_OPTION,
        SEED_OPTION,
        STRATEGY_OPTION,
        VERDICT_OPTION,
    )
    from pytest_gradref.config.state import state_key

    pytester.makeini(
        "[pytest]\ngradref_verdict = tolerance\ngradref_baseline_refresh = make baseline\n"
    )
    monkeypatch.setenv("GRADREF_RANK_TIMEOUT", "12.5")
    config = pytester.parseconfigure("--gradref-seed=off", "--gradref-strategy=crosscheck")
    settings = config.stash[state_key].settings
    assert set(settings.sources) == {spec.dest for spec in OPTIONS}
    assert (settings.seed, settings.source(SEED_OPTION)) == (None, "the --gradref-seed option")
    assert settings.strategy == "crosscheck"
    assert settings.source(STRATEGY_OPTION) == "the --gradref-strategy option"
    assert (settings.verdict, settings.source(VERDICT_OPTION)) == (
        "tolerance",
        "the gradref_verdict ini key in tox.ini",
    )
    assert (settings.rank_timeout, settings.source(RANK_TIMEOUT_OPTION)) == (
        12.5,
        "the GRADREF_RANK_TIMEOUT environment variable",
    )
    assert (settings.device.backend, settings.device.index) == (None, None)  # auto
    assert (settings.baseline, settings.source(BASELINE_OPTION)) == (None, "the default")
    # Which options hold their default is data on the settings, not read back from the text.
    assert settings.defaults == {spec.dest for spec in OPTIONS} - {
        SEED_OPTION.dest,
        STRATEGY_OPTION.dest,
        VERDICT_OPTION.dest,
        RANK_TIMEOUT_OPTION.dest,
    }
    assert not settings.is_default(VERDICT_OPTION)
    assert settings.baseline_threshold == 2.0
    assert settings.baseline_refresh == "make baseline"
    assert (settings.simulate, settings.simulate_numerics, settings.strict_device) == (
        None,
        "cpu",
        False,
    )


def test_a_value_is_parsed_by_what_it_is_not_by_where_it_came_from() -> None:
    # A parser decides on the value and on whether it is the default, never on the source's
    # words: a bad value is refused whatever its source is called, and each option's default
    # is an ordinary value of its own, parsed like one a user gives.
    from pytest_gradref.config.settings import (
        OPTIONS,
        VERDICT_OPTION,
        Setting,
        parse_verdict,
    )

    with pytest.raises(pytest.UsageError, match="Invalid gradref verdict 'bogus'"):
        parse_verdict(Setting("bogus", "the default"))
    assert parse_verdict(Setting("golden", "the GRADREF_VERDICT environment variable")) == (
        "golden"
    )
    settings_with_defaults = [spec for spec in OPTIONS if spec.ini]
    assert all(spec.default is not None for spec in settings_with_defaults)
    assert VERDICT_OPTION.full_help.endswith(" Default: golden.")


@pytest.mark.parametrize("option", ["--gradref-seed", "--gradref-verdict", "--gradref-threads"])
def test_auto_is_a_value_only_where_it_is_documented(
    pytester: pytest.Pytester, option: str
) -> None:
    # auto means "choose for me" for the device and the strategy; for the other settings it
    # is refused, the same for each, instead of standing for their default on some of them.
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(f"{option}=auto")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: Invalid gradref * 'auto' from the {option} option*"])
