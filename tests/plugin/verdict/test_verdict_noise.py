"""The default verdict against rounding noise and systematic errors.

- No red from summation order: a kernel that sums in another order draws its own rounding
  error, and where an item cancels (a sum of large terms near zero) the ratio of its error to
  the reference's is unbounded; the rounding spread (spread.py: randomly rounded runs of the
  reference) is what such an item is judged against.
- No green on a systematic error: a 1% scale or bias of a half-precision gradient hides under
  a normwise budget, since the bf16 reference's own normwise error is as large, but not from
  the error's least-squares components along the golden and along a constant.
- A golden in float64 whatever the reference casts to (golden.PromoteToGolden).

The cases call ``compute_reference`` as the ``grad_reference`` fixture does under the default
verdict (test_verdict.reference).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from _verdict_calls import failure, reference

from pytest_gradref import GoldenPrecisionWarning
from pytest_gradref.reference.spread import RUNS, RandomRounding
from pytest_gradref.verdict.budget_criteria import spread_factor

# --- no red from summation order ------------------------------------------------------------


def logits_inputs(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (512, 64) and w (2048, 64) whose rows of logits x @ w.T sum to about zero, as logits
    centred over the vocabulary do."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=gen)
    w = torch.randn(2048, 64, generator=gen)
    return x.to(dtype), (w - w.mean(0)).to(dtype)


def logits_loss(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A loss with the logits' sum and mean as aux, as preference losses return them."""
    logits = x @ w.T
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(wide, dim=-1).mean(), (logits.sum(), logits.mean())


def chunked_kernel(
    x: torch.Tensor, w: torch.Tensor, chunk: int = 64
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """logits_loss chunk by chunk: the same function, its sums in another order."""
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = torch.zeros((), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32)
    for start in range(0, x.shape[0], chunk):
        logits = xs[start : start + chunk] @ ws.T
        loss = loss + torch.logsumexp(logits.float(), dim=-1).sum() / x.shape[0]
        total = total + logits.detach().float().sum()
    loss.backward()
    assert xs.grad is not None
    assert ws.grad is not None
    count = x.shape[0] * w.shape[0]
    return loss, (xs.grad, ws.grad), (total.to(x.dtype), (total / count).to(x.dtype))


def split_k_kernel(
    x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """logits_loss with the aux's logits blocked along the hidden dimension (split-K, each
    half's product rounded in the inputs' dtype): another blocking, on every host."""
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss, _ = logits_loss(xs, ws)
    loss.backward()
    assert xs.grad is not None
    assert ws.grad is not None
    half = x.shape[1] // 2
    logits = x[:, :half] @ w[:, :half].T + x[:, half:] @ w[:, half:].T
    total = logits.sum(dtype=torch.float64)
    return loss, (xs.grad, ws.grad), (total.to(x.dtype), (total / logits.numel()).to(x.dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sums_in_another_order_pass_at_any_thread_count(dtype: torch.dtype, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        consulted = 0
        for seed in range(12):
            x, w = logits_inputs(seed, dtype)
            for kernel in (chunked_kernel, split_k_kernel):
                ref = reference(logits_loss, x, w, argnums=(0, 1), has_aux=True)
                loss, grads, aux = kernel(x, w)
                ref.assert_close(loss, grads, aux=aux, check_dtype=False)
                assert ref.golden is not None
                assert ref.golden.spread is not None
                consulted += bool(ref.golden.spread.ran)
    finally:
        torch.set_num_threads(before)
    if dtype == torch.bfloat16:
        # Some of these sums err by more than twice the reference's own error (the split-K
        # sum at 3 of 12 seeds, on every host): without the rounding spread they were red.
        assert consulted > 0


def test_a_left_out_vocabulary_slice_of_an_aux_sum_fails() -> None:
    # What the spread must not let through: the same kernel, its sum missing 1/16 of the
    # vocabulary (the error of a masked tail block).
    for dtype in (torch.float32, torch.bfloat16):
        x, w = logits_inputs(0, dtype)
        ref = reference(logits_loss, x, w, argnums=(0, 1), has_aux=True)
        loss, grads, _ = chunked_kernel(x, w)
        logits = (x.float() @ w.float().T)[:, : w.shape[0] - w.shape[0] // 16]
        wrong = (logits.sum().to(dtype), logits.mean().to(dtype))
        message = failure(ref, loss, grads, aux=wrong, check_dtype=False)
        assert "- aux[0]:" in message
        assert "rounding spread (16 randomly rounded runs of the reference) allows" in message


# --- no green on a systematic error ---------------------------------------------------------


LOSSES = {
    "log_softmax": lambda x, w: torch.log_softmax(x @ w.T, dim=-1).square().sum(),
    "tanh": lambda x, w: torch.tanh(x @ w.T).square().sum(),
}


def float32_kernel(fn, x, w, scale=1.0, bias=0.0):  # type: ignore[no-untyped-def]
    """fn in float32, each gradient rounded once; the weight gradient times ``scale`` plus
    ``bias`` times its mean magnitude, before the rounding."""
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()
    value = fn(xs, ws)
    value.backward()
    grad_w = ws.grad * scale + bias * ws.grad.abs().mean()
    return value, (xs.grad.to(x.dtype), grad_w.to(w.dtype))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_one_percent_scale_or_bias_of_a_half_precision_gradient_fails(
    dtype: torch.dtype, loss: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=gen).to(dtype)
    # fp16 overflows the squared log-softmax's weight gradient of unit weights: smaller ones.
    w = (torch.randn(256, 128, generator=gen) / (8 if dtype == torch.float16 else 1)).to(dtype)
    fn = LOSSES[loss]
    ref = reference(fn, x, w, argnums=(0, 1))
    # More accurate than the reference in the inputs' dtype: passes.
    ref.assert_close(*float32_kernel(fn, x, w), check_dtype=False)
    scaled = failure(ref, *float32_kernel(fn, x, w, scale=1.01), check_dtype=False)
    assert "1 of 3 items differ\n- gradient of argument 1 (w):" in scaled
    found = re.search(r"systematic error vs the float64 golden: a scale of ([-+.e\d]+) ", scaled)
    assert found is not None
    assert float(found[1]) == pytest.approx(0.01, rel=0.03)
    biased = failure(ref, *float32_kernel(fn, x, w, bias=0.01), check_dtype=False)
    assert "1 of 3 items differ\n- gradient of argument 1 (w):" in biased
    found = re.search(r", ([-+.e\d]+) of the golden's mean magnitude", biased)
    assert found is not None
    assert float(found[1]) == pytest.approx(0.01, rel=0.03)


def test_a_scale_error_names_its_standard_error_and_the_references() -> None:
    # The message: the scale the kernel's error has along the golden, the reference's own,
    # and the standard error of the kernel's; the allowance counts from the reference's.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=gen).bfloat16()
    w = torch.randn(256, 128, generator=gen).bfloat16()
    fn = LOSSES["log_softmax"]
    ref = reference(fn, x, w, argnums=(0, 1))
    message = failure(ref, *float32_kernel(fn, x, w, scale=1.01), check_dtype=False)
    assert "its standard error" in message
    assert "the reference's own: +" in message
    assert re.search(
        r"allowed: budget 2 x the bfloat16 reference's [-+.e\d]+ "
        r"\+ 6 standard errors \+ floor 0.00391",
        message,
    )


def bf16_chunked_kernel(x, w, scale=1.0):  # type: ignore[no-untyped-def]
    """LOSSES["log_softmax"] as a fused-linear kernel computes it: in four chunks of rows,
    the logits and their gradient in bf16 as the reference computes them (so the kernel
    shares the reference's rounding, and its lean), the weight gradient accumulated in
    float32, times ``scale``, rounded once."""
    value = torch.zeros((), dtype=torch.float32)
    grad_w = torch.zeros(w.shape, dtype=torch.float32)
    grad_x = []
    for rows in x.chunk(4):
        logits = (rows @ w.T).detach().requires_grad_()
        loss = torch.log_softmax(logits, dim=-1).square().sum()
        (grad_logits,) = torch.autograd.grad(loss, logits)
        value += loss.detach().float()
        grad_w += grad_logits.float().T @ rows.float()
        grad_x.append((grad_logits.float() @ w.float()).to(x.dtype))
    return value.to(x.dtype), (torch.cat(grad_x), (grad_w * scale).to(w.dtype))


def test_a_scale_error_against_the_references_lean_is_not_hidden_by_it() -> None:
    # The bf16 reference's weight gradient leans by a few 1e-3 (its rounding is not unbiased),
    # and a kernel that rounds as it does leans with it. A 1% scale the other way left an
    # error under twice the lean plus the floor: only the reference's lean toward the
    # kernel's error counts now (a correct kernel lies between none and the reference's).
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=gen).bfloat16()
    w = (torch.randn(512, 128, generator=gen) / 128**0.5).bfloat16()
    ref = reference(LOSSES["log_softmax"], x, w, argnums=(0, 1))
    ref.assert_close(*bf16_chunked_kernel(x, w))
    message = failure(ref, *bf16_chunked_kernel(x, w, scale=0.99))
    assert "1 of 3 items differ\n- gradient of argument 1 (w):" in message
    lean = re.search(r"the reference's own: ([-+.e\d]+)\)", message)
    own = re.search(r"a scale of ([-+.e\d]+) ", message)
    assert lean is not None
    assert own is not None
    assert float(lean[1]) > 0 > float(own[1])  # the reference leans the other way
    assert "none of the reference's own, which leans the other way" in message


def test_the_spread_allowance_follows_the_variation_of_its_runs() -> None:
    # Runs that agree get the budget; runs as variable as one rounding error get about 7
    # times their rms (divided by sqrt(2): the runs round stochastically, whose error variance
    # is twice round-to-nearest's); none finite gets none.
    assert spread_factor([1.0] * RUNS, 2.0) == (2.0, 1 / math.sqrt(2))
    draws = torch.randn(4000, RUNS, generator=torch.Generator().manual_seed(0)).abs()
    factors = [spread_factor(row.tolist(), 2.0)[0] for row in draws]
    assert 6.0 < sorted(factors)[len(factors) // 2] < 8.0
    assert all(math.isnan(v) for v in spread_factor([math.nan] * RUNS, 2.0))


def test_a_correct_scalar_exceeds_the_spread_rarely() -> None:
    # The allowance's false-red rate for a single number whose error is one draw of
    # round-to-nearest noise, where the runs draw stochastic rounding's (sqrt(2) times as
    # wide): under 1e-4 in 1e5 trials.
    gen = torch.Generator().manual_seed(1)
    draws = torch.randn(100_000, RUNS + 1, generator=gen, dtype=torch.float64).abs()
    draws[:, 1:] *= math.sqrt(2)
    exceeded = 0
    for row in draws.tolist():
        factor, rms = spread_factor(row[1:], 2.0)
        exceeded += row[0] > factor * rms
    assert exceeded <= 10


def test_the_spread_is_reproducible_and_leaves_the_test_rng_alone() -> None:
    x, w = logits_inputs(3, torch.float32)
    ref = reference(logits_loss, x, w, argnums=(0, 1), has_aux=True)
    assert ref.golden is not None
    assert ref.golden.spread is not None
    state = torch.random.get_rng_state()
    first = ref.golden.spread.results()
    assert torch.equal(state, torch.random.get_rng_state())
    again = reference(logits_loss, x, w, argnums=(0, 1), has_aux=True)
    assert again.golden is not None
    assert again.golden.spread is not None
    second = again.golden.spread.results()
    assert len(first) == RUNS
    assert all(torch.equal(a.arg_grads[1], b.arg_grads[1]) for a, b in zip(first, second))
    # and the runs differ from each other and from the reference, by rounding
    errors = [float((run.aux[0] - ref.golden.aux[0]).abs()) for run in first]
    assert len(set(errors)) == RUNS


@pytest.mark.parametrize(
    ("result", "target"),
    [
        (torch.bfloat16, torch.bfloat16),  # half precision, computed again in float32
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),  # a rounded reference's steps, kept in their dtype
        (torch.float64, torch.bfloat16),
    ],
    ids=str,
)
def test_stochastic_rounding_rounds_up_as_often_as_the_value_is_near_the_step_above(
    result: torch.dtype, target: torch.dtype
) -> None:
    # Each product lies between two neighbours of the target's grid; a randomly rounded run
    # takes the one above with the probability of the product's distance from the one below.
    # Rounding to nearest (a dither lost to the working dtype's own rounding) takes it never
    # below half a step and always above.
    a = 1 + torch.rand(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = a.to(result)
    factor = 1.3
    exact = (a.to(torch.promote_types(result, torch.float32)) * factor).double()
    digits = round(-math.log2(torch.finfo(target).eps)) + 1
    step = torch.exp2(torch.floor(torch.log2(exact)) + 1 - digits)
    below = torch.floor(exact / step) * step
    distance = (exact - below) / step
    with RandomRounding(0, None if result == target else target):
        rounded = a * factor
    assert rounded.dtype == result
    # (Within half a step above a power of two the dither reaches the finer grid below it,
    # so those products are left out.)
    clear = torch.floor(torch.log2(exact - step / 2)) == torch.floor(torch.log2(exact))
    up = rounded.double() > below
    assert torch.equal(rounded.double()[clear], torch.where(up, below + step, below)[clear])
    for low, high in ((0.05, 0.45), (0.55, 0.95)):
        band = (distance > low) & (distance < high) & clear
        share = up[band].double().mean() - distance[band].mean()
        # about 1000 products a band: 4 standard errors of the share rounded up
        assert abs(float(share)) < 4 * 0.5 / math.sqrt(int(band.sum())), (low, float(share))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_noise_is_uniform_between_minus_one_and_one(dtype: torch.dtype) -> None:
    # Four numbers come from each 64-bit draw (spread.py's _uniform): each of the four lanes
    # is checked, the top one among them, whose top bit the draw leaves 0.
    noise = RandomRounding(0)._uniform(torch.empty(256, 256, dtype=dtype))
    assert noise.shape == (256, 256)
    assert noise.dtype == dtype
    assert float(noise.min()) > -1
    assert float(noise.max()) < 1
    for lane in range(4):
        part = noise.flatten()[lane::4].double()
        count = part.numel()
        # U(-1, 1): mean 0, variance 1/3 (of u**2's variance 4/45), each within 5 standard
        # errors, and each eighth of the range a binomial share of 1/8.
        assert abs(float(part.mean())) < 5 * math.sqrt(1 / 3 / count)
        assert abs(float(part.var()) - 1 / 3) < 5 * math.sqrt(4 / 45 / count)
        eighths = torch.histc(part, bins=8, min=-1, max=1)
        assert float((eighths / count - 1 / 8).abs().max()) < 5 * math.sqrt(7 / 64 / count)


def masked_loss(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A loss over the kept rows only (a mask of 0 and 1 in x's dtype, as ignored labels
    give): the gradient of every other row is an exact zero."""
    return (torch.tanh(x.float()) * keep[:, None].float()).square().sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_exact_zeros_stay_zero_in_the_randomly_rounded_runs(dtype: torch.dtype) -> None:
    # A zero result is exact: no correct computation rounds it. Dithered at a step of its
    # dtype "at its magnitude" (frexp's exponent of 0 is 0), each masked gradient entry became
    # noise of up to 2**-9 in bf16, and the spread allowance of the item grew with it.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).to(dtype)
    keep = (torch.rand(64, generator=gen) < 0.5).to(dtype)
    ref = reference(masked_loss, x, keep)
    assert ref.golden is not None
    assert ref.golden.spread is not None
    runs = ref.golden.spread.results()
    masked = keep == 0
    for run in runs:
        assert torch.count_nonzero(run.arg_grads[0][masked]) == 0
    # and the kept rows are rounded, run by run
    assert len({float(run.arg_grads[0][~masked].double().sum()) for run in runs}) > 1


# --- a golden in float64 whatever the reference casts to ------------------------------------


def casting_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A reference that casts inside, as library test utilities do: .float(), a softmax
    with dtype=, a float32 tensor made inside."""
    logits = (x @ w.T).float()
    scale = torch.tensor(0.5, dtype=torch.float32)
    return (torch.softmax(logits, dim=-1, dtype=torch.float32) * logits).sum() * scale


def test_a_reference_that_casts_inside_gets_a_float64_golden() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen).bfloat16()
    w = torch.randn(32, 16, generator=gen).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GoldenPrecisionWarning)
        ref = reference(casting_loss, x, w, argnums=(0, 1))
    assert ref.golden is not None
    assert ref.golden.obtained == torch.float64
    assert ref.golden.value.dtype == torch.float64
    exact = casting_loss(x.double(), w.double())
    # The same as the reference computed by hand in float64 (its casts removed).
    by_hand = ((x.double() @ w.double().T).softmax(-1) * (x.double() @ w.double().T)).sum() / 2
    assert float(ref.golden.value) == pytest.approx(float(by_hand), rel=1e-12)
    assert exact.dtype == torch.float32  # what the golden was before: float32


def casting_back_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Computes in float32 and returns the inputs' dtype, as reference utilities do: in the
    golden's run the result is float64, computed in float32."""
    logits = x.float() @ w.float().T
    return (logits.softmax(-1) * logits).sum().to(x.dtype)


def test_a_reference_that_casts_back_at_the_end_gets_a_float64_golden() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen).bfloat16()
    w = torch.randn(32, 16, generator=gen).bfloat16()
    ref = reference(casting_back_loss, x, w, argnums=(0, 1))
    assert ref.golden is not None
    logits = x.double() @ w.double().T
    by_hand = (logits.softmax(-1) * logits).sum()
    assert float(ref.golden.value) == pytest.approx(float(by_hand), rel=1e-12)
    # Without the promotion, the golden carries float32's rounding.
    assert float(casting_back_loss(x.double(), w.double())) != pytest.approx(
        float(by_hand), rel=1e-12
    )


def test_modules_reached_through_the_arguments_or_closed_over_are_promoted() -> None:
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Linear(4, 3)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    x = torch.randn(5, 4, generator=gen).bfloat16()

    def as_argument(mod: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
        return mod(inp.float()).sum()

    def closed_over(inp: torch.Tensor) -> torch.Tensor:
        return module(inp.float()).square().sum()

    for fn, args, argnums in ((as_argument, (module, x), 1), (closed_over, (x,), 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", GoldenPrecisionWarning)
            ref = reference(fn, *args, argnums=argnums)
        assert ref.golden is not None
        assert ref.golden.value.dtype == torch.float64
        assert ref.golden.arg_grads[0].dtype == torch.float64
    # The caller's module is untouched: its dtype, its values, no gradient written.
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), before[name])
        assert p.grad is None


def test_what_cannot_be_promoted_is_warned_of_with_what_to_do() -> None:
    # A round trip through Python numbers: no float64 tensor reaches the result.
    def through_python(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(x.detach().tolist()).square().sum()

    x = torch.randn(6, generator=torch.Generator().manual_seed(0)).bfloat16()
    with pytest.warns(GoldenPrecisionWarning) as caught:
        ref = reference(through_python, x)
    assert ref.golden is not None
    assert ref.golden.obtained == torch.float32
    text = str(caught[0].message)
    assert "even with its casts and dtype= arguments promoted to float64" in text
    assert "a round trip through NumPy or Python numbers" in text
