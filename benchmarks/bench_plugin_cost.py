"""What pytest-gradref costs a test suite: per test, at import, and in host syncs.

    python benchmarks/bench_plugin_cost.py --device cpu
    python benchmarks/bench_plugin_cost.py --device cuda

1. Per test. Generates the benchmark of issue 14 in a temporary directory, twice: N tests of
   ``log_softmax(x @ w.T).square().sum()`` (x 64x128, w 256x128) that check the value and two
   gradients, once through ``grad_reference`` + ``Reference.assert_close`` and once hand-written
   (``torch.manual_seed``, autograd, three ``torch.testing.assert_close``). Both groups run
   interleaved in one pytest run with ``--junitxml``; each test's time there is its setup +
   call + teardown, so pytest's and torch's start-up are left out, and a first, uncounted test
   takes torch's own first-use costs. Printed: the sums per group and their ratio, per run and
   the median over runs, in three modes: the cheapest (``--gradref-verdict=tolerance``, no
   report: torch.testing's tolerances), the default verdict (a float64 golden and a budget),
   and the default verdict with ``--gradref-report`` (the report's statistics too); beside
   them the hand-written group alone in a run without the plugin.
2. Import. ``import pytest_gradref.plugin`` after ``import pytest``, in fresh interpreters,
   best of several, with the bytecode cache written as an installed package has it; and the
   modules that import loaded (no torch among them).
3. Host reads. On every device: the host reads (``Tensor.item``, ``tolist``, ``__bool__``,
   ``__float__``, ``__int__``, ``__index__``) of one passing ``assert_close`` of three items.
   On CUDA also the host syncs counted with ``torch.cuda.set_sync_debug_mode("warn")``, beside
   those of ``grad_reference`` and of the three hand-written ``torch.testing.assert_close``.

Everything is printed; nothing is written outside the temporary directory (``--keep DIR``
keeps the generated tests, their junit XML and the counts there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from _bench_util import git_commit

REPO = Path(__file__).resolve().parent.parent

COMMON = '''
import torch

DEVICE = torch.device({device!r})


def loss_fn(x, w):
    return torch.log_softmax(x @ w.T, dim=-1).square().sum()


def inputs(device):
    return torch.randn(64, 128, device=device), torch.randn(256, 128, device=device)


def kernel(x, w):
    """The code under test: here the same math, by autograd on copies."""
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss_fn(xx, ww)
    out.backward()
    return out.detach(), xx.grad, ww.grad


def test_warmup():
    """Not counted: torch's own first-use costs (autograd, torch.testing) land here."""
    value, gx, gw = kernel(*inputs(DEVICE))
    torch.testing.assert_close(value, value.clone())
'''

PLUGIN_TEST = """

def test_plugin_{i}(grad_reference, gradref_device):
    x, w = inputs(gradref_device)
    ref = grad_reference(loss_fn, x, w, argnums=(0, 1))
    value, gx, gw = kernel(x, w)
    ref.assert_close(value, (gx, gw))
"""

HAND_TEST = """

def test_hand_{i}():
    torch.manual_seed({i})
    x, w = inputs(DEVICE)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = loss_fn(xr, wr)
    ref.backward()
    value, gx, gw = kernel(x, w)
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(gw, wr.grad)
"""

# One passing assert_close of three items, its host reads counted by patching the Tensor
# methods that read a value to the host, and on CUDA its syncs counted by torch's sync debug
# mode; grad_reference and three torch.testing.assert_close are counted beside it.
COUNT_TEST = '''
import json
import os
import warnings

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class Counter:
    def __init__(self, monkeypatch):
        self.reads = 0
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(*args, _original=original, **kwargs):
                self.reads += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def syncs(call):
    """The CUDA syncs of call(); None off CUDA."""
    if DEVICE.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the syncs: turning the mode on also warns, once a process, that it is a prototype
    # ("Synchronization debug mode is a prototype feature ..."), which counted as a sync of
    # whichever call was measured first.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def test_count(grad_reference, gradref_device, monkeypatch):
    x, w = inputs(gradref_device)
    value, gx, gw = kernel(x, w)
    ref = grad_reference(loss_fn, x, w, argnums=(0, 1))
    counts = {{
        "grad_reference_syncs": syncs(lambda: grad_reference(loss_fn, x, w, argnums=(0, 1))),
        "assert_close_syncs": syncs(lambda: ref.assert_close(value, (gx, gw))),
        "torch_testing_x3_syncs": syncs(
            lambda: [
                torch.testing.assert_close(a, e)
                for a, e in zip((value, gx, gw), (ref.value, *ref.grads))
            ]
        ),
    }}
    counter = Counter(monkeypatch)
    ref.assert_close(value, (gx, gw))
    counts["assert_close_host_reads"] = counter.reads
    counter.reads = 0
    for a, e in zip((value, gx, gw), (ref.value, *ref.grads)):
        torch.testing.assert_close(a, e)
    counts["torch_testing_x3_host_reads"] = counter.reads
    monkeypatch.undo()
    with open(os.environ["GRADREF_COUNTS"], "w") as handle:
        json.dump(counts, handle)
'''


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    parser.add_argument("--tests", type=int, default=300, help="tests per group (default 300)")
    parser.add_argument("--runs", type=int, default=3, help="pytest runs of both groups")
    parser.add_argument("--import-runs", type=int, default=15, help="fresh interpreters")
    parser.add_argument("--keep", type=Path, default=None, help="keep the generated files here")
    return parser.parse_args(argv)


def _env() -> dict[str, str]:
    """The environment for the child processes: this checkout's package first on the path,
    bytecode cached (as an installed package has it), no gradref settings from outside."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for name in ("GRADREF_DEVICE", "GRADREF_STRATEGY", "GRADREF_SEED", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _installed() -> bool:
    """Whether pytest loads the plugin by its entry point (the package is installed)."""
    import importlib.metadata

    try:
        # The distribution's own entry points: entry_points(group=...) needs Python 3.10.
        entry_points = importlib.metadata.distribution("pytest-gradref").entry_points
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(ep.group == "pytest11" and ep.name == "gradref" for ep in entry_points)


# Loads the plugin where it is not installed, only importable (from this checkout).
PLUGIN_ARGS = [] if _installed() else ["-p", "pytest_gradref.plugin"]


def _pytest(directory: Path, args: Sequence[str], env: dict[str, str], plugin: bool = True) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    if plugin:
        command += PLUGIN_ARGS
    elif not PLUGIN_ARGS:
        command += ["-p", "no:gradref"]
    command += args
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")


def write_tests(directory: Path, device: str, count: int) -> None:
    # An ini file of its own, so the repository's configuration does not apply; the plugin
    # seeds the hand-written tests too, so both groups pay for a seed.
    (directory / "pytest.ini").write_text("[pytest]\ngradref_seed_every_test = true\n")
    common = COMMON.format(device=device)
    # Interleaved, so both groups see the same warm-up and the same drift of the machine.
    body = "".join(PLUGIN_TEST.format(i=i) + HAND_TEST.format(i=i) for i in range(count))
    (directory / "test_cost.py").write_text(common + body)
    (directory / "test_count.py").write_text(common + COUNT_TEST.format())


def per_test_times(junit: Path) -> dict[str, list[float]]:
    """Each group's test times (setup + call + teardown) from a junit XML file."""
    groups: dict[str, list[float]] = {"plugin": [], "hand": []}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        for group, times in groups.items():
            if name.startswith(f"test_{group}_"):
                times.append(float(case.get("time", "nan")))
    return groups


# The modes measured per test: name, what the plugin computes there, its pytest arguments
# (the report's path is filled in per run).
MODES = (
    (
        "cheapest",
        "--gradref-verdict=tolerance, no report: torch.testing's tolerance, verdicts alone",
        ["--gradref-verdict=tolerance"],
    ),
    (
        "default",
        "the default verdict, no report: the float64 golden too, a budget of 2",
        [],
    ),
    (
        "report",
        "the default verdict with --gradref-report: the report's statistics too",
        ["--gradref-report={report}"],
    ),
)


def measure_tests(directory: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
    print(f"\n## Per test: {args.tests} tests per group, setup + call + teardown (junit XML)")
    print(
        "plugin / hand: both groups interleaved in one run; the plugin seeds every test, the "
        "hand-written ones too (three torch.testing.assert_close, no float64 run). Modes:"
    )
    for name, what, _ in MODES:
        print(f"  {name}: {what}")
    print(
        "alone: the hand-written group in a run without the plugin (-p no:gradref); its ratio "
        "compares separate runs,\n  so it means something only on an otherwise idle machine."
    )
    header = ["run"]
    for name, _, _ in MODES:
        header += [f"{name} plugin", "hand", "ratio"]
    header += ["alone", "ratio"]
    print("  ".join(f"{cell:>15}" for cell in header))
    device = f"--gradref-device={args.device}"
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
    alone: list[float] = []
    means: dict[str, float] = {}
    for run in range(args.runs):
        cells = [str(run)]
        cheapest_plugin = 0.0
        for name, _, extra in MODES:
            junit = directory / f"junit{run}-{name}.xml"
            report = directory / f"report{run}.json"
            mode_args = [arg.format(report=report) for arg in extra]
            _pytest(directory, ["test_cost.py", f"--junitxml={junit}", device, *mode_args], env)
            sums = {group: sum(t) for group, t in per_test_times(junit).items()}
            ratios[name].append(sums["plugin"] / sums["hand"])
            means[name] = sums["plugin"] / args.tests
            cells += [f"{sums['plugin']:.3f}", f"{sums['hand']:.3f}", f"{ratios[name][-1]:.3f}"]
            if name == "cheapest":
                cheapest_plugin = sums["plugin"]
                means["hand"] = sums["hand"] / args.tests
        junit = directory / f"junit{run}-alone.xml"
        alone_args = ["test_cost.py", "-k", "hand or warmup", f"--junitxml={junit}"]
        _pytest(directory, alone_args, env, plugin=False)
        hand_alone = sum(per_test_times(junit)["hand"])
        alone.append(cheapest_plugin / hand_alone)
        cells += [f"{hand_alone:.3f}", f"{alone[-1]:.3f}"]
        print("  ".join(f"{cell:>15}" for cell in cells))
    median = statistics.median
    figures = ", ".join(f"{median(ratios[name]):.3f}x {name}" for name, _, _ in MODES)
    print(
        f"per-test time, plugin / hand-written, one run (target <= 1.10x for the cheapest "
        f"mode): {figures} (medians over {args.runs} runs)"
    )
    print(f"per-test time, cheapest plugin / hand-written without the plugin: {median(alone):.3f}x")
    print(
        "mean per test, last run: "
        + ", ".join(f"{name} plugin {1e3 * means[name]:.2f} ms" for name, _, _ in MODES)
        + f"; hand-written {1e3 * means['hand']:.2f} ms"
    )


IMPORT_SNIPPET = """
import sys, time
import pytest
before = set(sys.modules)
start = time.perf_counter()
import pytest_gradref.plugin
elapsed = time.perf_counter() - start
new = sorted(m for m in set(sys.modules) - before if m.startswith(("pytest_gradref", "torch")))
print(elapsed, ",".join(new))
"""


def measure_import(args: argparse.Namespace, env: dict[str, str]) -> None:
    print("\n## Import: import pytest_gradref.plugin after import pytest (fresh interpreters)")
    command = [sys.executable, "-c", IMPORT_SNIPPET]
    subprocess.run(command, env=env, check=True, capture_output=True)  # writes the bytecode
    times, modules = [], ""
    for _ in range(args.import_runs):
        done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        seconds, _, modules = done.stdout.strip().partition(" ")
        times.append(float(seconds) * 1e3)
    print(
        f"best {min(times):.2f} ms, median {statistics.median(times):.2f} ms "
        f"of {args.import_runs} (bytecode cached)"
    )
    print(f"modules loaded: {modules.replace(',', ', ')}")
    print(f"torch loaded: {'yes' if 'torch' in modules.split(',') else 'no'}")


def measure_counts(directory: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
    print("\n## Host reads and syncs of one passing assert_close of three items")
    device = f"--gradref-device={args.device}"
    for name, extra in (("plain", []), ("report", [f"--gradref-report={directory / 'r.json'}"])):
        counts_path = directory / f"counts-{name}.json"
        run_env = {**env, "GRADREF_COUNTS": str(counts_path)}
        _pytest(directory, ["test_count.py", device, *extra], run_env)
        counts = json.loads(counts_path.read_text())
        print(f"{name} ({'with' if extra else 'without'} --gradref-report):")
        print(
            f"  host reads (Tensor.item/tolist/__bool__/__float__/__int__/__index__): "
            f"Reference.assert_close {counts['assert_close_host_reads']}, "
            f"three torch.testing.assert_close {counts['torch_testing_x3_host_reads']}"
        )
        if counts["assert_close_syncs"] is None:
            print("  CUDA syncs: not counted (the device is not cuda)")
        else:
            print(
                "  CUDA syncs (torch.cuda.set_sync_debug_mode('warn')): "
                f"Reference.assert_close {counts['assert_close_syncs']}, "
                f"grad_reference {counts['grad_reference_syncs']}, "
                f"three torch.testing.assert_close {counts['torch_testing_x3_syncs']}"
            )


def describe_setup(args: argparse.Namespace, env: dict[str, str]) -> None:
    probe = f"""
import platform, torch
from pathlib import Path
device = torch.device({args.device!r})
if device.type == "cuda":
    name = torch.cuda.get_device_name(device)
else:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    name = models[0] if models else platform.processor() or platform.machine()
threads = torch.get_num_threads()
print(f"torch {{torch.__version__}}, {{device}} ({{name}}), {{threads}} CPU threads, "
      f"Python {{platform.python_version()}}")
"""
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    commit = git_commit(REPO)
    print(f"# pytest-gradref cost, commit {commit or '?'}")
    print(done.stdout.strip() or done.stderr.strip())


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = _env()
    describe_setup(args, env)
    with tempfile.TemporaryDirectory(prefix="gradref-cost-") as scratch:
        directory = args.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        write_tests(directory, args.device, args.tests)
        measure_counts(directory, args, env)
        measure_import(args, env)
        measure_tests(directory, args, env)


if __name__ == "__main__":
    main()
