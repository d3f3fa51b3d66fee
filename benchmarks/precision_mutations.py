"""Do the kernel suite's precision checks catch realistic precision mistakes in the kernel?

Each mistake of ``benchmarks/_mutations.py``, applied to the kernel alone (or, for a per-token
output, to the adopters' per-token kernel alone), must be caught.

For every mutation this first checks, in this process, that it changes the fused loss's outputs
at all, and by how much against the float64 golden (relative max error before -> after, on a
small bfloat16 and float32 problem and on a float32 one whose student is close to its teacher),
so that a mutation that does nothing cannot pass for one that is caught; a mutation of the
per-token kernel is measured on its output and gradients in bfloat16 and float32 instead. Then
it runs a subset of the kernel suite (the per-token tests of ``tests/adopters`` for a per-token
mutation) under the CI baseline gate (``--gradref-baseline=`` the committed CPU
baseline, ``--gradref-baseline-fail``) with the mutation applied inside the test processes
(``-p _mutations``, ``benchmarks/`` on ``PYTHONPATH``, ``GRADREF_MUTATION=NAME``: nothing on
disk changes), and checks that the mutated code ran there and that the run's verdict is the
expected one: caught (a test's check fails, or the gate reports a regression: pytest exits 1
or 6, and not by crashed tests alone), with at least one item flagged by the gate, for the
mistakes; not caught (exit status 0) for the
unmutated suites (``none``, which run first) and the control (``reorder_noop``, a
summation-order change). Where the unmutated suite fails already, a mutation counts as caught
only by failed tests or gate items beyond its. Exits 1 if any expectation fails.

    python benchmarks/precision_mutations.py                       # everything, on SUBSET
    python benchmarks/precision_mutations.py --only reorder_noop grad_input_rounded_twice
    python benchmarks/precision_mutations.py -k "not triton"      # tests/kernels -k EXPR
    python benchmarks/precision_mutations.py --out /tmp/mutations  # logs and the table there

The table of the last full run on this repository's 2-core CPU host is
``benchmarks/results/cpu/precision_mutations.txt``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _mutations
import pytest
import torch
from torch import Tensor

from pytest_gradref.report.diff import UnusableInput, compare_reports, load_report

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO / "kernels"))
from gradref_kernels import fused_linear_jsd  # noqa: E402
from gradref_kernels.reference import jsd_distillation_reference  # noqa: E402

BASELINE = "tests/kernels/precision-baseline-cpu.json"
UNMUTATED = "none"

# The kernel-suite tests each run takes: those that judge precision, on the PyTorch path, at the
# small sizes, in bfloat16 and float32 (a small share of the suite's time). Every mutated line
# runs in them, and each mutation that a run of the whole suite but for the Triton tests caught
# has a catching test among them (benchmarks/results/cpu/precision_mutations.txt). Left out:
# the Triton kernel's tests (its CPU interpreter is slow, and the mutations change the PyTorch
# chunk math or the chunk loop both paths share), torch.compile's (the same operators,
# compiled around), the 8x128x1024x4096 reference cases (the suite's slowest), float16's loss
# scaling (slow; the bfloat16 tests run the same lines), the chunk tests' second PyTorch
# variant (the same math in slices) and the tests that judge no precision.
SUBSET_PATHS = ["tests/kernels/test_chunk_kernels.py", "tests/kernels/test_fused_linear_jsd.py"]
SUBSET_K = (
    "(test_correctness or test_grad_output or test_beta_endpoints or test_chunk_size"
    " or test_torch_implementation or test_teacher_vocabulary_larger"
    " or test_bfloat16_gradients_are_rounded_once or test_soft_loss_keeps_its_digits"
    " or test_matches_float64) and not triton and not torch-slices and not 8x128x1024x4096"
)

# The tests each kind of mutation runs under (_mutations.MUTATIONS' third field): the per-token
# kernel's output and gradients, its planted-error test left out (it plants its own).
SUITES = {
    _mutations.KERNEL: [*SUBSET_PATHS, "-k", SUBSET_K],
    _mutations.PER_TOKEN: [
        "tests/adopters/test_adopter_per_token.py",
        "-k",
        "test_token_logps_and_their_gradients",
    ],
}

# pytest's own exit statuses that mean the run did not judge anything (interrupted, internal
# error, usage error, no tests collected): neither caught nor not caught.
BROKEN_RUN = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no tests collected"}


# ------------------------------------------------------------------ the output change, in process


@dataclass(frozen=True)
class Case:
    """A small fused-loss problem: its tensors (the student's get gradients) and options."""

    name: str
    tensors: dict[str, Tensor | None]
    labels: Tensor
    options: dict[str, Any]


GRAD_NAMES = ("student_input", "student_weight", "student_bias")
# A per-token case's outputs go in the same columns: its output tensor under "loss", and the
# gradients of its input, weight and bias.
OUTPUT_NAMES = ("loss", "grad_input", "grad_weight", "grad_bias")


def make_case(name: str, dtype: torch.dtype, *, close: bool = False) -> Case:
    """Random inputs as the kernel suite draws them (logits of standard deviation about 2, a
    quarter of the rows ignored), or, with ``close``, a teacher whose weight is the student's
    perturbed so that the per-row JSD is about 3e-6 (the regime of the suite's
    test_soft_loss_keeps_its_digits_when_student_is_close)."""
    gen = torch.Generator().manual_seed(0)
    rows, hidden, teacher_hidden, vocab = (96, 32, 32, 2048) if close else (150, 48, 64, 301)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return torch.randn(size, generator=gen) * scale

    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[torch.rand(rows, generator=gen) < 0.25] = -100
    student_input = randn(rows, hidden)
    student_weight = randn(vocab, hidden, scale=2.0 / math.sqrt(hidden))
    if close:
        # beta 0.5: the JSD is about beta (1 - beta) / 2 * 4 * perturbation**2 per row.
        perturbation = math.sqrt(3e-6 / (4 * 0.125))
        teacher_input = student_input
        teacher_weight = student_weight + perturbation * student_weight.std() * randn(vocab, hidden)
        student_bias = teacher_bias = None
        options = {"weight_hard_loss": 0.0, "weight_soft_loss": 1.0, "beta": 0.5}
    else:
        teacher_input = randn(rows, teacher_hidden)
        teacher_weight = randn(vocab, teacher_hidden, scale=2.0 / math.sqrt(teacher_hidden))
        student_bias, teacher_bias = randn(vocab), randn(vocab)
        options = {"beta": 0.5, "chunk_size": 64}  # three chunks; hard and soft losses
    tensors = {
        "student_input": student_input,
        "student_weight": student_weight,
        "teacher_input": teacher_input,
        "teacher_weight": teacher_weight,
        "student_bias": student_bias,
        "teacher_bias": teacher_bias,
    }
    converted = {k: None if v is None else v.to(dtype) for k, v in tensors.items()}
    return Case(name, converted, labels, options)


CASES: list[Callable[[], Case]] = [
    lambda: make_case("bf16", torch.bfloat16),
    lambda: make_case("fp32", torch.float32),
    lambda: make_case("fp32-close", torch.float32, close=True),
]


@dataclass(frozen=True)
class TokenCase:
    """A small per-token problem of prefkit's token log-probabilities: hidden states, a head
    with bias, targets (a fifth ignored) and a fixed cotangent for the backward."""

    name: str
    tensors: tuple[Tensor, Tensor, Tensor]
    target: Tensor
    cotangent: Tensor


def make_token_case(name: str, dtype: torch.dtype) -> TokenCase:
    gen = torch.Generator().manual_seed(0)
    batch, tokens, hidden, vocab = 3, 17, 48, 301
    x = torch.randn(batch, tokens, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) * 2 / math.sqrt(hidden)
    bias = torch.randn(vocab, generator=gen) * 0.5
    target = torch.randint(0, vocab, (batch, tokens), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.2] = -100
    cotangent = torch.randn(batch, tokens, generator=gen)
    converted = (x.to(dtype), weight.to(dtype), bias.to(dtype))
    return TokenCase(name, converted, target, cotangent)


TOKEN_CASES: list[Callable[[], TokenCase]] = [
    lambda: make_token_case("bf16 tokens", torch.bfloat16),
    lambda: make_token_case("fp32 tokens", torch.float32),
]


def token_outputs(
    case: TokenCase, fn: Callable[..., Tensor], dtype: torch.dtype | None = None
) -> list[Any]:
    """(output, grad x, grad weight, grad bias) of ``fn`` on the case with its cotangent, its
    tensors converted to ``dtype`` when given."""
    leaves = [(t if dtype is None else t.to(dtype)).clone().requires_grad_() for t in case.tensors]
    out = fn(*leaves, case.target)
    out.backward(case.cotangent.to(out.dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _prefkit() -> Any:
    return _mutations._adopter_module("prefkit")


def outputs(case: Case, fn: Callable[..., Tensor], dtype: torch.dtype | None = None) -> list[Any]:
    """(loss, grad_input, grad_weight, grad_bias or None) of ``fn`` on the case, its tensors
    converted to ``dtype`` when given."""
    tensors: dict[str, Tensor | None] = {}
    for name, value in case.tensors.items():
        if value is not None:
            value = (value if dtype is None else value.to(dtype)).clone()
            value.requires_grad_(name in GRAD_NAMES)
        tensors[name] = value
    loss = fn(
        tensors["student_input"],
        tensors["student_weight"],
        tensors["teacher_input"],
        tensors["teacher_weight"],
        case.labels,
        tensors["student_bias"],
        tensors["teacher_bias"],
        **case.options,
    )
    torch.autograd.backward(loss)
    grads = [getattr(tensors[name], "grad", None) for name in GRAD_NAMES]
    return [loss.detach(), *grads]


def kernel(*args: Any, **options: Any) -> Tensor:
    """The fused loss on its PyTorch path (the one the mutations change)."""
    loss = fused_linear_jsd(*args, implementation="torch", **options)
    assert isinstance(loss, Tensor)  # not return_soft_hard_loss
    return loss


def reference(*args: Any, chunk_size: int = 0, **options: Any) -> Tensor:
    """The full-logits reference, which has no chunks."""
    return jsd_distillation_reference(*args, **options)


def relative_error(value: Tensor, golden: Tensor) -> float:
    """max |value - golden| / max |golden|."""
    scale = golden.abs().max().item()
    return (value.double() - golden).abs().max().item() / (scale or 1.0)


@dataclass(frozen=True)
class Change:
    """One output of one case: its error against the golden unmutated and mutated."""

    case: str
    output: str
    before: float
    after: float
    changed: bool

    def describe(self) -> str:
        if not self.changed:
            return f"{self.before:.2e} ="
        ratio = self.after / self.before if self.before else math.inf
        shown = f"{ratio:.2f}" if ratio < 10 else f"{ratio:.3g}"
        return f"{self.before:.2e} -> {self.after:.2e} ({shown}x)"


@dataclass(frozen=True)
class Unmutated:
    """A case with the golden's and the unmutated kernel's outputs."""

    case: Case | TokenCase
    golden: list[Any]
    outputs: list[Any]


def unmutated_cases(target: str) -> list[Unmutated]:
    """The cases of a mutation's target with their golden and unmutated outputs."""
    if target == _mutations.PER_TOKEN:
        prefkit = _prefkit()
        tokens = [make() for make in TOKEN_CASES]
        return [
            Unmutated(
                c,
                token_outputs(c, prefkit.token_logps_reference, torch.float64),
                token_outputs(c, prefkit.fused_linear_token_logps),
            )
            for c in tokens
        ]
    cases = [make() for make in CASES]
    return [Unmutated(c, outputs(c, reference, torch.float64), outputs(c, kernel)) for c in cases]


def measure_changes(name: str, cases: list[Unmutated]) -> tuple[list[Change], int]:
    """Every output's change under mutation ``name``, and how many times the mutated code
    changed a computation."""
    mutation, _, _ = _mutations.MUTATIONS[name]
    changes: list[Change] = []
    _mutations.reset_hits()

    def run(case: Case | TokenCase) -> list[Any]:
        if isinstance(case, TokenCase):  # looked up each time: the mutation replaces it
            return token_outputs(case, _prefkit().fused_linear_token_logps)
        return outputs(case, kernel)

    for unmutated in cases:
        with pytest.MonkeyPatch.context() as monkeypatch:
            mutation(monkeypatch)
            after = run(unmutated.case)
        again = run(unmutated.case)
        for output, b, a, g, u in zip(
            OUTPUT_NAMES, unmutated.outputs, after, unmutated.golden, again
        ):
            if g is None:
                continue
            if not torch.equal(b, u):
                raise RuntimeError(f"{name}: the kernel's {output} differs after the undo")
            changed = not torch.equal(a, b)
            changes.append(
                Change(
                    unmutated.case.name, output, relative_error(b, g), relative_error(a, g), changed
                )
            )
    return changes, _mutations.hits()


# ------------------------------------------------------------------ the suite, under a mutation


@dataclass(frozen=True)
class Outcome:
    """One run of the suite: exit status, the tests whose checks failed and those that
    crashed (node id -> first line of the failure), tests run, the gate's regression count
    (None where it judged nothing), a line per regressed item (key: its test and label), the
    mutated code's hits in the test processes, the wall time."""

    status: int
    failed: dict[str, str]
    crashed: dict[str, str]
    tests: int
    regressions: int | None
    gate_items: dict[str, str]
    hits: int
    seconds: float


# A failure whose first line names another exception than AssertionError (pytest's own
# ``assert`` and ``Failed:`` are checks too) is a crash: of the plugin, the test, or the kernel;
# it is shown, but catches nothing.
CRASH = re.compile(r"^(?!AssertionError\b)[A-Za-z_.]*(Error|Exception|Interrupt)\b")


def junit_results(path: Path) -> tuple[int, dict[str, str], dict[str, str]]:
    """(tests run, tests whose checks failed, tests that crashed or errored), each test with the
    first line of its failure, from pytest's JUnit XML."""
    if not path.exists():
        return 0, {}, {}
    tests, failed, crashed = 0, dict[str, str](), dict[str, str]()
    for case in ElementTree.parse(path).iter("testcase"):
        tests += 1
        for tag in ("failure", "error"):
            element = case.find(tag)
            if element is not None:
                module = case.get("classname", "").rsplit(".", 1)[-1]
                message = ((element.get("message") or "").strip().splitlines() or [tag])[0]
                crash = tag == "error" or CRASH.match(message)
                (crashed if crash else failed)[f"{module}::{case.get('name')}"] = message[:160]
    return tests, failed, crashed


def gate_findings(baseline: str, report: Path) -> tuple[int | None, dict[str, str]]:
    """The gate's regressions, judged again from the run's report by compare_reports, as the
    gate judges them (its default threshold, floor and noise): their count, and each
    regressed item's line keyed by its test and label. None for the count where nothing was
    judged (no report written, set-ups that differ, no item in common), which the gate refuses
    too."""
    if not report.exists():
        return None, {}
    try:
        diff = compare_reports(load_report(baseline), load_report(report))
    except UnusableInput:
        return None, {}
    if diff.nothing_compared():
        return None, {}
    items = {
        f"{item.nodeid}: {item.label}": f"{item.nodeid}: {item.label}: {item.regression}"
        for item in diff.regressions
    }
    return len(diff.regressions), items


def run_suite(
    name: str,
    selection: list[str],
    workers: int,
    threads: int,
    baseline: str,
    out: Path,
    label: str,
) -> Outcome:
    """The selected tests under the CI baseline gate, with mutation ``name`` (none for
    UNMUTATED) applied in every test process, each computing on ``threads`` CPU threads; the log
    and JUnit XML go to ``out``, named by ``label``."""
    hits_dir = out / f"{label}.hits"
    hits_dir.mkdir(parents=True, exist_ok=True)
    for stale in hits_dir.glob("*.hits"):
        stale.unlink()
    junit = out / f"{label}.xml"
    report = out / f"{label}.report.json"
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != _mutations.ENV}
    if name != UNMUTATED:
        env[_mutations.ENV] = name
    env[_mutations.HITS_ENV] = str(hits_dir)
    env["GRADREF_THREADS"] = str(threads)
    # Prepended: an environment that installs the plugin through PYTHONPATH keeps it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCHMARKS), env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *selection,
        "-p",
        "_mutations",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        "-rfE",
        "--tb=short",
        f"--gradref-baseline={baseline}",
        "--gradref-baseline-fail",
        f"--gradref-report={report}",
        f"--junitxml={junit}",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    (out / f"{label}.log").write_text(f"{' '.join(command)}\n\n{log}")
    tests, failed, crashed = junit_results(junit)
    regressions, gate_items = gate_findings(baseline, report)
    hits = sum(int(p.read_text() or 0) for p in hits_dir.glob("*.hits"))
    return Outcome(done.returncode, failed, crashed, tests, regressions, gate_items, hits, seconds)


# ------------------------------------------------------------------ the verdict


@dataclass(frozen=True)
class Verdict:
    """Whether a run caught its mutation (None: the run judged nothing), by the failed tests
    and gate items it has beyond the unmutated run's."""

    caught: bool | None
    new_failed: dict[str, str]
    new_gate_items: dict[str, str]


def judge(outcome: Outcome, unmutated: Outcome | None) -> Verdict:
    """Caught: pytest exited non-zero (1, a test failed; 6, the gate found a regression) and
    not by crashes alone. Where the unmutated suite fails already, only what fails beyond it
    counts: the tests whose checks fail and the gate's items that it does not report
    unmutated."""
    if outcome.status in BROKEN_RUN:
        return Verdict(None, {}, {})
    if unmutated is None or unmutated.status == 0:
        crashes_alone = outcome.status == 1 and bool(outcome.crashed) and not outcome.failed
        caught = outcome.status != 0 and not crashes_alone
        return Verdict(caught, outcome.failed, outcome.gate_items)
    new_failed = {k: v for k, v in outcome.failed.items() if k not in unmutated.failed}
    new_items = {k: v for k, v in outcome.gate_items.items() if k not in unmutated.gate_items}
    return Verdict(bool(new_failed or new_items), new_failed, new_items)


def expectation_failures(
    name: str, changes: list[Change], outcome: Outcome, verdict: Verdict
) -> list[str]:
    """Why the run does not meet the mutation's expectation (empty: it does)."""
    problems = []
    expected = name != UNMUTATED and _mutations.MUTATIONS[name][1]
    if name != UNMUTATED:
        if not any(c.changed for c in changes):
            problems.append("the mutation changed no output of the in-process check")
        if outcome.hits == 0:
            problems.append("the mutated code never changed a computation in the test processes")
    if verdict.caught is None:
        problems.append(
            f"the run judged nothing: exit {outcome.status} ({BROKEN_RUN[outcome.status]})"
        )
    elif verdict.caught != expected:
        problems.append("caught" if verdict.caught else "not caught")
    elif expected and not verdict.new_gate_items:
        # A test written for one mistake is no gate: each must be flagged through an item.
        problems.append("caught by tests alone: the gate flagged no item")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(_mutations.MUTATIONS),
        default=list(_mutations.MUTATIONS),
        metavar="NAME",
        help=f"run these mutations only (default: all of {', '.join(_mutations.MUTATIONS)}); "
        "the unmutated suite always runs first, since the mutations are judged against it",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the table, the logs and JUnit XML (default: a new temporary folder, kept)",
    )
    parser.add_argument(
        "-k",
        dest="expression",
        metavar="EXPR",
        help=f"run tests/kernels -k EXPR instead of the subset ({' '.join(SUBSET_PATHS)} -k "
        f"{SUBSET_K!r})",
    )
    parser.add_argument(
        "-n", dest="workers", type=int, default=2, help="xdist workers (0: serial; default 2)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="suites run at once (default 1); each test process then computes on an equal share "
        "of the cores. CI runs --jobs 2 -n 0: two serial runs start two interpreters where one "
        "run under -n 2 starts three",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE,
        help=f"the precision report the gate compares with (default: {BASELINE}, as CI)",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="precision_mutations-"))
    out.mkdir(parents=True, exist_ok=True)
    suites = dict(SUITES)
    if args.expression is not None:
        suites[_mutations.KERNEL] = ["tests/kernels", "-k", args.expression]
    # The suites the chosen mutations run under, the kernel's first.
    targets = sorted({_mutations.MUTATIONS[name][2] for name in args.only}, key=list(SUITES).index)
    started = time.perf_counter()
    lines: list[str] = []

    def say(line: str = "") -> None:
        lines.append(line)
        print(line, flush=True)

    say(
        f"# python benchmarks/precision_mutations.py {' '.join(sys.argv[1:])}".rstrip()
        + f" ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})"
    )
    for target in targets:
        say(
            f"suite ({target}): pytest {' '.join(suites[target])} -n {args.workers} "
            f"--gradref-baseline={args.baseline} --gradref-baseline-fail ({args.jobs} at once)"
        )
    say(f"logs: {out}")
    say()
    say("## Output change against the float64 golden")
    say()
    say("max |out - golden| / max |golden|, unmutated -> mutated (= bitwise unchanged); cases:")
    say("bf16 and fp32: 150 rows (a quarter ignored), hidden 48/64, vocab 301, bias, beta 0.5,")
    say("chunk_size 64; fp32-close: 96 rows, vocab 2048, soft loss only, per-row JSD ~3e-6;")
    say("bf16 and fp32 tokens: prefkit's per-token log-probabilities, 3x17 tokens (a fifth")
    say("ignored), hidden 48, vocab 301, bias, a fixed cotangent; its output in the loss column")
    say()
    say("| mutation | case | " + " | ".join(OUTPUT_NAMES) + " |")
    say("|---" * (len(OUTPUT_NAMES) + 2) + "|")
    cases = {target: unmutated_cases(target) for target in targets}
    changes: dict[str, list[Change]] = {}
    for name in args.only:
        changes[name], _ = measure_changes(name, cases[_mutations.MUTATIONS[name][2]])
        for case in dict.fromkeys(c.case for c in changes[name]):
            cells = {c.output: c.describe() for c in changes[name] if c.case == case}
            say(f"| {name} | {case} | " + " | ".join(cells.get(o, "") for o in OUTPUT_NAMES) + " |")
    say()
    say(f"(the in-process check took {time.perf_counter() - started:.0f} s)")
    say()
    say("## The suites under each mutation")
    say()
    say(
        "caught: exit status 1 or 6, not by crashed tests alone (a failure other than an "
        "AssertionError); where the unmutated run fails, only failed tests and gate items "
        "beyond its own count ('new')"
    )
    say()
    say(
        "| mutation | expected | outcome | failed tests | gate regressions | exit | mutated code "
        "ran | time | result |"
    )
    say("|---|---|---|---|---|---|---|---|---|")
    details: list[str] = []
    failures = 0
    unmutated_runs: dict[str, Outcome] = {}
    runs = [(UNMUTATED, target) for target in targets]
    runs += [(name, _mutations.MUTATIONS[name][2]) for name in args.only]
    labels = [f"{name}-{target}" if name == UNMUTATED else name for name, target in runs]
    threads = max(1, (os.cpu_count() or 1) // (args.jobs * max(args.workers, 1)))
    # The runs are independent processes; only their judging needs the unmutated run first.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(
            pool.map(
                lambda run, label: run_suite(
                    run[0], suites[run[1]], args.workers, threads, args.baseline, out, label
                ),
                runs,
                labels,
            )
        )
    for (name, target), label, outcome in zip(runs, labels, outcomes):
        unmutated = unmutated_runs.get(target)
        verdict = judge(outcome, unmutated)
        if name == UNMUTATED:
            unmutated_runs[target] = outcome
        expected = name != UNMUTATED and _mutations.MUTATIONS[name][1]
        problems = expectation_failures(name, changes.get(name, []), outcome, verdict)
        failures += bool(problems)
        shown = {None: "judged nothing", True: "caught", False: "not caught"}[verdict.caught]
        regressions = "?" if outcome.regressions is None else str(outcome.regressions)
        failed = f"{len(outcome.failed)} of {outcome.tests}"
        if name != UNMUTATED and unmutated is not None and unmutated.status != 0:
            failed += f" ({len(verdict.new_failed)} new)"
            regressions += f" ({len(verdict.new_gate_items)} new items)"
        if outcome.crashed:
            failed += f", {len(outcome.crashed)} crashed"
        ran = "-" if name == UNMUTATED else f"{outcome.hits}x"
        result = "PASS" if not problems else "FAIL: " + "; ".join(problems)
        say(
            f"| {label} | {'caught' if expected else 'not caught'} | {shown} | {failed} | "
            f"{regressions} | {outcome.status} | {ran} | {outcome.seconds:.0f} s | {result} |"
        )
        if verdict.new_failed or verdict.new_gate_items or outcome.crashed:
            details.append(f"{label}:")
            for test, message in list(outcome.crashed.items())[:3]:
                details.append(f"  CRASHED (counts for nothing) {test}: {message}")
            if len(outcome.crashed) > 3:
                details.append(f"  ... and {len(outcome.crashed) - 3} more crashed tests")
            for test, message in list(verdict.new_failed.items())[:8]:
                details.append(f"  FAILED {test}: {message}")
            if len(verdict.new_failed) > 8:
                details.append(f"  ... and {len(verdict.new_failed) - 8} more failed tests")
            for line in list(verdict.new_gate_items.values())[:8]:
                details.append(f"  gate: {line}")
            if len(verdict.new_gate_items) > 8:
                details.append(f"  ... and {len(verdict.new_gate_items) - 8} more gate items")
    if details:
        say()
        say("## What caught them (beyond the unmutated run's failures, where it has any)")
        say()
        for line in details:
            say(line)
    say()
    say(f"total {time.perf_counter() - started:.0f} s; {failures} expectation(s) failed")
    (out / "precision_mutations.txt").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
