"""The crosscheck's verdict is assert_close's: its items are judged by the same check_items,
in the promoted dtype near the limit, with one host read for all of a reference's items.

The crosscheck's summaries and report records are tested in test_report_and_seeds.py."""

from __future__ import annotations

import pytest
from _pytester_sources import HOST_READS_FIXTURE

AT_THE_LIMIT = """
import itertools

import pytest
import torch

RTOL, ATOL = 1.6e-2, 1e-5  # torch.testing's bfloat16 tolerance, the cpu backend's too


def pairs():
    \"\"\"bfloat16 pairs (received, checked against) a few rounding steps apart around the
    tolerance's limit: those where isclose in float64 and isclose in bfloat16 (torch.testing's,
    the promoted dtype) part, and some where they agree.\"\"\"
    expected = torch.randn(20000, generator=torch.Generator().manual_seed(1)).bfloat16()
    actual, parting, agreeing = expected, [], []
    for _ in range(16):
        actual = torch.nextafter(actual, actual * 2)
        close = torch.isclose(actual, expected, rtol=RTOL, atol=ATOL)
        wide = torch.isclose(actual.double(), expected.double(), rtol=RTOL, atol=ATOL)
        used = (actual.double() - expected.double()).abs() / (ATOL + RTOL * expected.double().abs())
        near = (close == wide) & ((used - 1).abs() < 0.05)
        parting += [(actual[i], expected[i]) for i in (close != wide).nonzero()[:, 0]]
        agreeing += [(actual[i], expected[i]) for i in near.nonzero()[:2, 0]]
    assert len(parting) >= 8 and len(agreeing) >= 8
    return parting + agreeing


PAIRS = pairs()
X = torch.ones(3, dtype=torch.float64)


def test_judged_as_assert_close_judges(grad_reference):
    calls = itertools.count()

    def fn(x):
        # autograd runs first: the cpu default, whose result the test receives
        n = next(calls)
        return (x * x).sum(), [pair[n] for pair in PAIRS]

    ref = grad_reference(fn, X, has_aux=True)
    assert ref.strategy == "autograd"
    found = {d.label: d for d in ref.crosscheck}
    exceeding = set()
    for i, (received, other) in enumerate(PAIRS):
        d = found[f"aux[{i}]"]
        assert d.dtype == "bfloat16"
        assert d.tolerance == "rtol=0.016, atol=1e-05 from torch.testing's default for bfloat16"
        try:
            torch.testing.assert_close(received, other, rtol=RTOL, atol=ATOL)
        except AssertionError:
            assert d.exceeds_tolerance, (received, other)
            exceeding.add(d.label)
        else:
            assert not d.exceeds_tolerance, (received, other)
    assert not found["value"].exceeds_tolerance
    assert 0 < len(exceeding) < len(PAIRS)

    # Reference.assert_close of the received results against a reference of the others
    # fails on the same items.
    reference = grad_reference(lambda x: ((x * x).sum(), [p[1] for p in PAIRS]), X, has_aux=True)
    received = [p[0] for p in PAIRS]
    failed = set()
    try:
        reference.assert_close((X * X).sum(), 2 * X, aux=received)
    except AssertionError as error:
        failed = {line[2:-1] for line in str(error).splitlines() if line.startswith("- aux[")}
    assert failed == exceeding
"""


def test_crosscheck_judges_an_item_as_assert_close_does(pytester: pytest.Pytester) -> None:
    # bfloat16 results a few rounding steps apart at the tolerance's limit: the crosscheck once
    # judged them by isclose in float64, which parts from assert_close's verdict there (it
    # said "beyond tolerance" where assert_close passes); now check_items judges both.
    pytester.makepyfile(AT_THE_LIMIT)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-strategy=crosscheck")
    result.assert_outcomes(passed=1)


HOST_READS = (
    HOST_READS_FIXTURE
    + """

def loss(x, w):
    return torch.log_softmax(x @ w.T, dim=-1).square().sum()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(6, 2)

    def forward(self, x):
        out = self.b(torch.tanh(self.a(x)))
        return out.square().sum(), {"out": out, "norms": (out.norm(), x.norm())}


def test_three_items(grad_reference, host_reads):
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    host_reads[0] = 0
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert host_reads[0] <= 1
    assert len(ref.crosscheck) == 3


def test_module_and_aux_items(grad_reference, host_reads):
    net, x = Net(), torch.randn(5, 8)
    host_reads[0] = 0
    ref = grad_reference(net, x, has_aux=True)
    assert host_reads[0] <= 1
    assert len(ref.crosscheck) == 9  # value, x, four parameters, three aux leaves
    assert not any(d.exceeds_tolerance for d in ref.crosscheck)
"""
)


@pytest.mark.parametrize("verdict", ["golden", "tolerance"])
def test_a_crosschecked_reference_reads_the_host_once(
    pytester: pytest.Pytester, verdict: str
) -> None:
    # Both strategies' results, the aux's leaves among them, judged with one host read (one
    # sync on an accelerator), as a passing assert_close is; it was three per item.
    pytester.makepyfile(HOST_READS)
    result = pytester.runpytest(
        "--gradref-device=cpu", "--gradref-strategy=crosscheck", f"--gradref-verdict={verdict}"
    )
    result.assert_outcomes(passed=2)
