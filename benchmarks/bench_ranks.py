"""What a multi-rank test costs over its body: ``@pytest.mark.gradref_ranks(N)`` against a
plain test.

    python benchmarks/bench_ranks.py                  # 2 ranks on the CPU (gloo), 30 tests each
    python benchmarks/bench_ranks.py --ranks 4 --tests 50
    python benchmarks/bench_ranks.py --body torch-func  # each multi-rank test calls torch.func
    python benchmarks/bench_ranks.py --mixed       # world sizes 2 and 3, interleaved and grouped

Generates, in a temporary directory, ``--tests`` empty tests marked
``@pytest.mark.gradref_ranks(N)`` that take ``gradref_rank``, and as many plain tests that take
``gradref_device``, and runs them in one pytest run on the CPU with ``--junitxml``. A test's
time is its setup + call + teardown there; one more multi-rank test fails on rank 1, so the
pool is ended, and one after it starts a new pool. Printed: the first multi-rank test (it
starts the rank pool: the fork server, or spawned ranks, importing torch, then joining the
process group), the median, least and greatest of the others (a warm pool), the test after the
failure (a new pool, forked from the running fork server) and the plain tests' median.
``--body torch-func`` gives each multi-rank test a ``torch.func.grad_and_value`` call, as the
grad_and_value reference makes (its first call in a process imports torch._dynamo); the
default body is empty.

``--mixed``: ``--tests`` tests of 2 ranks and as many of 3, run once in file order interleaved
(2, 3, 2, 3, ...) and once grouped (all of 2, then all of 3), two pytest runs of one
invocation; printed: each order's wall time and summed test time, and interleaved / grouped.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _bench_util import git_commit

REPO = Path(__file__).resolve().parent.parent

TESTS = """
import pytest
import torch


@pytest.mark.parametrize("i", range({tests}))
@pytest.mark.gradref_ranks({ranks})
def test_ranked(i, gradref_rank):
    assert gradref_rank.world_size == {ranks}{body}


@pytest.mark.gradref_ranks({ranks})
def test_ranked_fails(gradref_rank):
    assert gradref_rank.rank == 0, "rank 1 fails: the pool is ended"


@pytest.mark.gradref_ranks({ranks})
def test_ranked_after_a_failure(gradref_rank):
    assert gradref_rank.world_size == {ranks}{body}


@pytest.mark.parametrize("i", range({tests}))
def test_plain(i, gradref_device):
    assert gradref_device.type == "cpu"
"""


BODIES = {
    "empty": "",
    "torch-func": """
    grad, value = torch.func.grad_and_value(lambda x: (x * x).sum())(torch.ones(3))
    assert value.item() == 3.0 and grad.tolist() == [2.0, 2.0, 2.0]""",
}

MIXED = """
import pytest

{tests}
"""

MIXED_TEST = """
@pytest.mark.gradref_ranks({ranks})
def test_{index}_ranks_{ranks}(gradref_rank):
    assert gradref_rank.world_size == {ranks}
"""


def _mixed_file(tests: int, interleaved: bool) -> str:
    sizes = [2, 3] * tests if interleaved else [2] * tests + [3] * tests
    cases = (MIXED_TEST.format(index=i, ranks=ranks) for i, ranks in enumerate(sizes))
    return MIXED.format(tests="\n".join(cases))


def _run(directory: Path, name: str, source: str) -> tuple[float, list[float]]:
    """One pytest run of a generated file: its wall time and each test's time."""
    (directory / name).write_text(source)
    junit = directory / f"{name}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    command += ["--gradref-device=cpu", f"--junitxml={junit}", name]
    start = time.perf_counter()
    subprocess.run(command, cwd=directory, check=True)
    wall = time.perf_counter() - start
    return wall, [float(c.attrib["time"]) for c in ET.parse(junit).getroot().iter("testcase")]


def mixed(tests: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        runs = {
            order: _run(directory, f"test_{order}.py", _mixed_file(tests, order == "interleaved"))
            for order in ("interleaved", "grouped")
        }
    print(f"# pytest-gradref rank pools, commit {git_commit(REPO)}")
    print(f"{tests} tests of gradref_ranks(2) and {tests} of gradref_ranks(3), CPU (gloo):")
    for order, (wall, times) in runs.items():
        print(f"  {order}: wall {wall:.2f} s, test-seconds {sum(times):.2f} s")
    (wall_i, times_i), (wall_g, times_g) = runs["interleaved"], runs["grouped"]
    print(
        f"interleaved / grouped: {wall_i / wall_g:.2f}x wall, "
        f"{sum(times_i) / sum(times_g):.2f}x test-seconds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--tests", type=int, default=30, help="tests of each kind (default 30)")
    parser.add_argument(
        "--body",
        choices=sorted(BODIES),
        default="empty",
        help="the multi-rank tests' body: empty (default) or a torch.func.grad_and_value call",
    )
    parser.add_argument(
        "--mixed", action="store_true", help="world sizes 2 and 3, interleaved against grouped"
    )
    args = parser.parse_args()
    if args.mixed:
        mixed(args.tests)
        return
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        (directory / "test_ranks_cost.py").write_text(
            TESTS.format(ranks=args.ranks, tests=args.tests, body=BODIES[args.body])
        )
        junit = directory / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly"]
        command += ["-p", "no:cacheprovider", "--gradref-device=cpu", f"--junitxml={junit}"]
        ran = subprocess.run([*command, "test_ranks_cost.py"], cwd=directory)
        cases = list(ET.parse(junit).getroot().iter("testcase"))
        failed = [c.attrib["name"] for c in cases if c.find("failure") is not None]
        # A test that failed by accident would end the pool too, and its time mean nothing.
        if ran.returncode != 1 or failed != ["test_ranked_fails"]:
            sys.exit(
                f"pytest exited {ran.returncode} with {failed} failed; expected 1, with only "
                "the planted failure test_ranked_fails"
            )
        times: dict[str, list[float]] = {
            "test_ranked": [],
            "test_ranked_fails": [],
            "test_ranked_after_a_failure": [],
            "test_plain": [],
        }
        # In file order: the ranked tests first, the first of them starting the pool.
        for case in cases:
            times[case.attrib["name"].split("[")[0]].append(float(case.attrib["time"]))
    first, *warm = times["test_ranked"]
    print(f"# pytest-gradref rank cost, commit {git_commit(REPO)}")
    print(
        f"gradref_ranks({args.ranks}) on the CPU (gloo), {args.tests} tests ({args.body} body), "
        "setup + call + teardown:"
    )
    print(f"  first (starts the pool): {first * 1e3:.0f} ms")
    print(
        f"  warm pool: median {statistics.median(warm) * 1e3:.2f} ms, least "
        f"{min(warm) * 1e3:.2f} ms, greatest {max(warm) * 1e3:.2f} ms"
    )
    after = times["test_ranked_after_a_failure"][0]
    print(f"  after a failing test (a new pool): {after * 1e3:.0f} ms")
    print(f"plain tests: median {statistics.median(times['test_plain']) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
