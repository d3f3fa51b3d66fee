"""grad_reference and Reference: plain functions and modules, has_aux, argnums, crosscheck,
no mutation of the caller's tensors or modules, and the inputs it must reject.

Each generated test runs under both strategies (and crosscheck) through a parametrized
``gradref(strategy=...)`` marker, and asserts which one ran on ``Reference.strategy``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _pytester_sources import OLD_STYLE_SQUARE

# Prepended to every generated file: STRATEGIES parametrizes a test over the three strategies.
PRELUDE = """
import pytest
import torch

STRATEGIES = [
    pytest.param(s, marks=pytest.mark.gradref(strategy=s), id=s)
    for s in ("autograd", "grad_and_value", "crosscheck")
]


def ran(ref, strategy):
    # crosscheck reports the backend default (autograd on cpu).
    return ref.strategy == ("autograd" if strategy == "crosscheck" else strategy)
"""


def _run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(PRELUDE + body)
    return pytester.runpytest("--gradref-device=cpu", *args)


def test_plain_function_argnums_int_and_tuple(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
def loss(x, w, scale):
    return (torch.tanh(x @ w) * scale).square().sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_argnums(grad_reference, strategy):
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww, 0.5)
    out.backward()

    one = grad_reference(loss, x, w, 0.5)  # argnums=0 by default: one tensor
    assert ran(one, strategy)
    assert isinstance(one.grads, torch.Tensor)
    torch.testing.assert_close(one.value, out.detach())
    torch.testing.assert_close(one.grads, xx.grad)
    one.assert_close(out, xx.grad)

    second = grad_reference(loss, x, w, 0.5, argnums=1)
    assert isinstance(second.grads, torch.Tensor)
    torch.testing.assert_close(second.grads, ww.grad)

    both = grad_reference(loss, x, w, 0.5, argnums=(0, 1))
    assert isinstance(both.grads, tuple) and len(both.grads) == 2
    torch.testing.assert_close(both.grads[0], xx.grad)
    torch.testing.assert_close(both.grads[1], ww.grad)
    both.assert_close(out, (xx.grad, ww.grad))

    single = grad_reference(loss, x, w, 0.5, argnums=(1,))
    assert isinstance(single.grads, tuple) and len(single.grads) == 1
    torch.testing.assert_close(single.grads[0], ww.grad)

    reordered = grad_reference(loss, x, w, 0.5, argnums=(1, -3))
    torch.testing.assert_close(reordered.grads[0], ww.grad)
    torch.testing.assert_close(reordered.grads[1], xx.grad)
    assert reordered.grad_labels == ("gradient of argument 1 (w)", "gradient of argument 0 (x)")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keyword_arguments_pass_through(grad_reference, strategy):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(lambda t, *, power: t.abs().pow(power).sum(), x, power=3)
    assert ran(ref, strategy)
    torch.testing.assert_close(ref.grads, 3 * x.abs().pow(2) * x.sign())
""",
    )
    result.assert_outcomes(passed=6)


def test_has_aux(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_has_aux(grad_reference, strategy):
    x = torch.randn(4)

    def loss(t):
        return (t * t).sum(), {"doubled": 2 * t, "terms": (t * t,)}

    ref = grad_reference(loss, x, has_aux=True)
    assert ran(ref, strategy)
    torch.testing.assert_close(ref.value, (x * x).sum())
    torch.testing.assert_close(ref.grads, 2 * x)
    torch.testing.assert_close(ref.aux["doubled"], 2 * x)
    torch.testing.assert_close(ref.aux["terms"][0], x * x)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_aux_means_none(grad_reference, strategy):
    ref = grad_reference(lambda t: t.sum(), torch.randn(3))
    assert ref.aux is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_has_aux_needs_a_pair(grad_reference, strategy):
    pair = r"has_aux=True needs .* to return a \\(loss, aux\\) pair, it returned a Tensor"
    with pytest.raises(TypeError, match=pair):
        grad_reference(lambda t: t.sum(), torch.randn(3), has_aux=True)
    three = (
        r"it returned 3 elements and needs 2; return \\(loss, \\(out\\[1\\], out\\[2\\],\\)\\) "
        "to pass the rest as one aux"
    )
    with pytest.raises(TypeError, match=three):
        grad_reference(lambda t: (t.sum(), t.max(), t.min()), torch.randn(3), has_aux=True)
    # Without has_aux a tuple of tensors is a tuple of outputs; a loss-only check says so.
    hint = "compute the reference with has_aux=True: the rest of the tuple is then auxiliary"
    x = torch.randn(3)
    ref = grad_reference(lambda t: (t.sum(), t), x)
    with pytest.raises(TypeError, match=hint):
        ref.assert_close(x.sum(), torch.ones(3))
    # A tuple with something else than tensors is no tuple of outputs.
    with pytest.raises(TypeError, match="pass has_aux=True if the rest of the tuple is aux"):
        grad_reference(lambda t: (t.sum(), 3), x)
""",
    )
    result.assert_outcomes(passed=9)


def test_aux_with_non_tensor_leaves(pytester: pytest.Pytester) -> None:
    # has_aux is documented for any auxiliary output. Under autograd a step count or a string
    # in aux is fine; under grad_and_value too, or a test that passes on CPU breaks on NPU.
    result = _run(
        pytester,
        """
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_aux_with_an_int(grad_reference, strategy):
    x = torch.randn(3)
    ref = grad_reference(lambda t: ((t * t).sum(), {"rows": 3, "name": "jsd"}), x, has_aux=True)
    assert ran(ref, strategy)
    assert ref.aux == {"rows": 3, "name": "jsd"}
""",
    )
    result.assert_outcomes(passed=3)


MODULE = """
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, target):
        return ((self.head(torch.tanh(self.proj(x))) * self.scale - target) ** 2).mean()

"""


def test_modules(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        MODULE
        + """
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_param_grads(grad_reference, strategy):
    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    target = torch.randn(5, 2, dtype=torch.float64)
    ref = grad_reference(net, x, target)
    assert ran(ref, strategy)
    assert sorted(ref.param_grads) == ["head.weight", "proj.bias", "proj.weight"]
    assert all(p.grad is None for p in net.parameters())  # nothing written yet

    xx = x.clone().requires_grad_()
    out = net(xx, target)
    out.backward()
    for name, param in net.named_parameters():
        torch.testing.assert_close(ref.param_grads[name], param.grad)
    torch.testing.assert_close(ref.grads, xx.grad)
    ref.assert_close(out, xx.grad, param_grads=net)
    ref.assert_close(out, xx.grad, param_grads={n: p.grad for n, p in net.named_parameters()})
    if strategy == "crosscheck":
        labels = [d.label for d in ref.crosscheck]
        assert labels == [
            "value",
            "gradient of argument 0 (x)",
            "gradient of parameter 'proj.weight'",
            "gradient of parameter 'proj.bias'",
            "gradient of parameter 'head.weight'",
        ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_parameters_only(grad_reference, strategy):
    net = Net()
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ref = grad_reference(net, x, target, argnums=())
    assert ran(ref, strategy)
    assert ref.grads == ()
    assert sorted(ref.param_grads) == ["head.weight", "proj.bias", "proj.weight"]
    out = net(x, target)
    out.backward()
    ref.assert_close(out, (), param_grads=net)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_get_no_gradient(grad_reference, strategy):
    net = Net()
    net.proj.weight.requires_grad_(False)
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ref = grad_reference(net, x, target)
    assert sorted(ref.param_grads) == ["head.weight", "proj.bias"]
    assert net.proj.weight.requires_grad is False
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_param_grads_are_required_by_assert_close(grad_reference, strategy):
    net = Net()
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ref = grad_reference(net, x, target)
    out = net(x, target)
    with pytest.raises(TypeError, match="holds gradients for the module's parameters"):
        ref.assert_close(out, torch.zeros_like(x))
    with pytest.raises(ValueError, match="param_grads lacks head.weight"):
        partial = {"proj.weight": None, "proj.bias": None}
        ref.assert_close(out, torch.zeros_like(x), param_grads=partial)
""",
    )
    result.assert_outcomes(passed=12)


def test_crosscheck(pytester: pytest.Pytester, npu_on_cpu: Callable[[str], None]) -> None:
    npu_on_cpu("")
    pytester.makepyfile(
        """
import torch

def loss(x, w):
    return torch.log_softmax(x @ w, dim=-1).square().mean()

def test_crosscheck(grad_reference, gradref_backend):
    x, w = torch.randn(8, 5), torch.randn(5, 7)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.strategy == gradref_backend.default_strategy
    assert [d.label for d in ref.crosscheck] == [
        "value", "gradient of argument 0 (x)", "gradient of argument 1 (w)"
    ]
    for d in ref.crosscheck:
        assert d.dtype == "float32"
        assert 0 <= d.max_abs < 1e-5 and 0 <= d.max_rel < 1e-4
        assert not d.exceeds_tolerance
        assert "torch.testing's default for float32" in d.tolerance
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    ref.assert_close(out, (xx.grad, ww.grad))
"""
    )
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-strategy=crosscheck")
    result.stdout.fnmatch_lines(
        ["gradref: device=cpu (*) strategy=crosscheck (from the --gradref-strategy option)*"]
    )
    result.assert_outcomes(passed=1)
    # Under the npu policy crosscheck reports grad_and_value, the npu default.
    result = pytester.runpytest("--gradref-device=npu", "--gradref-strategy=crosscheck")
    result.assert_outcomes(passed=1)


def test_no_mutation_of_the_callers_tensors(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensors_untouched(grad_reference, strategy):
    leaf = torch.randn(4, requires_grad=True)
    plain = torch.randn(4)
    with_grad = torch.randn(4, requires_grad=True)
    with_grad.grad = torch.full((4,), 7.0)
    base = torch.randn(4, requires_grad=True)
    non_leaf = base * 2
    before = [t.detach().clone() for t in (leaf, plain, with_grad, non_leaf)]

    def loss(a, b, c, d):
        return (a * b * c * d).sum()

    ref = grad_reference(loss, leaf, plain, with_grad, non_leaf, argnums=(0, 1, 2, 3))
    assert ran(ref, strategy)
    assert leaf.grad is None and leaf.requires_grad
    assert plain.grad is None and not plain.requires_grad
    assert torch.equal(with_grad.grad, torch.full((4,), 7.0))
    assert base.grad is None and non_leaf.grad_fn is not None
    for tensor, old in zip((leaf, plain, with_grad, non_leaf), before):
        assert torch.equal(tensor.detach(), old)
    for grad in ref.grads:
        assert not grad.requires_grad and grad.grad_fn is None
    assert not ref.value.requires_grad


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_untouched(grad_reference, strategy):
    net = torch.nn.Linear(3, 2)
    net.bias.requires_grad_(False)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    ref = grad_reference(_Sum(net), torch.randn(4, 3))
    assert ran(ref, strategy)
    assert net.weight.grad is None and net.bias.grad is None
    assert net.weight.requires_grad and not net.bias.requires_grad
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), params[n])
    assert net.training


class _Sum(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum()
""",
    )
    result.assert_outcomes(passed=6)


def test_batchnorm_running_stats_untouched(pytester: pytest.Pytester) -> None:
    # A module in training mode updates its running statistics on every forward: the
    # reference must compute on copies, under both strategies.
    result = _run(
        pytester,
        """
class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.proj(x)).square().sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batchnorm(grad_reference, strategy):
    net = Normed()
    stats = {n: b.clone() for n, b in net.named_buffers()}
    x = torch.randn(6, 4)
    ref = grad_reference(net, x)
    assert ran(ref, strategy)
    for n, b in net.named_buffers():
        assert torch.equal(b, stats[n]), n
    assert all(p.grad is None for p in net.parameters())
    xx = x.clone().requires_grad_()
    out = net(xx)
    out.backward()
    ref.assert_close(out, xx.grad, param_grads=net)
""",
    )
    result.assert_outcomes(passed=3)


def test_input_that_does_not_influence_the_loss_gets_zeros(pytester: pytest.Pytester) -> None:
    # Documented choice: a zero gradient (its true value) under both strategies.
    result = _run(
        pytester,
        """
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unused_input(grad_reference, strategy):
    x, unused = torch.randn(3), torch.randn(2, 5)
    ref = grad_reference(lambda a, b: (a * a).sum(), x, unused, argnums=(0, 1))
    assert ran(ref, strategy)
    torch.testing.assert_close(ref.grads[0], 2 * x)
    assert torch.equal(ref.grads[1], torch.zeros(2, 5))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_constant_loss(grad_reference, strategy):
    x = torch.randn(3)
    ref = grad_reference(lambda a: torch.tensor(1.5), x)
    assert ran(ref, strategy)
    assert torch.equal(ref.value, torch.tensor(1.5))
    assert torch.equal(ref.grads, torch.zeros(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unused_module_parameter(grad_reference, strategy):
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Parameter(torch.ones(3))
            self.spare = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return (self.used * x).sum()

    ref = grad_reference(Partial(), torch.randn(3))
    assert torch.equal(ref.param_grads["spare"], torch.zeros(2))
""",
    )
    result.assert_outcomes(passed=9)


BAD_INPUTS = """
def loss(x, w):
    return (x * w).sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_argnums_out_of_range(grad_reference, strategy):
    x, w = torch.randn(3), torch.randn(3)
    message = (
        r"argnums=2 is out of range: loss was given 2 positional argument\\(s\\), "
        r"so valid indices are 0..1 \\(or negative\\)"
    )
    with pytest.raises(ValueError, match=message):
        grad_reference(loss, x, w, argnums=2)
    with pytest.raises(ValueError, match="argnums=-3 is out of range"):
        grad_reference(loss, x, w, argnums=(0, -3))
    with pytest.raises(ValueError, match="argnums names argument 1 twice"):
        grad_reference(loss, x, w, argnums=(1, -1))
    # argnums=() on a function: a value-only reference.
    assert grad_reference(loss, x, w, argnums=()).grads == ()
    with pytest.raises(TypeError, match="argnums must be an int or a tuple of ints, got '0'"):
        grad_reference(loss, x, w, argnums="0")
    with pytest.raises(TypeError, match="argnums entries must be ints, got 0.0"):
        grad_reference(loss, x, w, argnums=(0.0,))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_argnums_at_a_non_tensor(grad_reference, strategy):
    message = (
        "argnums=1 points at argument 1, a float; "
        "gradients need a floating-point torch.Tensor there"
    )
    with pytest.raises(TypeError, match=message):
        grad_reference(loss, torch.randn(3), 2.0, argnums=1)
    with pytest.raises(TypeError, match="argnums=1 points at argument 1, a list"):
        grad_reference(loss, torch.randn(3), [1.0, 2.0, 3.0], argnums=(0, 1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_argnums_at_an_integer_tensor(grad_reference, strategy):
    labels = torch.tensor([0, 2, 1])
    message = (
        "argnums=1 points at argument 1, a torch.int64 tensor; only floating-point and "
        "complex tensors have gradients, so leave it out of argnums"
    )
    with pytest.raises(TypeError, match=message):
        grad_reference(loss, torch.randn(3), labels, argnums=1)
    with pytest.raises(TypeError, match="a torch.bool tensor"):
        grad_reference(loss, torch.ones(3, dtype=torch.bool), torch.randn(3))
    # Left out of argnums, an integer tensor is just data.
    ref = grad_reference(lambda x, idx: x[idx].sum(), torch.randn(3), labels)
    assert torch.equal(ref.grads, torch.tensor([1.0, 1.0, 1.0]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_tensor_output_takes_a_cotangent(grad_reference, strategy):
    # Its gradients are the vector-Jacobian product with the cotangent the reference drew.
    ref = grad_reference(lambda x: x * 2, torch.randn(3))
    assert ref.cotangent.shape == (3,)
    torch.testing.assert_close(ref.grads, 2 * ref.cotangent)
    # One element is a scalar: the value comes back 0-dim.
    ref = grad_reference(lambda x: x.sum().reshape(1, 1), torch.randn(3))
    assert ref.value.shape == ()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_tensor_loss(grad_reference, strategy):
    def as_float(x):
        return float(x.sum())

    message = r"as_float must return a tensor \\(a loss, or an output .*\\), it returned float"
    with pytest.raises(TypeError, match=message):
        grad_reference(as_float, torch.randn(3))
    with pytest.raises(TypeError, match="returned a torch.int64 output; it must be floating-point"):
        grad_reference(lambda x: (x > 0).sum(), torch.randn(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_not_callable(grad_reference, strategy):
    with pytest.raises(TypeError, match="grad_reference needs a callable or nn.Module first"):
        grad_reference(torch.randn(3), torch.randn(3))
"""


def test_bad_inputs(pytester: pytest.Pytester) -> None:
    result = _run(pytester, BAD_INPUTS)
    result.assert_outcomes(passed=18)


FUNCTION_WITHOUT_SETUP_CONTEXT = (
    OLD_STYLE_SQUARE
    + """


def loss(x):
    return Square.apply(x).sum()


def test_grad_and_value_explains_the_fix(grad_reference):
    with pytest.raises(RuntimeError) as failure:
        grad_reference(loss, torch.randn(3))
    message = str(failure.value)
    assert "grad_and_value cannot differentiate loss" in message
    assert "torch.autograd.Function that has no setup_context staticmethod" in message
    assert "@pytest.mark.gradref(strategy='autograd')" in message


@pytest.mark.gradref(strategy="autograd")
def test_the_suggested_marker_works(grad_reference):
    x = torch.randn(3)
    ref = grad_reference(loss, x)
    assert ref.strategy == "autograd"
    torch.testing.assert_close(ref.grads, 2 * x)
"""
)


def test_autograd_function_without_setup_context(
    pytester: pytest.Pytester, npu_on_cpu: Callable[[str], None]
) -> None:
    # The realistic case: the npu policy, whose default is grad_and_value.
    npu_on_cpu("")
    pytester.makepyfile(FUNCTION_WITHOUT_SETUP_CONTEXT)
    pytester.runpytest("--gradref-device=npu").assert_outcomes(passed=2)
    # The same through the command line on cpu, and under crosscheck, which runs both.
    pytester.runpytest("--gradref-device=cpu", "--gradref-strategy=grad_and_value").assert_outcomes(
        passed=2
    )
    pytester.runpytest("--gradref-device=cpu", "--gradref-strategy=crosscheck").assert_outcomes(
        passed=2
    )
