"""Messages that point the right way: a gradient left None, a reference without gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from _verdict_calls import failure, reference

from pytest_gradref import GoldenPrecisionWarning, ZeroGradientWarning

ASKED = "was the input a leaf with requires_grad=True, and did backward() reach it?"


def exp_sum(t: torch.Tensor) -> torch.Tensor:
    return t.exp().sum()


@pytest.mark.parametrize("form", ["tensor", "tuple"])
def test_a_none_gradient_names_the_item_and_asks_why(form: str) -> None:
    x = torch.randn(4)  # the kernel's leaf, without requires_grad_()
    ref = reference(exp_sum, x)
    grads = x.grad if form == "tensor" else (x.grad,)
    if form == "tensor":
        # x.grad is None: indistinguishable from no gradients given, and both are said.
        with pytest.raises(TypeError) as raised:
            ref.assert_close(x.exp().sum(), grads)
        message = str(raised.value)
        assert "actual_grads is None" in message
    else:
        message = failure(ref, x.exp().sum(), grads)
    assert "gradient of argument 0 (t)" in message
    assert ASKED in message


def test_a_reference_without_gradients_warns_of_its_zeros() -> None:
    x = torch.randn(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = reference(lambda t: t.argmax().float(), x)
        ref.assert_close(x.argmax().float(), torch.zeros(8))
    found = [w for w in caught if issubclass(w.category, ZeroGradientWarning)]
    assert len(found) == 1
    assert "gradient of argument 0 (t) is zero everywhere, and so is its golden's" in str(
        found[0].message
    )
    assert found[0].filename == __file__  # attributed to the test's line
    # Not blamed on a cast.
    assert not [w for w in caught if issubclass(w.category, GoldenPrecisionWarning)]


def test_a_gradient_that_is_zero_somewhere_is_no_warning() -> None:
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroGradientWarning)
        ref = reference(lambda t: t.relu().sum(), x)
        ref.assert_close(x.relu().sum(), (x > 0).float())
