"""Precision mutations of the fused-linear JSD kernel (and of the adopters' per-token kernel):
a pytest plugin, and the registry that ``benchmarks/precision_mutations.py`` runs the suites
under.

Each mutation is one small, exact change to the kernel's math, made by monkeypatching in the
process that runs it (nothing on disk changes): a function of the kernel wrapped where the
change is at a function's boundary, else the kernel function's own source with named lines
replaced, compiled under its file name and line numbers and set in its place (in every
``gradref_kernels`` module that holds it). A replaced line that is no longer in the kernel's
source stops the run, so a kernel change cannot turn a mutation into a silent no-op.

As a plugin (``-p _mutations``, with ``benchmarks/`` on ``PYTHONPATH``), it applies the
mutation that ``GRADREF_MUTATION`` names as pytest configures, in every process (xdist's
workers too), and says so in the header. Where ``GRADREF_MUTATION_HITS`` names a folder, each
process writes there how many times the mutated code changed a computation (``<pid>.hits``,
after every test and at exit): proof that the mutation reached the tests.
"""

from __future__ import annotations
import __future__

import inspect
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ENV = "GRADREF_MUTATION"
HITS_ENV = "GRADREF_MUTATION_HITS"

Mutation = Callable[[pytest.MonkeyPatch], None]


class _Hits:
    """How many times this process's mutated code changed a computation."""

    count = 0


def _hit() -> None:
    _Hits.count += 1


def hits() -> int:
    """The count so far (reset with :func:`reset_hits`)."""
    return _Hits.count


def reset_hits() -> None:
    _Hits.count = 0


def _low_precision(dtype: Any) -> bool:
    import torch

    return dtype in (torch.bfloat16, torch.float16)


def _replace_everywhere(
    monkeypatch: pytest.MonkeyPatch,
    original: Any,
    replacement: Any,
    package: str = "gradref_kernels",
) -> int:
    """Sets ``replacement`` in every module attribute of ``package`` that holds ``original``
    (a ``from ._forward import chunked_forward`` binds its own name); returns how many it
    set."""
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(f"{package}.")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                monkeypatch.setattr(module, attribute, replacement)
                count += 1
    if count == 0:
        raise RuntimeError(f"{original.__qualname__} is bound nowhere in {package}")
    return count


def _wrap(
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """``module.name`` replaced everywhere by ``make(original)``."""
    original = getattr(module, name)
    _replace_everywhere(monkeypatch, original, make(original))


def _rewrite(
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    name: str,
    replacements: list[tuple[str, str, int]],
    helpers: dict[str, Callable[..., Any]],
) -> None:
    """``module.name`` with each ``(old, new, count)`` of ``replacements`` applied to its source
    (``old`` must occur exactly ``count`` times), compiled in the module's namespace with its
    file name and line numbers, and set everywhere in place of the original; ``helpers`` are
    set on the module for the new lines to call."""
    original = getattr(module, name)
    lines, first_line = inspect.getsourcelines(original)
    source = textwrap.dedent("".join(lines))
    for old, new, count in replacements:
        found = source.count(old)
        if found != count:
            raise RuntimeError(
                f"{module.__name__}.{name}: expected {count} occurrence(s) of {old!r}, found "
                f"{found}; the kernel changed, so update the mutation in {__file__}"
            )
        source = source.replace(old, new)
    for helper_name, helper in helpers.items():
        monkeypatch.setattr(module, helper_name, helper, raising=False)
    code = compile(
        "\n" * (first_line - 1) + source,
        inspect.getsourcefile(original) or module.__file__,
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    scope: dict[str, Any] = {}
    exec(code, vars(module), scope)
    _replace_everywhere(monkeypatch, original, scope[name])


# ------------------------------------------------------------------------------ the mutations


def log_softmax_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-chunk log-softmax computed in bfloat16: each of the four ``torch.log_softmax``
    of ``_chunk_torch._slice_`` (log T, log S on either branch, the hard loss's log softmax(z))
    gets its float32 input cast to bfloat16 and its result cast back (float64 inputs are left
    alone). Models log-probabilities taken in the matmul dtype (a bfloat16 logits tensor fed
    to log_softmax, upcast afterwards): every log-probability keeps 8 bits, and
    d = log T - log S inherits their rounding."""
    import torch
    from gradref_kernels import _chunk_torch

    def log_softmax(input: Any, dim: int, *, out: Any) -> Any:
        if input.dtype != torch.float32:  # float64 inputs keep their float64 math
            return torch.log_softmax(input, dim, out=out)
        _hit()
        return out.copy_(torch.log_softmax(input.to(torch.bfloat16), dim).to(input.dtype))

    _rewrite(
        monkeypatch,
        _chunk_torch,
        "_slice_",
        [("torch.log_softmax(", "_mutation_log_softmax(", 4)],
        {"_mutation_log_softmax": log_softmax},
    )


def chunk_loss_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-chunk losses rounded to the input dtype before they are summed over chunks: in
    ``_forward.chunked_forward``, ``soft_parts.append(soft_chunk)`` and
    ``hard_parts.append(hard_chunk)`` append the chunk's float32 sum rounded to bfloat16 or
    float16 (a no-op for float32 inputs). Models partial sums kept in the model's dtype (a
    list of ``loss.to(x.dtype)`` per chunk): each chunk's loss keeps 8 (11) bits."""
    from gradref_kernels import _forward

    def rounded(value: Any, dtype: Any) -> Any:
        if not _low_precision(dtype):
            return value
        _hit()
        return value.to(dtype).to(value.dtype)

    _rewrite(
        monkeypatch,
        _forward,
        "chunked_forward",
        [
            (
                "soft_parts.append(soft_chunk)",
                "soft_parts.append(_mutation_rounded(soft_chunk, x.dtype))",
                1,
            ),
            (
                "hard_parts.append(hard_chunk)",
                "hard_parts.append(_mutation_rounded(hard_chunk, x.dtype))",
                1,
            ),
        ],
        {"_mutation_rounded": rounded},
    )


def grad_weight_bf16_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight gradient summed over chunks in the matmul dtype: after each
    ``_matmuls.accumulate_product_`` (``acc += grad_logits.T @ x``) the running sum is rounded
    to bfloat16 or float16 (a no-op for float32). Models a weight-gradient buffer allocated
    like the weight (``torch.zeros_like(weight)``): one rounding per chunk, and backward's
    scaled cast rounds the sum again."""
    from gradref_kernels import _matmuls

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def accumulate_product_(acc: Any, a: Any, b: Any, *, first: bool) -> None:
            original(acc, a, b, first=first)
            if _low_precision(a.dtype) and not _low_precision(acc.dtype):
                _hit()
                acc.copy_(acc.to(a.dtype))

        return accumulate_product_

    _wrap(monkeypatch, _matmuls, "accumulate_product_", make)


def grad_input_rounded_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """grad_input rounded to the input dtype, then scaled by 1/num_valid and rounded again:
    ``_matmuls.input_gradient_`` takes its fallback branch (``torch.mm(grad_logits, weight,
    out=out)``, then ``out.mul_(mean_scale.tensor)``) for bfloat16 on the CPU, instead of
    ``torch.addmm(..., alpha=mean_scale.host)``, which scales before the one rounding. Models
    a mean taken after the cast (``(grad_logits @ weight).mul_(1 / n)`` in bfloat16)."""
    from gradref_kernels import _matmuls

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def input_gradient_(
            out: Any, grad_logits: Any, weight: Any, mean_scale: Any, scaled_cast: Any
        ) -> None:
            if mean_scale is None or not _low_precision(out.dtype):
                original(out, grad_logits, weight, mean_scale, scaled_cast)
                return
            import torch

            _hit()
            torch.mm(grad_logits, weight, out=out)
            out.mul_(mean_scale.tensor)

        return input_gradient_

    _wrap(monkeypatch, _matmuls, "input_gradient_", make)


def unstable_mixture_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixture log ``L = log(M / S)`` computed as ``log(1 + b)``, ``b = beta * (exp(d) -
    1)``, with plain exp and log: in ``_chunk_torch.soft_terms_`` (0 < beta < 1)
    ``diff.expm1_()`` becomes ``diff.exp_().sub_(1.0)`` and ``torch.special.xlog1py(prob_s,
    mix_ratio)`` becomes ``xlogy(prob_s, 1 + mix_ratio)``. Models the textbook form of the
    module docstring's stable one: where the student is close to the teacher (d small) both
    lose the digits of d below float32's rounding of 1, and the loss, of second order in d,
    loses most of its own."""
    import torch
    from gradref_kernels import _chunk_torch

    def mixture_log(prob_s: Any, mix_ratio: Any, *, out: Any) -> Any:
        _hit()
        return torch.special.xlogy(prob_s, mix_ratio.add(1.0), out=out)

    _rewrite(
        monkeypatch,
        _chunk_torch,
        "soft_terms_",
        [
            ("diff.expm1_().mul_(beta)", "diff.exp_().sub_(1.0).mul_(beta)", 1),
            (
                "torch.special.xlog1py(prob_s, mix_ratio,",
                "_mutation_mixture_log(prob_s, mix_ratio,",
                1,
            ),
        ],
        {"_mutation_mixture_log": mixture_log},
    )


def grad_weight_scale_1pct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bfloat16 / float16 weight gradient 1% too large: ``_forward.chunked_forward``'s
    float32 weight-gradient sum multiplied by 1.01 before backward scales and rounds it.
    Models a normaliser off by one part in a hundred (a count of valid rows off by one in
    a hundred, a loss-scale factor applied to one gradient only)."""
    from gradref_kernels import _forward

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def chunked_forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(x, *args, **kwargs)
            if _low_precision(x.dtype) and result.grad_weight is not None:
                _hit()
                result.grad_weight.mul_(1.01)
            return result

        return chunked_forward

    _wrap(monkeypatch, _forward, "chunked_forward", make)


def soft_sum_vocabulary_slice_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft loss's value-only row sum ``sum(T d)`` in ``_chunk_torch.soft_terms_`` taken over
    all but the last sixteenth of the vocabulary: a masked tail block of a reduction that
    only a reported value sees (an aux sum, a metric), with every gradient left exact. Such a
    sum cancels (T d is small where S ~ T), so its error is judged against its terms' spread,
    not its value's."""
    import torch
    from gradref_kernels import _chunk_torch

    def nansum_but_a_slice(input: Any, dim: int, *, out: Any) -> Any:
        _hit()
        kept = input.shape[dim] - input.shape[dim] // 16
        return torch.nansum(input.narrow(dim, 0, kept), dim, out=out)

    _rewrite(
        monkeypatch,
        _chunk_torch,
        "soft_terms_",
        [("torch.nansum(", "_mutation_nansum_but_a_slice(", 2)],
        {"_mutation_nansum_but_a_slice": nansum_but_a_slice},
    )


def per_token_one_token_off_1pct(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adopter's per-token output with one token 1% off: prefkit's
    ``fused_linear_token_logps`` (tests/adopters) returns the log-probability of largest
    magnitude times 1.01, every other token and every gradient unchanged. Models a per-token
    term that one position gets wrong (an off-by-one in a position's weight, a boundary token
    of a chunk), which only the output, compared as a tensor, shows."""
    import torch

    prefkit = _adopter_module("prefkit")

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def fused_linear_token_logps(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            _hit()
            bump = torch.zeros_like(out.detach())
            bump.view(-1)[out.detach().abs().argmax()] = 0.01
            return out + out.detach() * bump

        return fused_linear_token_logps

    original = prefkit.fused_linear_token_logps
    _replace_everywhere(monkeypatch, original, make(original), package="prefkit")


def _adopter_module(name: str) -> Any:
    """A module of tests/adopters, imported as its tests import it (pytest puts that folder
    on sys.path as it collects them, after the mutation is applied)."""
    import importlib

    folder = str(Path(__file__).resolve().parent.parent / "tests" / "adopters")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def reorder_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    """CONTROL, not a mistake: every per-row ``torch.sum`` over the vocabulary in
    ``_chunk_torch.soft_terms_`` (sum(S - T), sum(S d), K = sum(S L), sum(S L b)) summed as its
    first half plus its second half. Exact in real arithmetic; it moves only the float
    rounding of the reduction order, as another CPU's vector width or another thread count
    does, so the checks must not call it a regression."""
    import torch
    from gradref_kernels import _chunk_torch

    def sum_in_halves(input: Any, dim: int, keepdim: bool = False, *, out: Any) -> Any:
        _hit()
        half = input.shape[dim] // 2
        first = input.narrow(dim, 0, half).sum(dim, keepdim=keepdim)
        second = input.narrow(dim, half, input.shape[dim] - half).sum(dim, keepdim=keepdim)
        return torch.add(first, second, out=out)

    _rewrite(
        monkeypatch,
        _chunk_torch,
        "soft_terms_",
        [("torch.sum(", "_mutation_sum_in_halves(", 5)],
        {"_mutation_sum_in_halves": sum_in_halves},
    )


# What a mutation changes, and so which checks run under it (precision_mutations.SUITES): the
# fused JSD kernel, or the adopters' per-token kernel.
KERNEL, PER_TOKEN = "kernel", "per_token"

# name -> (mutation, whether the checks must catch it, what it changes)
MUTATIONS: dict[str, tuple[Mutation, bool, str]] = {
    "log_softmax_bf16": (log_softmax_bf16, True, KERNEL),
    "chunk_loss_input_dtype": (chunk_loss_input_dtype, True, KERNEL),
    "grad_weight_bf16_accumulation": (grad_weight_bf16_accumulation, True, KERNEL),
    "grad_input_rounded_twice": (grad_input_rounded_twice, True, KERNEL),
    "unstable_mixture_log": (unstable_mixture_log, True, KERNEL),
    "grad_weight_scale_1pct": (grad_weight_scale_1pct, True, KERNEL),
    "soft_sum_vocabulary_slice_left_out": (soft_sum_vocabulary_slice_left_out, True, KERNEL),
    "per_token_one_token_off_1pct": (per_token_one_token_off_1pct, True, PER_TOKEN),
    "reorder_noop": (reorder_noop, False, KERNEL),
}


# ------------------------------------------------------------------------------ the plugin


def _selected() -> str | None:
    name = os.environ.get(ENV, "")
    if not name:
        return None
    if name not in MUTATIONS:
        raise pytest.UsageError(
            f"Unknown mutation {name!r} from the {ENV} environment variable; "
            f"choose one of {', '.join(MUTATIONS)}, or unset it."
        )
    return name


_MONKEYPATCH = pytest.StashKey[pytest.MonkeyPatch]()
_NAME = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    name = _selected()
    if name is None:
        return
    monkeypatch = pytest.MonkeyPatch()
    MUTATIONS[name][0](monkeypatch)
    config.stash[_MONKEYPATCH] = monkeypatch
    config.stash[_NAME] = name


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.stash.get(_NAME, None)
    if name is None:
        return None
    return f"gradref mutation: {name} ({ENV}={name}, benchmarks/_mutations.py)"


def _write_hits() -> None:
    folder = os.environ.get(HITS_ENV)
    if folder:
        Path(folder, f"{os.getpid()}.hits").write_text(f"{hits()}\n")


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    # After every test, not only at exit: an xdist worker that is slow to shut down can be
    # ended by its controller before its unconfigure hooks run.
    if _selected() is not None:
        _write_hits()


def pytest_unconfigure(config: pytest.Config) -> None:
    monkeypatch = config.stash.get(_MONKEYPATCH, None)
    if monkeypatch is None:
        return
    _write_hits()
    monkeypatch.undo()
