"""What a multi-rank test costs over its body: ``@pytest.mark.gradref_ranks(N)`` against a
plain test.

    python benchmarks/bench_ranks.py                  # 2 ranks on the CPU (gloo), 30 tests each
    python benchmarks/bench_ranks.py --ranks 4 --tests 50

Generates, in a temporary directory, ``--tests`` empty tests marked
``@pytest.mark.gradref_ranks(N)`` that take ``gradref_rank``, and as many plain tests that take
``gradref_device``, and runs them in one pytest run on the CPU with ``--junitxml``. A test's
time is its setup + call + teardown there. Printed: the first multi-rank test (it starts the
rank pool: spawning, importing torch, joining the process group), the median, least and
greatest of the others (a warm pool), and the plain tests' median.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from _bench_util import git_commit

REPO = Path(__file__).resolve().parent.parent

TESTS = """
import pytest


@pytest.mark.parametrize("i", range({tests}))
@pytest.mark.gradref_ranks({ranks})
def test_ranked(i, gradref_rank):
    assert gradref_rank.world_size == {ranks}


@pytest.mark.parametrize("i", range({tests}))
def test_plain(i, gradref_device):
    assert gradref_device.type == "cpu"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--tests", type=int, default=30, help="tests of each kind (default 30)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        (directory / "test_ranks_cost.py").write_text(
            TESTS.format(ranks=args.ranks, tests=args.tests)
        )
        junit = directory / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly"]
        command += ["-p", "no:cacheprovider", "--gradref-device=cpu", f"--junitxml={junit}"]
        subprocess.run([*command, "test_ranks_cost.py"], cwd=directory, check=True)
        times: dict[str, list[float]] = {"test_ranked": [], "test_plain": []}
        # In file order: the ranked tests first, the first of them starting the pool.
        for case in ET.parse(junit).getroot().iter("testcase"):
            times[case.attrib["name"].split("[")[0]].append(float(case.attrib["time"]))
    first, *warm = times["test_ranked"]
    print(f"# pytest-gradref rank cost, commit {git_commit(REPO)}")
    print(
        f"gradref_ranks({args.ranks}) on the CPU (gloo), {args.tests} tests, "
        "setup + call + teardown:"
    )
    print(f"  first (starts the pool): {first * 1e3:.0f} ms")
    print(
        f"  warm pool: median {statistics.median(warm) * 1e3:.2f} ms, least "
        f"{min(warm) * 1e3:.2f} ms, greatest {max(warm) * 1e3:.2f} ms"
    )
    print(f"plain tests: median {statistics.median(times['test_plain']) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
