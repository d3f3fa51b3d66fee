"""The simulated npu's Ascend numerics (``--gradref-simulate-numerics=ascend``): HF32 where
torch_npu documents it (pytest_gradref/devices/ascend_numerics.py cites the pages).

The rounding itself is tested in this process; everything that installs the simulation runs
in a subprocess, since the simulation is process-global.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _forked_runs import runpytest_forked

from pytest_gradref.devices import simulated
from pytest_gradref.devices.ascend_numerics import round_to_hf32

needs_simulation = pytest.mark.skipif(
    simulated.unsupported_reason() is not None, reason=str(simulated.unsupported_reason())
)

SIM = ("--gradref-simulate=npu", "--gradref-device=npu")
ASCEND = (*SIM, "--gradref-simulate-numerics=ascend")


# --- the rounding -------------------------------------------------------------------------


def _hf32(value: float) -> float:
    return float(round_to_hf32(torch.tensor([value], dtype=torch.float32))[0])


def test_hf32_keeps_eleven_mantissa_bits() -> None:
    ulp = 2.0**-11  # of HF32 at 1.0
    assert _hf32(1 + ulp) == 1 + ulp
    assert _hf32(1 + ulp / 2 - 2**-23) == 1.0  # below half an ulp: down
    assert _hf32(1 + ulp / 2 + 2**-23) == 1 + ulp  # above: up
    assert _hf32(-(1 + ulp / 2 + 2**-23)) == -(1 + ulp)  # the magnitude, whatever the sign


def test_hf32_ties_go_to_even() -> None:
    # SetHF32's default transMode 0: "rounding to the nearest even number when the distance is
    # equal" (ascend_numerics.py cites the page).
    ulp = 2.0**-11
    assert _hf32(1 + ulp / 2) == 1.0  # 1.0 is even
    assert _hf32(1 + 3 * ulp / 2) == 1 + 2 * ulp  # 1 + ulp is odd: up to the even one
    assert _hf32(-(1 + ulp / 2)) == -1.0


def test_hf32_has_float32_range() -> None:
    tiny = torch.finfo(torch.float32).tiny
    assert _hf32(tiny) == tiny
    assert _hf32(3e38) == pytest.approx(3e38, rel=2**-12)
    largest = float(torch.finfo(torch.float32).max)
    assert _hf32(largest) == math.inf  # rounds past the largest HF32, as IEEE rounding does
    assert _hf32(math.inf) == math.inf
    assert _hf32(-math.inf) == -math.inf
    assert math.isnan(_hf32(math.nan))
    # A NaN whose payload sits in the dropped bits stays NaN, not infinity.
    nan_low_payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(round_to_hf32(nan_low_payload)).all()


def test_hf32_error_is_half_an_ulp_of_eleven_bits() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    rounded = round_to_hf32(x)
    relative = ((rounded.double() - x.double()).abs() / x.double().abs()).max().item()
    assert 2**-13 < relative <= 2**-12
    assert torch.equal(round_to_hf32(rounded), rounded)  # HF32 values are fixed points


# --- the simulated operators --------------------------------------------------------------

# What the mode does to each operator, against CPU results computed by hand. Runs with
# --gradref-simulate-numerics=ascend.
OPERATORS = """
import pytest
import torch
import torch.nn.functional as F
import torch_npu

from pytest_gradref.devices.ascend_numerics import round_to_hf32

NPU = "npu:0"


@pytest.fixture
def restore_flags():
    yield
    torch_npu.npu.matmul.allow_hf32 = False
    torch_npu.npu.conv.allow_hf32 = True


def pair(*shape):
    cpu = torch.randn(*shape)
    return cpu, cpu.to(NPU)


def test_documented_defaults():
    # torch_npu: matmul.allow_hf32 defaults to False, conv.allow_hf32 to True.
    assert torch_npu.npu.matmul.allow_hf32 is False
    assert torch.npu.conv.allow_hf32 is True
    assert torch.npu.matmul is torch_npu.npu.matmul


def test_matmul_is_float32_until_allowed(restore_flags):
    a, a_npu = pair(8, 64)
    b, b_npu = pair(64, 16)
    assert torch.equal((a_npu @ b_npu).cpu(), a @ b)
    torch.npu.matmul.allow_hf32 = True
    hf32 = round_to_hf32(a) @ round_to_hf32(b)
    assert torch.equal((a_npu @ b_npu).cpu(), hf32)
    assert not torch.equal(hf32, a @ b)


def test_every_matmul_class_operator(restore_flags):
    torch.npu.matmul.allow_hf32 = True
    h = round_to_hf32
    m, m_npu = pair(6, 5)
    n, n_npu = pair(5, 4)
    bias, bias_npu = pair(6, 4)
    x, x_npu = pair(3, 6, 5)
    y, y_npu = pair(3, 5, 4)
    v, v_npu = pair(5)
    w, w_npu = pair(4, 5)
    cases = [
        (torch.mm(m_npu, n_npu), h(m) @ h(n)),
        (torch.bmm(x_npu, y_npu), torch.bmm(h(x), h(y))),
        # The bias is added to the product, not multiplied: it is not rounded.
        (torch.addmm(bias_npu, m_npu, n_npu), torch.addmm(bias, h(m), h(n))),
        (torch.baddbmm(bias_npu, x_npu, y_npu), torch.baddbmm(bias, h(x), h(y))),
        (torch.addbmm(bias_npu, x_npu, y_npu), torch.addbmm(bias, h(x), h(y))),
        (torch.mv(m_npu, v_npu), torch.mv(h(m), h(v))),
        (torch.addmv(bias_npu[:, 0], m_npu, v_npu), torch.addmv(bias[:, 0], h(m), h(v))),
        (F.linear(m_npu, w_npu, bias_npu[0]), F.linear(h(m), h(w), bias[0])),
        (torch.einsum("bij,bjk->bik", x_npu, y_npu), torch.bmm(h(x), h(y))),
    ]
    for on_npu, expected in cases:
        assert torch.equal(on_npu.cpu(), expected)
    # torch_npu's dot does not take the flag: it stays float32.
    assert torch.equal(torch.dot(v_npu, v_npu).cpu(), torch.dot(v, v))


def test_only_float32_is_rounded(restore_flags):
    torch.npu.matmul.allow_hf32 = True
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        a = torch.randn(8, 8, dtype=dtype)
        assert torch.equal((a.to(NPU) @ a.to(NPU)).cpu(), a @ a), dtype


def test_convolutions_are_hf32_by_default(restore_flags):
    x, x_npu = pair(2, 3, 20)
    w, w_npu = pair(5, 3, 4)
    b, b_npu = pair(5)
    hx, hw = round_to_hf32(x).requires_grad_(), round_to_hf32(w).requires_grad_()
    expected = F.conv1d(hx, hw, b)
    x_npu.requires_grad_()
    out = F.conv1d(x_npu, w_npu, b_npu)
    assert torch.equal(out.cpu(), expected)
    # Backward too: its convolution_backward gets a gradient of ones, which HF32 keeps.
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(x_npu.grad.cpu(), hx.grad)
    x_npu.requires_grad_(False)
    torch.npu.conv.allow_hf32 = False
    assert torch.equal(F.conv1d(x_npu, w_npu, b_npu).cpu(), F.conv1d(x, w, b))


def test_backward_matmuls_are_hf32_too(restore_flags):
    torch.npu.matmul.allow_hf32 = True
    a, a_npu = pair(8, 16)
    b, b_npu = pair(16, 4)
    a_npu.requires_grad_()
    (a_npu @ b_npu).sum().backward()
    assert torch.equal(a_npu.grad.cpu(), round_to_hf32(torch.ones(8, 4)) @ round_to_hf32(b.T))


def test_the_flags_take_booleans():
    with pytest.raises(TypeError, match="allow_hf32 takes True or False, got 1"):
        torch.npu.matmul.allow_hf32 = 1


def test_autograd_and_grad_and_value_agree_bit_for_bit(restore_flags):
    # The documented model rounds an operator's operands; both strategies run the same
    # operators on the same operands, so it cannot make them differ.
    torch.npu.matmul.allow_hf32 = True
    x, x_npu = pair(2, 3, 20)
    w, w_npu = pair(16, 5 * 17)
    conv, conv_npu = pair(5, 3, 4)

    def f(x, conv, w):
        return F.linear(F.conv1d(x, conv).flatten(1), w).logsumexp(-1).sum()

    args = [t.clone().requires_grad_() for t in (x_npu, conv_npu, w_npu)]
    value = f(*args)
    grads = torch.autograd.grad(value, args)
    func_grads, func_value = torch.func.grad_and_value(f, argnums=(0, 1, 2))(
        x_npu, conv_npu, w_npu
    )
    assert torch.equal(value.cpu(), func_value.cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(grads, func_grads))
    assert not torch.equal(value.cpu(), f(x, conv, w))  # and HF32 did apply
"""


@needs_simulation
def test_the_ascend_numerics_of_the_simulated_operators(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(OPERATORS)
    result = runpytest_forked(pytester, *ASCEND, "-p", "no:randomly")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(
        [
            "gradref: device=npu:0 (simulated on CPU; *) * | simulated numerics: ascend "
            "(float32 matmul-class operators in HF32 while torch.npu.matmul.allow_hf32, "
            "default False; convolutions while torch.npu.conv.allow_hf32, default True; *) "
            "| simulated: torch.compile runs *",
        ]
    )


# --- the tolerance edge -------------------------------------------------------------------

# A suite as a kernel library writes it: float32 kernels whose matmul and convolution run on
# the device's matrix unit, checked against plain references written as products and sums
# (no matmul-class operator), by grad_reference with the default settings. Its conftest turns
# HF32 matmuls on where torch_npu is in use, as suites set torch.backends.cuda.matmul.allow_tf32.
EDGE_CONFTEST = """
import pytest
import torch


@pytest.fixture(autouse=True)
def hf32_matmuls():
    npu = getattr(torch, "npu", None)
    if npu is not None:
        npu.matmul.allow_hf32 = True
"""

EDGE = """
import torch
import torch.nn.functional as F


def logits_kernel(x, w):
    return torch.logsumexp(x @ w, dim=-1).sum()


def logits_reference(x, w):
    return torch.logsumexp((x.unsqueeze(-1) * w).sum(-2), dim=-1).sum()


def conv_kernel(x, w):
    return F.conv1d(x, w).tanh().sum()


def conv_reference(x, w):
    windows = x.unfold(-1, w.shape[-1], 1)  # (batch, channels, positions, width)
    out = (windows.unsqueeze(1) * w[None, :, :, None, :]).sum((2, 4))
    return out.tanh().sum()


def check(grad_reference, kernel, reference, x, w):
    ref = grad_reference(reference, x, w, argnums=(0, 1))
    x_kernel, w_kernel = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = kernel(x_kernel, w_kernel)
    loss.backward()
    ref.assert_close(loss, [x_kernel.grad, w_kernel.grad])


def test_logits(grad_reference, gradref_device):
    x = torch.randn(16, 64, device=gradref_device)
    w = torch.randn(64, 32, device=gradref_device)
    check(grad_reference, logits_kernel, logits_reference, x, w)


def test_conv(grad_reference, gradref_device):
    x = torch.randn(4, 8, 32, device=gradref_device)
    w = torch.randn(6, 8, 5, device=gradref_device)
    check(grad_reference, conv_kernel, conv_reference, x, w)
"""


def _edge(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(EDGE_CONFTEST)
    pytester.makepyfile(EDGE)
    return runpytest_forked(pytester, *args, "-p", "no:randomly")


@pytest.mark.parametrize(
    "args",
    [pytest.param((), id="cpu"), pytest.param(SIM, id="simulated-npu-cpu-numerics")],
    # the simulated npu's runs need torch 2.10
)
def test_hf32_kernels_pass_where_matmuls_are_float32(
    pytester: pytest.Pytester, args: tuple[str, ...]
) -> None:
    if args and simulated.unsupported_reason() is not None:
        pytest.skip(str(simulated.unsupported_reason()))
    result = _edge(pytester, *args)
    result.assert_outcomes(passed=2)
    if args:
        result.stdout.fnmatch_lines(["gradref: * | simulated numerics: cpu (*) | simulated: *"])


@needs_simulation
def test_hf32_kernels_fail_at_the_tolerance_edge_under_ascend_numerics(
    pytester: pytest.Pytester,
) -> None:
    result = _edge(pytester, *ASCEND, "--gradref-report=r.json")
    # The same float32 kernels, their matmul and convolution in HF32 as on an Ascend A2 with
    # matmul.allow_hf32 set (and conv.allow_hf32 at its default): their gradients are off by
    # HF32's 2**-12, far past what float32 allows the kernel against its float32 reference.
    result.assert_outcomes(failed=2)
    # The report says which numerics the errors are of, so a diff does not gate them against
    # a run of the CPU's.
    report = json.loads((pytester.path / "r.json").read_text())
    assert (report["simulated"], report["simulated_numerics"]) == (True, "ascend")
    result.stdout.fnmatch_lines(
        [
            "*test_logits*",
            "E * items differ",
            "E * gradient of argument 0 (x):",
            "E * greatest error vs the float64 golden: * the float32 reference's own *",
            "*test_conv*",
            "E * 3 of 3 items differ",
        ]
    )


# --- the setting --------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_ascend_numerics_need_the_simulated_npu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    # Rejected before anything is installed, so an in-process run is safe.
    pytester.makepyfile("def test_nothing():\n    pass\n")
    args: list[str] = []
    if source == "cli":
        args, where = (
            ["--gradref-simulate-numerics=ascend"],
            "the --gradref-simulate-numerics option",
        )
    elif source == "env":
        monkeypatch.setenv("GRADREF_SIMULATE_NUMERICS", "ascend")
        where = "the GRADREF_SIMULATE_NUMERICS environment variable"
    else:
        pytester.makeini("[pytest]\ngradref_simulate_numerics = ascend\n")
        where = "the gradref_simulate_numerics ini key in tox.ini"
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: gradref simulate numerics 'ascend' from {where} models the simulated npu's "
            "operators: add --gradref-simulate=npu, or drop --gradref-simulate-numerics (and "
            "unset GRADREF_SIMULATE_NUMERICS)"
        ]
    )


def test_unknown_numerics_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--gradref-simulate=npu", "--gradref-simulate-numerics=910b")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: Invalid gradref simulate numerics '910b' from the "
            "--gradref-simulate-numerics option; valid values are cpu, ascend"
        ]
    )
